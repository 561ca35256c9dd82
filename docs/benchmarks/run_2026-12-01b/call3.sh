#!/usr/bin/env bash
# This session's third H200 call (repo root; carry .whl and .devcarry, .devcarry/src.tar = `git archive HEAD`):
# bench.e2e's default row at 32K then 128K in one process, as call 1 ran them (a 32K conversation before the 128K
# prompt), after the fix of the pinned L2 allocation a later, larger announcement now replaces:
#   bash docs/benchmarks/run_2026-12-01b/call3.sh "$OUT"
set -uo pipefail
OUT=${1:?usage: call3.sh OUTDIR}; R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
  2>&1 | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
el "installed"
(cd /tmp && timeout ${E2E_TIMEOUT:-240} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
  $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows default --contexts 32768 131072 --out "$OUT/e2e.md" \
  --json "$OUT/e2e.json" 2> "$OUT/e2e.err" | grep -v '^{"row"' | tail -9)
el "done"
