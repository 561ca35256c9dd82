#!/usr/bin/env bash
# The H200 run behind docs/benchmarks/e2e_h200.md, in one device call (repo root; carry .whl and .devcarry):
#   [KV_ROWS="dynamic-step default default-4gib"] bash docs/benchmarks/run_2026-11-30/run.sh "$OUT" [contexts...]
# 1. llama.cpp builds on cores 0-11 in the background (bench.sh's build steps; ../shared/anchors/llamacpp/bench.sh
#    is copied to .devcarry/llamacpp_bench.sh, and prepare.sh made .devcarry/llamacpp.tgz);
# 2. meanwhile, on cores 12-15: the random-weight DeepSeek-R1-Distill-Qwen-1.5B-shape checkpoints (real tokenizer),
#    the GPU tests, then `python -m flashguard.bench.e2e` (LLMRails on configs/flash, two turns per context);
# 3. then llama-bench on the same GPU, alone (decode at 8K / 32K / 128K depth, q8_0 and f16 KV, prefill 32K).
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR [contexts]}; shift
CONTEXTS=${*:-8192 32768 131072}
W=/tmp/e2e; mkdir -p "$W" "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . 2>&1 | tail -2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false   # flashguard as installed (rails/)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/smi.txt"
(R=$PWD; cd /tmp && python3 -c "from flashguard.bench.e2e import make_checkpoints; from pathlib import Path; \
  print(make_checkpoints(Path('$W'), '$R/.devcarry/ds-tokenizer'))" 2>&1 | tail -2)
L=/tmp/llamacpp; mkdir -p $L; tar xzf .devcarry/llamacpp.tgz -C $L   # the build steps of bench.sh, in the background
setsid taskset -c 0-11 bash -c "export PATH=/usr/local/cuda/bin:\$PATH; cd $L/llama.cpp && \
  cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_BUILD_TYPE=Release > $L/build.log 2>&1 && cmake --build build -j12 --target llama-bench llama-quantize \
  >> $L/build.log 2>&1; touch $W/llama.built" &
t0=$(date +%s)
taskset -c 12-15 python3 -m pytest -q tests/test_gpu.py -k "engine or static or prefix" -p no:cacheprovider 2>&1 \
  | tail -15 | tee "$OUT/gpu_tests.txt"
R=$PWD   # run from elsewhere: `python -m` puts the working folder first on sys.path, and the checkout's flashguard/
         # has no rails/ (the installed package maps it in)
(cd /tmp && taskset -c 12-15 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer $R/.devcarry/ds-tokenizer \
  --config $R/configs/flash --contexts $CONTEXTS --out "$OUT/e2e.md" --json "$OUT/e2e.json" 2> "$OUT/e2e.err" \
  | tail -30)
echo "e2e rows took $(( $(date +%s) - t0 )) s"
[ -n "${KV_ROWS:-}" ] && (cd /tmp && taskset -c 12-15 python3 -m flashguard.bench.kv --contexts $CONTEXTS \
  --rows $KV_ROWS --chunk 4096 --steps 32 --out "$OUT/kv.md" --json "$OUT/kv.json" 2> "$OUT/kv.err" | tail -12)
echo "our rows took $(( $(date +%s) - t0 )) s"
while [ ! -f "$W/llama.built" ]; do sleep 2; done; tail -3 $L/build.log
echo "llama.cpp built after $(( $(date +%s) - t0 )) s"
bash .devcarry/llamacpp_bench.sh $W/ds15b-fp16 "$OUT" 2>&1 | tail -12   # alone on the GPU: writes $OUT/llamacpp.md
