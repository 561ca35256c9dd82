#!/usr/bin/env bash
# This session's calls 2 and 3 on the H200 (repo root; carry .whl and .devcarry, .devcarry/src.tar = `git archive
# HEAD` of the commit measured), no llama.cpp (its numbers: call 1, llamacpp.md):
#   PROFILE=1 CONTEXTS=131072 bash docs/benchmarks/run_2026-12-01b/calls.sh "$OUT"    # call 2 (its e2e files were
#                                                                                      # named e2e_128k.*)
#   CONTEXTS="32768 131072" bash docs/benchmarks/run_2026-12-01b/calls.sh "$OUT"       # call 3
# PROFILE=1: bench.profile on the engine alone first: 129,024 random tokens prefilled (its first line: the engine's
# prefill time, no rails, no tokenizer), then one 2,048-token chunk past the pool and 16 sparse decode steps under
# the torch profiler (GPU time against wall time). Then bench.e2e's default row at CONTEXTS in one process (call 3:
# a 32K conversation before the 128K prompt, as in call 1).
set -uo pipefail
OUT=${1:?usage: calls.sh OUTDIR}; R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
  2>&1 | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
(cd /tmp && python3 -c "from flashguard.bench.e2e import make_checkpoints; from pathlib import Path; \
  print(make_checkpoints(Path('$W'), '$R/.devcarry/ds-tokenizer'))" 2>&1 | tail -1)
el "installed"
if [ -n "${PROFILE:-}" ]; then
  (cd /tmp && timeout ${PROFILE_TIMEOUT:-150} python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB \
    --context 129024 --out "$OUT/profile_129k.txt" > /dev/null 2> "$OUT/profile.err"); head -1 "$OUT/profile_129k.txt"
  el "profile done"
fi
(cd /tmp && timeout ${E2E_TIMEOUT:-240} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
  $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows default --contexts ${CONTEXTS:-131072} \
  --out "$OUT/e2e.md" --json "$OUT/e2e.json" 2> "$OUT/e2e.err" | grep -v '^{"row"' | tail -9)
el "done"
