#!/usr/bin/env bash
# The H200 runs behind docs/benchmarks/e2e_h200.md's int8-pool section, one device call each (repo root; carry
# .whl and .devcarry, where .devcarry/src.tar is `git archive HEAD` of the commit measured):
#   ROWS="default" LLAMA=1 LLAMA_KV=q8_0 SKIP_TESTS=1 bash docs/benchmarks/run_2026-11-30b/run.sh "$OUT" [contexts...]
# 1. with LLAMA=1, llama.cpp builds on cores 0-11 in the background (../shared/anchors/llamacpp/bench.sh's build
#    steps; bench.sh copied to .devcarry/llamacpp_bench.sh, prepare.sh made .devcarry/llamacpp.tgz);
# 2. meanwhile, on cores 12-15: the GPU tests, the random-weight DeepSeek-R1-Distill-Qwen-1.5B-shape checkpoints
#    (real tokenizer), then `python -m flashguard.bench.e2e --rows $ROWS` (LLMRails on configs/flash);
# 3. then llama-bench on the same GPU, alone (decode at 8K / 32K / 128K depth, q8_0 and f16 KV, prefill 32K).
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR [contexts]}; shift
CONTEXTS=${*:-8192 32768 131072}
ROWS=${ROWS:-default fp16-pool chunk-2048 dynamic-fp16}
R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
tar xf .devcarry/src.tar -C $S   # the measured commit, whatever else the working tree holds
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
  transformers.__version__, 'triton', triton.__version__)" >> "$OUT/smi.txt"
L=/tmp/llamacpp
if [ -n "${LLAMA:-}" ]; then
  mkdir -p $L; tar xzf .devcarry/llamacpp.tgz -C $L
  setsid taskset -c 0-11 bash -c "export PATH=/usr/local/cuda/bin:\$PATH; cd $L/llama.cpp && \
    cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_TYPE=Release > $L/build.log 2>&1 && cmake --build build -j12 --target llama-bench llama-quantize \
    >> $L/build.log 2>&1; touch $W/llama.built" &
fi
t0=$(date +%s)
[ -z "${SKIP_TESTS:-}" ] && (cd $S && taskset -c 12-15 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
  -x 2>&1 | tail -15) | tee "$OUT/gpu_tests.txt"
echo "gpu tests took $(( $(date +%s) - t0 )) s"
(cd /tmp && python3 -c "from flashguard.bench.e2e import make_checkpoints; from pathlib import Path; \
  print(make_checkpoints(Path('$W'), '$R/.devcarry/ds-tokenizer'))" 2>&1 | tail -2)
(cd /tmp && taskset -c 12-15 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $R/.devcarry/ds-tokenizer \
  --config $S/configs/flash --rows $ROWS --contexts $CONTEXTS --out "$OUT/e2e.md" --json "$OUT/e2e.json" \
  2> "$OUT/e2e.err" | tee "$OUT/e2e.jsonl" | grep -v '^{"row"' | tail -40)
echo "our rows took $(( $(date +%s) - t0 )) s"
if [ -n "${LLAMA:-}" ]; then
  while [ ! -f "$W/llama.built" ]; do sleep 2; done; tail -3 $L/build.log
  echo "llama.cpp built after $(( $(date +%s) - t0 )) s"
  # LLAMA_KV="q8_0" runs the q8_0 rows only (the anchor), to fit one call
  sed "s/for kv in q8_0 f16/for kv in ${LLAMA_KV:-q8_0 f16}/" .devcarry/llamacpp_bench.sh > /tmp/llamacpp_bench.sh
  bash /tmp/llamacpp_bench.sh $W/ds15b-fp16 "$OUT" 2>&1 | tail -12   # alone on the GPU: $OUT/llamacpp.md
fi
