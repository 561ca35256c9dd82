#!/usr/bin/env bash
# This session's third H200 call (repo root; carry .whl and .devcarry): the GPU tests of this session's GPU-only
# paths (one-call chunk attention, the host embedding's zero-copy lookup, the pool and graphs kept across
# sessions), then the engine alone at 8K (bench.profile --times 3), then bench.e2e's default row at 8K with the
# first input rail under torch's profiler (--trace-rail) and at 128K with the memory report.
#   bash docs/benchmarks/run_2026-12-02c/check.sh "$OUT"
set -uo pipefail
OUT=${1:?usage: check.sh OUTDIR}
source docs/benchmarks/run_2026-12-02c/setup.sh
P=/tmp/p; rm -rf $P; mkdir -p $P
(cd /tmp/src && timeout 170 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15) | tee "$OUT/gpu_tests.txt"
el "gpu tests done"
(cd /tmp && timeout 60 python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB --times 3 \
  --context 8192 --rows 25 --out "$P/profile_8192.txt" > /dev/null 2> "$P/profile_8192.err"); head -6 "$P/profile_8192.txt"
el "profile 8K done"
(cd /tmp && timeout 100 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $TOK --config $R/configs/flash \
  --rows default --contexts 8192 --trace-rail "$P/trace" --out "$OUT/e2e_8192.md" \
  --json "$OUT/e2e_8192.json" 2> "$P/e2e_8192.err" | grep -v '^{"row"' | tail -5); head -3 $P/trace-default.txt
el "e2e 8K done"
(cd /tmp && timeout 170 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $TOK --config $R/configs/flash \
  --rows default --contexts 131072 --memory-report --out "$OUT/e2e_131072.md" \
  --json "$OUT/e2e_131072.json" 2> "$P/e2e_131072.err" | grep -v '^{"row"' | tail -5)
el "e2e 128K done"
tar czf "$OUT/profiles.tgz" -C "$P" . ; ls -la "$OUT"
