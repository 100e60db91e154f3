#!/usr/bin/env bash
# Train the reference character on the GPU machine, then run the quality gate there on the shipped
# held-out speech. Usage (repo root): bash worker/train/run_gpu.sh OUTDIR [MINUTES] [SEED]
# The GPU machine has torch/numpy/av but not vivant (nor espeak-ng): the vivant namespace is assembled
# from symlinks, the dataset is the shipped weights/ref/data/ref_data.npz, the held-out speech the shipped
# weights/ref/data/held_out.wav. Weights are written before the evaluation, so a failing gate loses nothing.
set -u
OUT=${1:?usage: run_gpu.sh OUTDIR [MINUTES] [SEED]}
MINUTES=${2:-6}
SEED=${3:-0}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu TRAIN_ARGS="--max-clips 2" rehearses this script on a CPU machine
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_SECONDS=${EVAL_SECONDS:-60}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PKG=$(mktemp -d)/site
mkdir -p "$PKG/vivant"
for d in worker kernels sessions operator bench; do ln -s "$PWD/$d" "$PKG/vivant/$d"; done
ln -s "$PWD/cli/cli.py" "$PKG/vivant/cli.py"; ln -s "$PWD/cli/__main__.py" "$PKG/vivant/__main__.py"
# safetensors (abi3 wheel contents) when the machine lacks it and a copy was carried along
if ! python3 -c "import safetensors" 2>/dev/null; then
  for c in .venv/lib/python3.*/site-packages/safetensors; do [ -d "$c" ] && ln -s "$PWD/$c" "$PKG/safetensors" && break; done
fi
export PYTHONPATH="$PKG"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" | tee "$OUT/env.txt"
# shellcheck disable=SC2086
python3 -m vivant train ref --device "$DEVICE" --minutes "$MINUTES" --seed "$SEED" --out "$OUT" $TRAIN_ARGS 2>&1 | tee "$OUT/train.txt"
rc=${PIPESTATUS[0]}
echo "train exit $rc"
[ "$rc" = 0 ] || exit "$rc"
if python3 -c "import safetensors" 2>/dev/null; then
  python3 -m vivant eval quality --device "$DEVICE" --weights "$OUT" --wav weights/ref/data/held_out.wav \
      --seconds "$EVAL_SECONDS" --json --video "$OUT/eval_quality.mp4" > "$OUT/eval_quality_cuda.json" 2> "$OUT/eval_quality_cuda.err"
  echo "eval quality ($DEVICE) exit $?"; tail -5 "$OUT/eval_quality_cuda.err"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('latent_rel_rms_per_chunk'); print(json.dumps(d, indent=1))" \
      "$OUT/eval_quality_cuda.json"
else
  echo "eval skipped: no safetensors on this machine (carry .venv/lib/python3.11/site-packages/safetensors)"
fi
ls -la "$OUT"
