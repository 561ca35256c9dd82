#!/usr/bin/env bash
# This session's call 1 on the H200 (repo root; carry .whl and .devcarry, .devcarry/src.tar = `git archive HEAD`):
#   bash docs/benchmarks/run_2026-12-02/profile.sh "$OUT"
# Where a short and a mid-length prompt's first token goes, and a 128K new session's: (1) bench.profile --whole on
# the engine alone at 8K and 32K random tokens (the torch profiler over the whole prefill: GPU time against wall
# time); (2) bench.e2e's default row with --profile (bench.sampler: where the serving threads' time goes in every
# turn) at 32K, then at 128K, each in its own process.
set -uo pipefail
OUT=${1:?usage: profile.sh OUTDIR}
source docs/benchmarks/run_2026-12-02/prelude.sh
for c in 8192 32768; do
  (cd /tmp && timeout 120 python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB --whole \
    --context $c --rows 25 --out "$OUT/profile_$c.txt" > /dev/null 2> "$OUT/profile_$c.err"); head -1 "$OUT/profile_$c.txt"
  el "profile $c done"
done
for c in 32768 131072; do
  (cd /tmp && timeout ${E2E_TIMEOUT:-200} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
    $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows default --contexts $c --profile "$OUT/sampled_$c" \
    --out "$OUT/e2e_$c.md" --json "$OUT/e2e_$c.json" 2> "$OUT/e2e_$c.err" | grep -v '^{"row"' | tail -5)
  el "e2e $c done"
done
