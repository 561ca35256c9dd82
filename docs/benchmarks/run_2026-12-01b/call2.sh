#!/usr/bin/env bash
# This session's second H200 call (repo root; carry .whl and .devcarry, .devcarry/src.tar = `git archive HEAD` of
# the commit measured), no llama.cpp (its numbers: call 1, llamacpp.md):
#   bash docs/benchmarks/run_2026-12-01b/call2.sh "$OUT"
# 1. bench.profile on the engine alone: 129,024 random tokens prefilled (its first line: the engine's prefill time,
#    no rails, no tokenizer), then one 2,048-token chunk past the pool and 16 sparse decode steps under the torch
#    profiler (CUDA time against wall time: is the long prefill waiting on the GPU or on the host?);
# 2. bench.e2e's default row at 131,072 tokens alone (a fresh process: turn 1 prefills every token).
set -uo pipefail
OUT=${1:?usage: call2.sh OUTDIR}; R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
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
(cd /tmp && timeout ${PROFILE_TIMEOUT:-150} python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB \
  --context 129024 --out "$OUT/profile_129k.txt" > /dev/null 2> "$OUT/profile.err"); head -1 "$OUT/profile_129k.txt"
el "profile done"
(cd /tmp && timeout ${E2E_TIMEOUT:-200} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
  $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows default --contexts 131072 --out "$OUT/e2e_128k.md" \
  --json "$OUT/e2e_128k.json" 2> "$OUT/e2e_128k.err" | grep -v '^{"row"' | tail -8)
el "done"
