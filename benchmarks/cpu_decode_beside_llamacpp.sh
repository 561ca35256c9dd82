#!/usr/bin/env bash
# benchmarks.cpu_decode beside llama.cpp in one run, at 1 and 2 threads: llama-bench (the anchor's bench_cpu.sh,
# pp512 / tg128 on the embedded GGUF) before and after each flashguard run, so the ratio and the drift are both on
# record. From the project's root, in its .venv, after ../shared/anchors/llamacpp/prepare.sh:
#   bash benchmarks/cpu_decode_beside_llamacpp.sh OUT_DIR [benchmarks.cpu_decode options...]
# writes OUT_DIR/llamacpp_tT.md, llamacpp_after_tT.md, ours_tT.md and ours_tT.json.
set -euo pipefail
O=${1:?usage: cpu_decode_beside_llamacpp.sh OUT_DIR [benchmarks.cpu_decode options...]}; shift
mkdir -p "$O"
ANCHOR=${LLAMACPP_ANCHOR:-../shared/anchors/llamacpp}
for T in 1 2; do
  bash "$ANCHOR/bench_cpu.sh" "" "$T" > "$O/llamacpp_t$T.md"
  python -m benchmarks.cpu_decode --threads "$T" --repeats 3 --llamacpp "$O/llamacpp_t$T.md" \
    --out "$O/ours_t$T.md" --json "$O/ours_t$T.json" "$@"
  bash "$ANCHOR/bench_cpu.sh" "" "$T" > "$O/llamacpp_after_t$T.md"
done
