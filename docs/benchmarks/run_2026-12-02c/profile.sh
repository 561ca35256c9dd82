#!/usr/bin/env bash
# This session's first H200 call (repo root; carry .whl, .devcarry and .smol1, the first part of the embedded
# GGUF for call 2): where issue 13's remaining misses spend their time, before changing anything.
#   bash docs/benchmarks/run_2026-12-02c/profile.sh "$OUT"
# 1. bench.profile at 8K: three 8K prompts timed in new sessions (the process's first against the later ones), then
#    the whole 8K prefill under the profiler (GPU time against wall time);
# 2. bench.e2e's default and dynamic-fp16 rows at 8K with the sampler (the first request's input rail: 0.50 s
#    against 0.33 s);
# 3. bench.e2e's default row at 128K with the sampler and the memory report (the new session's 1.41 s; the memory
#    over 3.0 / 3.6 GiB).
# Everything but e2e's tables goes into one tarball (at most 8 files come back).
set -uo pipefail
OUT=${1:?usage: profile.sh OUTDIR}
source docs/benchmarks/run_2026-12-02c/setup.sh
P=/tmp/p; rm -rf $P; mkdir -p $P
(cd /tmp && timeout 90 python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB --whole --times 3 \
  --context 8192 --rows 30 --out "$P/profile_8192.txt" > /dev/null 2> "$P/profile_8192.err"); head -7 "$P/profile_8192.txt"
el "profile 8K done"
(cd /tmp && timeout 120 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $TOK --config $R/configs/flash \
  --rows default dynamic-fp16 --contexts 8192 --profile "$P/sampled_8192" --out "$OUT/e2e_8192.md" \
  --json "$OUT/e2e_8192.json" 2> "$P/e2e_8192.err" | grep -v '^{"row"' | tail -8)
el "e2e 8K done"
(cd /tmp && timeout 220 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $TOK --config $R/configs/flash \
  --rows default --contexts 131072 --profile "$P/sampled_131072" --memory-report --out "$OUT/e2e_131072.md" \
  --json "$OUT/e2e_131072.json" 2> "$P/e2e_131072.err" | grep -v '^{"row"' | tail -6)
el "e2e 128K done"
tar czf "$OUT/profiles.tgz" -C "$P" . ; ls -la "$OUT"
