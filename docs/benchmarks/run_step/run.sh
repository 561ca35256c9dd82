#!/usr/bin/env bash
# The one-graph decode step, torch kernels against kv/step_kernels.py, on the H200 (one device call; repo root,
# carry .whl and .devcarry, where .devcarry/src.tar is the tree measured):
#   bash docs/benchmarks/run_step/run.sh "$OUT"
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR}
S=/tmp/src; mkdir -p "$S" "$OUT"
tar xf .devcarry/src.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
(cd $S && timeout 200 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider -k \
  "step_kernels or static_kv or int4_engine or int8_pool or prefix or sparse" 2>&1 | tail -15) | tee "$OUT/gpu_tests.txt"
echo "gpu tests took $(( $(date +%s) - t0 )) s"
(cd /tmp && timeout 300 python3 -m flashguard.bench.step --contexts 8192 32768 --out "$OUT/step.md" \
  --json "$OUT/step.json" 2> "$OUT/step.err" | grep -v '^{' ) ; tail -5 "$OUT/step.err"
echo "all took $(( $(date +%s) - t0 )) s"
