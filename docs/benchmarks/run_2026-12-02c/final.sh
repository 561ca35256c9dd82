#!/usr/bin/env bash
# This session's last H200 call (repo root; carry .whl and .devcarry): issue 13's table with llama.cpp in the same
# call, as docs/benchmarks/run_2026-11-30c/run.sh did (same rows, same anchor), on this session's tree:
#   bash docs/benchmarks/run_2026-12-02c/final.sh "$OUT"
# 1. llama.cpp builds on cores 0-11 in the background; 2. meanwhile, on cores 12-15: the GPU tests, then
# bench.e2e's rows default (8K / 32K / 128K) and l3-half (128K), LLMRails on configs/flash (ROWS="default
# dynamic-fp16 l3-half" adds the uncapped fp16 reference at 8K / 32K: ~80 s more, left out when device time is short);
# 3. llama-bench alone on the GPU: decode at 8K / 32K / 128K depth with q8_0 KV, prefill of 8K / 32K / 128K.
set -uo pipefail
OUT=${1:?usage: final.sh OUTDIR}
L=/tmp/llamacpp; mkdir -p $L
tar xzf .devcarry/llamacpp.tgz -C $L
setsid taskset -c 0-11 bash -c "export PATH=/usr/local/cuda/bin:\$PATH; cd $L/llama.cpp && \
  cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_BUILD_TYPE=Release > $L/build.log 2>&1 && cmake --build build -j12 --target llama-bench llama-quantize \
  >> $L/build.log 2>&1; touch $L/built" &
source docs/benchmarks/run_2026-12-02c/setup.sh
(cd /tmp/src && timeout 90 taskset -c 12-15 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider 2>&1 \
  | grep -v -i warn | tail -6) | tee "$OUT/gpu_tests.txt"
el "gpu tests done"
(cd /tmp && timeout ${E2E_TIMEOUT:-250} taskset -c 12-15 python3 -m flashguard.bench.e2e --workdir "$W" \
  --tokenizer $TOK --config $R/configs/flash --rows ${ROWS:-default l3-half} --contexts 8192 32768 131072 \
  --out "$OUT/e2e.md" --json "$OUT/e2e.json" 2> /tmp/e2e.err | grep -v '^{"row"' | tail -14)
tail -c 60000 /tmp/e2e.err > "$OUT/e2e.err"
el "our rows done"
while [ ! -f $L/built ]; do sleep 2; done; tail -2 $L/build.log
el "llama.cpp built"
PP=""; for p in 8192 32768 131072; do PP="$PP run -ctk q8_0 -ctv q8_0 -p $p -n 0;"; done   # prefill anchors
sed -e "s/for kv in q8_0 f16/for kv in q8_0/" -e "s/run -ctk q8_0 -ctv q8_0 -p 32768 -n 0;/$PP/" \
    .devcarry/llamacpp_bench.sh > /tmp/llamacpp_bench.sh
timeout 150 bash /tmp/llamacpp_bench.sh $W/ds15b-fp16 "$OUT" 2>&1 | tail -9   # alone on the GPU: $OUT/llamacpp.md
el "done"
