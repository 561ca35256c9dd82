#!/usr/bin/env bash
# The fifth session's second and third H200 calls (repo root; carry .whl and .devcarry, .devcarry/src.tar =
# `git archive HEAD`):
#   bash docs/benchmarks/run_2026-12-01/call3.sh "$OUT"                              # call 3 (6688cb0)
#   CONTEXTS=131072 MEMORY_REPORT= PROFILE= bash docs/benchmarks/run_2026-12-01/call3.sh "$OUT"   # call 2 (67ee757)
# 1. bench.e2e's default row at $CONTEXTS in one process (as call 1 ran it, where the 128K new session ran out of
#    memory), with the allocator's pools and live tensors after each turn at the largest context (e2e.err);
# 2. bench.l3's rows (run_l3/run.sh), with PROFILE=1 where the decoding thread's time goes.
set -uo pipefail
OUT=${1:?usage: call3.sh OUTDIR}; R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
el "installed"
(cd /tmp && timeout ${E2E_TIMEOUT:-200} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $R/.devcarry/ds-tokenizer \
  --config $S/configs/flash --rows default --contexts ${CONTEXTS:-8192 32768 131072} \
  ${MEMORY_REPORT---memory-report} --out "$OUT/e2e.md" \
  --json "$OUT/e2e.json" 2> "$OUT/e2e.err" | grep -v '^{"row"' | tail -14)
el "e2e done"; grep -E "^--- memory|segments by pool|live CUDA" "$OUT/e2e.err"
cd "$R" && PROFILE=${PROFILE-1} L3_TIMEOUT=${L3_TIMEOUT:-150} bash docs/benchmarks/run_l3/run.sh "$OUT"
rm -f "$OUT/smi.txt" "$OUT/l3.log"
el "done"
