#!/usr/bin/env bash
# One GPU-machine call: smoke-check the fast path, run the GPU tests, then the benchmarks.
# Usage (on the GPU machine, repo root): bash bench/run_gpu.sh OUTDIR
# The machine has torch/triton but not vivant installed: the vivant namespace is assembled from symlinks.
set -u
OUT=${1:-out/gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PKG=$(mktemp -d)/site
mkdir -p "$PKG/vivant"
# the layout of pyproject.toml's package-dir: `vivant` is cli/, each other top-level folder a subpackage
for d in apis operator gateway worker kernels sessions bench devcluster; do ln -s "$PWD/$d" "$PKG/vivant/$d"; done
for f in cli/*.py; do ln -s "$PWD/$f" "$PKG/vivant/$(basename "$f")"; done
export PYTHONPATH="$PKG:$PWD/tests"
# Packages the machine's image lacks travel as wheels in .whl/ (redis, pydantic, av: requirements/worker.txt's pins)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# Packages too large for one call's 64 MiB travel as an xz'd tar of installed files, split over consecutive calls
# (bench/gpu_stage.sh writes .stage-*/). Each call's copy of the repo starts afresh, but /tmp stays while the machine
# is warm: every call moves the parts it carried to /tmp/vivant-stage, and once all are there they are unpacked
# into /tmp/site (and livekit-server into /tmp/vivant-bin)
STAGE=/tmp/vivant-stage
mkdir -p "$STAGE"
for f in .stage-*/*; do [ -f "$f" ] && cp "$f" "$STAGE/"; done
if ls "$STAGE"/site.tar.xz.part-* >/dev/null 2>&1 && [ ! -f /tmp/site/.staged ]; then
    want=$(cat "$STAGE/parts"); have=$(ls "$STAGE"/site.tar.xz.part-* | wc -l)
    if [ "$have" = "$want" ]; then
        mkdir -p /tmp/site && cat $(ls "$STAGE"/site.tar.xz.part-* | sort) | xz -d | tar x -C /tmp/site \
            && touch /tmp/site/.staged && echo "staged packages unpacked into /tmp/site"
    else echo "staged packages: $have of $want parts here"; fi
fi
[ -f /tmp/site/.staged ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
if [ -f "$STAGE/livekit-server.xz" ] && [ ! -x /tmp/vivant-bin/livekit-server ]; then
    mkdir -p /tmp/vivant-bin && xz -dc "$STAGE/livekit-server.xz" > /tmp/vivant-bin/livekit-server \
        && chmod +x /tmp/vivant-bin/livekit-server
fi
[ -x /tmp/vivant-bin/livekit-server ] && export VIVANT_LIVEKIT_SERVER=/tmp/vivant-bin/livekit-server
# the agent's speech made beforehand (.tts/), kept for the calls that follow
if ls .tts/*.wav >/dev/null 2>&1; then mkdir -p /tmp/vivant-tts && cp .tts/*.wav /tmp/vivant-tts/; fi
# redis-server from Debian packages in .deb/ (unpacked beside, never over /), run through a wrapper that finds its libs
if [ -z "${REDIS_SERVER:-}" ] && { ls .deb/redis-server_*.deb >/dev/null 2>&1 || [ -x /tmp/redis-root/usr/bin/redis-server ]; }; then
    for f in .deb/*.deb; do [ -f "$f" ] && dpkg -x "$f" /tmp/redis-root; done
    mkdir -p /tmp/vivant-bin
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/redis-root/usr/lib/x86_64-linux-gnu exec /tmp/redis-root/usr/bin/redis-server "$@"\n' \
        > /tmp/vivant-bin/redis-server && chmod +x /tmp/vivant-bin/redis-server && export REDIS_SERVER=/tmp/vivant-bin/redis-server
    export PATH="/tmp/vivant-bin:$PATH"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
STEPS=${STEPS:-smoke,tests,tp4,tp1,decode}  # which parts to run (comma-separated)
step() { case ",$STEPS," in *",$1,"*) ;; *) return 0;; esac; shift
         echo "=== $1"; shift; ( "$@" ) 2>&1 | tee -a "$OUT/log.txt" | tail -25; }
step smoke "smoke: tiny on cuda, the served engine (FP8 parts, CUDA graphs) vs the float parts" python3 bench/gpu_smoke.py
step tests "gpu tests" python3 -m pytest -q -m gpu tests/kernels tests/stream/test_decode_gpu.py tests/core/test_warm_up.py \
    tests/core/test_ablation_parts_gpu.py tests/core/test_rewind.py tests/quality/test_eval_quality_gpu.py ${GPU_TESTS:-} -p no:cacheprovider
step tp4 "bench step 57b tp4 rank0" python3 -m vivant bench step --preset 57b --tp 4 --rank 0 --device ${SESSION_DEVICE:-cuda} \
    --chunks 20 --warmup 8 --numerics-chunks ${NUMERICS_CHUNKS:-104} ${STEP_ARGS:-} --out "$OUT/step_57b_tp4_rank0${STEP_TAG:-}.json"
# the turn latency on the served engine (bench/turn.py): ref as it is, and with each chunk padded to the 57b step
# (TURN_RUNS: which of the two, default both: ref,57b)
step turn "bench turn: ref on cuda, and at the 57b per-rank step time" bash -c "case ,${TURN_RUNS:-ref,57b}, in *,ref,*) \
    timeout ${TURN_TIMEOUT:-150} python3 -m vivant bench turn --preset ref --device cuda --turns ${TURNS:-20} \
    --json $OUT/turn_ref_cuda.json;; esac; case ,${TURN_RUNS:-ref,57b}, in *,57b,*) \
    timeout ${TURN_TIMEOUT:-150} python3 -m vivant bench turn --preset ref --device cuda --turns ${TURNS:-20} \
    --step-ms ${TURN_STEP_MS:-109.95} --json $OUT/turn_ref_cuda_57b-step.json;; esac"
# each engine choice against its absence, one process, same weights (bench/ablation.py; docs/BENCHMARKS.md's head)
step ablation "bench step --ablation 57b tp4 rank0: one choice undone per row" python3 -m vivant bench step --ablation \
    --preset 57b --tp 4 --rank 0 --device cuda --chunks ${ABLATION_CHUNKS:-20} --warmup ${ABLATION_WARMUP:-8} \
    ${ABLATION_ARGS:-} --out "$OUT/ablation_57b_tp4_rank0${ABLATION_TAG:-}.json"
step tp1 "bench step 57b tp1" python3 -m vivant bench step --preset 57b --tp 1 --device cuda --mode optimized \
    --chunks 20 --warmup 3 --out "$OUT/step_57b_tp1.json"
# the served runtime for one 60 s session (Redis, the worker's ranks, the pacer): REDIS_SERVER names a redis-server
# binary (docs/BENCHMARKS.md: the Debian packages unpacked with dpkg -x), else the one on PATH
step session "served runtime: 60 s ref session, 1 DiT rank + decoder on the same GPU" python3 bench/gpu_session.py \
    --seconds ${SESSION_SECONDS:-60} --tp ${SESSION_TP:-1} --decoder-device ${SESSION_DECODER:-shared} --preset ${SESSION_PRESET:-ref} --device ${SESSION_DEVICE:-cuda} \
    ${REDIS_SERVER:+--redis-server "$REDIS_SERVER"} --out "$OUT/session_ref_tp1.json"
# the quality gate on what is served: the engine a worker runs (FP8 parts, CUDA graphs) vs the float32 path, ref
step quality "eval quality: served engine on ref vs float32, held-out speech" bash -c "python3 -m vivant eval quality \
    --device cuda --wav weights/ref/data/held_out.wav --seconds ${QUALITY_SECONDS:-60} --json > $OUT/quality_ref_cuda.json"
# whole LiveKit calls on this machine, measured at each receiver (bench/livekit_call.py): the ref character on the GPU,
# the agent's speech made beforehand (.tts/ -> /tmp/vivant-tts, bench/gpu_stage.sh: espeak-ng is not here). CALL_SECONDS per call,
# CALL_COUNTS concurrent calls per round (e.g. 4,8,16), CALL_ARGS e.g. "--step-ms 103 --interrupt-every 4"
step call "bench call: ref on cuda into a real LiveKit room, measured at the receivers" python3 -m vivant bench call \
    --device cuda --tts-cache /tmp/vivant-tts --seconds ${CALL_SECONDS:-60} --calls ${CALL_COUNTS:-1} ${CALL_ARGS:-} \
    --out "${CALL_OUT:-$OUT/call${CALL_TAG:-}}"
step decode "bench decode 57b" python3 -m vivant bench decode --preset 57b --device cuda --chunks 20 --json --out "$OUT/decode_57b.json"
ls -la "$OUT"
