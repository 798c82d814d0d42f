#!/usr/bin/env bash
# The GPU checks and benchmarks as one prepared run (used on a borrowed CUDA machine).
#   bash scripts/gpu_session.sh checks   # cuda_checks + bench_dit + bench_sparse_conv   (~4 min on an H200)
#   bash scripts/gpu_session.sh memory   # bench_memory_cuda: staged vs resident        (~6 min)
# Results go to $OUT (or outputs/gpu). Wheels for packages the machine lacks may sit in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case "${1:-checks}" in
  checks)
    python3 scripts/cuda_checks.py --out "$OUT/cc" 2>&1 | tee "$OUT/cuda_checks.log" | grep -v '^\[' || true
    python3 scripts/bench_dit.py --model shape --tokens 4096,20000,32768 --device cuda 2>&1 | tee "$OUT/bench_dit.log"
    python3 scripts/bench_dit.py --model ss --device cuda 2>&1 | tee -a "$OUT/bench_dit.log"
    python3 scripts/bench_sparse_conv.py --device cuda --voxels 100000 1000000 --channels 64 128 256 --dtype fp16 \
      2>&1 | tee "$OUT/bench_sparse_conv.log"
    ;;
  memory)
    python3 scripts/bench_memory_cuda.py --out "$OUT/bm" --jobs 12 2>&1 | tee "$OUT/bench_memory_cuda.log" | tail -40
    cp "$OUT"/bm/*.md "$OUT"/bm/*.json "$OUT"/ 2>/dev/null || true
    ;;
esac
