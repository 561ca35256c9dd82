#!/usr/bin/env bash
# This session's call 2 on the H200 (repo root; carry .whl and .devcarry, .devcarry/src.tar = `git archive HEAD`):
#   bash docs/benchmarks/run_2026-12-02/call2.sh "$OUT"
# bench.e2e's default row at 32K then 128K in one process, after the fix of the announced L2 room (a prompt that
# fits the pool pins nothing), with --memory-report: after each 128K turn, the allocator's pools and the largest live
# device tensors (e2e.err), to find what the new session adds (call 1: 0.23 GiB more allocated after it).
set -uo pipefail
OUT=${1:?usage: call2.sh OUTDIR}
source docs/benchmarks/run_2026-12-02/prelude.sh
(cd /tmp && timeout ${E2E_TIMEOUT:-240} python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
  $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows default --contexts ${CONTEXTS:-32768 131072} \
  --memory-report --out "$OUT/e2e.md" --json "$OUT/e2e.json" 2> "$OUT/e2e.err" | grep -v '^{"row"' | tail -9)
el "done"
