#!/usr/bin/env bash
# One prepared GPU session for the packed decode kernels (docs/benchmarks.md, "Split-K decode
# kernel"), for a fresh CUDA machine with this repository checked out (run from its root):
#
#   OUT=runs/gpu bash benchmarks/gpu_session.sh            # everything, < 8 minutes
#   bash benchmarks/gpu_session.sh --dry-run                # print the plan (no CUDA needed)
#
# Steps, each under a hard `timeout` (seconds), each logged to $OUT/<step>.log with its exit
# status in $OUT/status.txt; a failed step does not stop the later ones:
#   env      (20)  device name, driver, torch / triton versions
#   install  (90)  only if `import torch, triton, pytest, hypothesis` fails:
#                  pip install -e ".[test,triton]" (needs a package index; the sources run from
#                  src/ through PYTHONPATH either way)
#   tests_splitk (60)  pytest -q -m triton tests/pnmix/test_triton_splitk.py (the new kernel)
#   bytes    (20)  benchmarks/decode_bytes.py at 64K x batch 8 for the device's bandwidth
#   sweep   (230)  benchmarks/splitk_decode.py: old kernel vs split-K vs float16 SDPA under
#                  CUDA graphs, SmolLM2 and Qwen2.5-1.5B shapes, seed / pn-mix / kivi-2bit;
#                  its own budget stops new measurements at 190 s (partial results are kept)
#   tests_triton (100) pytest -q -m triton tests/pnmix, the rest (the older kernel)
#   agreement (60) benchmarks/pnmix_cpu_cuda_agreement.py --seeds 42: where the CUDA run of the
#                  PN-Mix diagnostic parts from the CPU's (docs/benchmarks.md, the H200 run)
# The measurements come first, so a slow machine loses the checks, not the sweep. Worst case
# 490 s of timeouts (8.2 min) when the install step finds everything installed.
set -u
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset KVLAB_PNMIX_BACKEND TRITON_INTERPRET
mkdir -p "$OUT"
[ $DRY = 1 ] || : > "$OUT/status.txt"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (timeout ${limit}s): $*"
  [ $DRY = 1 ] && return 0
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/status.txt"
  tail -n 5 "$OUT/$name.log"
}

step env 20 bash -c "nvidia-smi; $PY -c 'import torch, sys; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.is_available()); print(torch.cuda.get_device_name(0)); import triton; print(\"triton\", triton.__version__)'"
step install 90 bash -c "$PY -c 'import torch, triton, pytest, hypothesis' 2>/dev/null && echo 'already installed' || $PY -m pip install --retries 0 --timeout 10 -e '.[test,triton]'"
step tests_splitk 60 "$PY" -m pytest -q -m triton tests/pnmix/test_triton_splitk.py -p no:cacheprovider
BW=$($PY - <<'PY' 2>/dev/null || echo 4.8e12
import torch
from kvlab.pnmix.kernels.bytes_model import PEAK_BANDWIDTH
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H200"
print(next((v for k, v in PEAK_BANDWIDTH.items() if k in name), 4.8e12))
PY
)
step bytes 20 "$PY" benchmarks/decode_bytes.py --batch 8 --tokens 65536 --bandwidth "$BW" --json "$OUT/bytes.json"
if [ $DRY = 1 ]; then
  "$PY" benchmarks/splitk_decode.py --dry-run --out "$OUT/sweep"
else
  step sweep 230 "$PY" benchmarks/splitk_decode.py --out "$OUT/sweep" --budget-s 190
  cat "$OUT/sweep/results.md" 2>/dev/null
fi
step tests_triton 100 "$PY" -m pytest -q -m triton tests/pnmix -p no:cacheprovider --ignore tests/pnmix/test_triton_splitk.py
step agreement 60 "$PY" benchmarks/pnmix_cpu_cuda_agreement.py --seeds 42
echo "results in $OUT"
