#!/usr/bin/env bash
# The fifth session's second H200 call (repo root; carry .whl and .devcarry, .devcarry/src.tar = `git archive HEAD`):
#   bash docs/benchmarks/run_2026-12-01/call2.sh "$OUT"
# 1. bench.e2e's default row at 128K alone (turn 1, turn 2, a new session), with its memory at each turn's end
#    and, where a turn fails, torch's allocator summary and the largest live device tensors (e2e.err);
# 2. bench.l3's rows (run_l3/run.sh) on the same tree.
set -uo pipefail
OUT=${1:?usage: call2.sh OUTDIR}; R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
el "installed"
(cd /tmp && timeout ${E2E_TIMEOUT:-150} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $R/.devcarry/ds-tokenizer \
  --config $S/configs/flash --rows default --contexts 131072 --out "$OUT/e2e.md" --json "$OUT/e2e.json" \
  2> "$OUT/e2e.err" | grep -v '^{"row"' | tail -12)
el "e2e done"; grep -A40 "live CUDA" "$OUT/e2e.err" | head -30
cd "$R" && L3_TIMEOUT=${L3_TIMEOUT:-170} bash docs/benchmarks/run_l3/run.sh "$OUT"
el "done"
