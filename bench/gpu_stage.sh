#!/usr/bin/env bash
# Stage what the GPU machine lacks for `STEPS=call` of bench/run_gpu.sh, on a machine with pip, Go and espeak-ng:
#   bash bench/gpu_stage.sh        (repo root; writes the ignored folders .stage-1 .. .stage-K, .deb, .tts)
# The GPU machine runs the project's code on its own Python 3.12 and torch; it has no livekit, livekit-agents, PyAV,
# redis-py, Redis server, espeak-ng or livekit-server, and nothing can be fetched there. One call carries at most
# 64 MiB with the repo, so the cp312 wheels (requirements/worker.txt's pins, less what the machine's torch brings,
# plus the agent's Runway plugin) are unpacked into one tree, xz'd and split into parts of STAGE_PART_MB, one part
# per folder; the last folder also holds livekit-server (built from tools/livekit/go.mod, xz'd). Carry .stage-1
# (with .deb and .tts) in one call, .stage-2 in the next, ... while the machine stays warm; run_gpu.sh unpacks the
# tree once every part is there.
set -euo pipefail
PART_MB=${STAGE_PART_MB:-36}
PY=${PY:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the worker's pins less torch's own stack (the GPU machine's torch 2.11 brings it), plus the agent's plugin
grep -E '^[A-Za-z0-9_.-]+==' requirements/worker.txt \
    | grep -viE '^(torch|triton|numpy|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|setuptools|nvidia-|cuda-)' \
    > "$work/reqs.txt"
grep -E '^(livekit-plugins-runway|aiohttp-retry)==' requirements/dev.txt >> "$work/reqs.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$work/wheels" -r "$work/reqs.txt"
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do unzip -qo "$w" -d "$work/site"; done
rm -rf .stage-*
tar cf - -C "$work/site" . | xz -T0 -6 > "$work/site.tar.xz"
split -b "${PART_MB}M" -d -a 2 "$work/site.tar.xz" "$work/site.tar.xz.part-"
parts=$(ls "$work"/site.tar.xz.part-* | wc -l)
k=0
for part in $(ls "$work"/site.tar.xz.part-* | sort); do
    k=$((k + 1)); mkdir -p ".stage-$k"; mv "$part" ".stage-$k/"; echo "$parts" > ".stage-$k/parts"
done
lk=$($PY -c 'from vivant.devcluster.binaries import ensure_livekit_server; print(ensure_livekit_server())')
xz -T0 -6 -c "$lk" > ".stage-$k/livekit-server.xz"
# redis-server from Debian packages (unpacked there with dpkg -x, beside /, never over it)
rm -rf .deb && mkdir -p .deb && (cd .deb && apt-get download redis-server redis-tools liblzf1 libjemalloc2 2>/dev/null)
# the agent's scripted speech (espeak-ng is not on the GPU machine)
$PY -m vivant bench call --prepare-tts --tts-cache .tts
for d in .stage-* .deb .tts; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
du -sh .stage-* .deb .tts
echo "carry, one call each while the machine stays warm: [.stage-1, .deb, .tts], then .stage-2 ... .stage-$k"
