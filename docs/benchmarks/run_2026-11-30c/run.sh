#!/usr/bin/env bash
# The third session's H200 call behind docs/benchmarks/e2e_h200.md ("Third session"), one device call (repo root;
# carry .whl and .devcarry, where .devcarry/src.tar is `git archive HEAD` of the commit measured):
#   ROWS="default l3-half" BIG=1 bash docs/benchmarks/run_2026-11-30c/run.sh "$OUT" 8192 32768 131072
#   (TESTS=1: the GPU tests first; PROFILE=1: bench.profile; BIG=1: bench.big's 7B rows; E2E_ARGS: more
#   bench.e2e arguments; E2E_TIMEOUT: seconds for our rows, 300; ANCHOR_PROMPTS: llama.cpp's prefill lengths,
#   "32768 131072" unless set (the eighth session added 8192). The fifth session's call 1 was E2E_ARGS='--profile $OUT/profile' ROWS="default l3-half")
# 1. llama.cpp builds on cores 0-11 in the background (llama-bench, llama-quantize, and llama-fit-params, which
#    docs/benchmarks/run_7b/run.sh uses when it runs next on the same machine);
# 2. meanwhile, on cores 12-15: the GPU tests, the random-weight DeepSeek-R1-Distill-Qwen-1.5B-shape checkpoints
#    (real tokenizer), then `python -m flashguard.bench.e2e --rows $ROWS` (LLMRails on configs/flash);
# 3. with PROFILE=1 `python -m flashguard.bench.profile` (a prefill chunk past the pool and sparse decode steps at
#    64K, profiled); with BIG=1 `python -m flashguard.bench.big` (the 7B shape in 4 GiB, streamed layers);
# 4. then llama-bench on the same GPU, alone: decode (tg32) at 8K / 32K / 128K depth with q8_0 KV, prefill of 32K
#    and of 128K (the 128K TTFT anchor).
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR [contexts]}; shift
CONTEXTS=${*:-8192 32768 131072}
ROWS=${ROWS:-default l3-half}
R=$PWD; S=/tmp/src; W=/tmp/e2e; L=/tmp/llamacpp; mkdir -p "$S" "$W" "$OUT" "$L"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S
tar xzf .devcarry/llamacpp.tgz -C $L
setsid taskset -c 0-11 bash -c "export PATH=/usr/local/cuda/bin:\$PATH; cd $L/llama.cpp && \
  cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_BUILD_TYPE=Release > $L/build.log 2>&1 && cmake --build build -j12 --target llama-bench llama-quantize \
  llama-fit-params >> $L/build.log 2>&1; touch $W/llama.built" &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
  transformers.__version__, 'triton', triton.__version__)" >> "$OUT/smi.txt"
el "installed"
[ -n "${TESTS:-}" ] && (cd $S && timeout 150 taskset -c 12-15 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
  2>&1 | tail -6) | tee "$OUT/gpu_tests.txt" && el "gpu tests done"
(cd /tmp && python3 -c "from flashguard.bench.e2e import make_checkpoints; from pathlib import Path; \
  print(make_checkpoints(Path('$W'), '$R/.devcarry/ds-tokenizer'))" 2>&1 | tail -2)
(cd /tmp && timeout ${E2E_TIMEOUT:-300} taskset -c 12-15 python3 -m flashguard.bench.e2e --workdir "$W" --tokenizer \
  $R/.devcarry/ds-tokenizer --config $S/configs/flash --rows $ROWS --contexts $CONTEXTS --out "$OUT/e2e.md" \
  --json "$OUT/e2e.json" ${E2E_ARGS:-} 2> "$OUT/e2e.err" | tee "$OUT/e2e.jsonl" | grep -v '^{"row"' | tail -30)
el "our rows done"
if [ -n "${PROFILE:-}" ]; then
  (cd /tmp && timeout 75 taskset -c 12-15 python3 -m flashguard.bench.profile --model $W/ds15b-int4 --budget 4GiB \
    --context 65536 --out "$OUT/profile.txt" > /dev/null 2> "$OUT/profile.err"); tail -2 "$OUT/profile.err"
  el "profile done"
fi
if [ -n "${BIG:-}" ]; then   # issue 18's 7B in 4 GiB, our side (llama.cpp's: docs/benchmarks/run_7b/run.sh)
  (cd /tmp && timeout 80 taskset -c 12-15 python3 -m flashguard.bench.big --tokenizer $R/.devcarry/ds-tokenizer \
    --budget 4GiB --contexts 8192 32768 --chunks auto --steps 64 --out "$OUT/big.md" --json "$OUT/big.json" \
    2> "$OUT/big.err" | grep -v '^{"chunk"' | tail -12)
  el "7B done"
fi
while [ ! -f "$W/llama.built" ]; do sleep 2; done; tail -2 $L/build.log
el "llama.cpp built"
PP=""; for p in ${ANCHOR_PROMPTS:-32768 131072}; do PP="$PP run -ctk q8_0 -ctv q8_0 -p $p -n 0;"; done   # prefill anchors
sed -e "s/for kv in q8_0 f16/for kv in q8_0/" -e "s/run -ctk q8_0 -ctv q8_0 -p 32768 -n 0;/$PP/" \
    .devcarry/llamacpp_bench.sh > /tmp/llamacpp_bench.sh
grep -c "131072 -n 0" /tmp/llamacpp_bench.sh
timeout 150 bash /tmp/llamacpp_bench.sh $W/ds15b-fp16 "$OUT" 2>&1 | tail -12   # alone on the GPU: $OUT/llamacpp.md
el "done"
