#!/usr/bin/env bash
# Issue 18's 7B-in-4-GiB run on one H200, one device call (repo root; carry .whl and .devcarry, where
# .devcarry/src.tar is `git archive -o .devcarry/src.tar HEAD` of the commit measured):
#   bash docs/benchmarks/run_7b/run.sh "$OUT"            (CHUNKS="auto 512" to compare prefill chunks)
# 1. llama.cpp builds on cores 0-9 in the background (../shared/anchors/llamacpp/bench.sh's build steps, plus
#    llama-fit-params; .devcarry/llamacpp.tgz from prepare.sh);
# 2. meanwhile, cores 12-15: `python -m flashguard.bench.big` (DeepSeek-R1-Distill-Qwen-7B shape, random int4 made
#    in memory, real tokenizer, vram_budget 4GiB: layers resident / streamed, TTFT, decode, memory, PCIe per layer);
#    cores 10-11: llama.cpp's side of the same model: convert_hf_to_gguf.py --vocab-only on the 7B config.json and the
#    real tokenizer, then `python -m flashguard.bench.gguf_random` adds random Q4_K_M tensors (no 15 GB checkpoint);
# 3. then, alone on the GPU, per context: llama-fit-params finds the most layers (-ngl, and any -ot overflow it
#    picks) whose memory fits 4 GiB of this process (its margin = the GPU's free MiB - 4096), and llama-bench runs
#    decode (tg64 at that depth) and prefill (pp of the context) with flash attention and q8_0 KV; the peak
#    nvidia-smi memory of each llama-bench process is recorded. Output: $OUT/big.md/json, $OUT/llamacpp.md.
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR}
CONTEXTS=${CONTEXTS:-8192 32768}
CHUNKS=${CHUNKS:-auto}
BUDGET_MIB=4096
LLAMA=${LLAMA-1}   # LLAMA= (empty) runs our rows only
R=$PWD; S=/tmp/src; W=/tmp/big; L=/tmp/llamacpp; mkdir -p "$S" "$W" "$OUT" "$L"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S   # the measured commit, whatever else the working tree holds
if [ -n "$LLAMA" ]; then
  tar xzf .devcarry/llamacpp.tgz -C $L
  setsid taskset -c 0-9 bash -c "export PATH=/usr/local/cuda/bin:\$PATH; cd $L/llama.cpp && \
    cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_TYPE=Release > $L/build.log 2>&1 && cmake --build build -j10 --target llama-bench llama-fit-params \
    >> $L/build.log 2>&1; touch $W/llama.built" &
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
  transformers.__version__, 'triton', triton.__version__)" >> "$OUT/smi.txt"
el "installed"
if [ -n "$LLAMA" ]; then   # llama.cpp's GGUF of the same shape, on cores 10-11, while our bench runs
  ( cd $W && mkdir -p hf7b spstub && cp $R/.devcarry/ds-tokenizer/* hf7b/ && \
    taskset -c 10-11 python3 -c "from flashguard.vram.plan import deepseek_7b_config as c; m = c(); \
m.architectures = ['Qwen2ForCausalLM']; m.vocab_size = 152128; m.save_pretrained('hf7b')" && \
    { python3 -c "import sentencepiece" 2>/dev/null || \
      printf 'class SentencePieceProcessor:\n    pass\n' > spstub/sentencepiece.py; } && \
    PYTHONPATH=$L/llama.cpp/gguf-py:$W/spstub:/tmp/site taskset -c 10-11 python3 $L/llama.cpp/convert_hf_to_gguf.py \
      hf7b --vocab-only --outfile vocab.gguf > vocab.log 2>&1 && \
    PYTHONPATH=$L/llama.cpp/gguf-py:/tmp/site taskset -c 10-11 python3 -m flashguard.bench.gguf_random vocab.gguf \
      model-q4km.gguf ) > "$OUT/gguf.txt" 2>&1 &
  GGUF_PID=$!
fi
# vocab 152128 for llama.cpp: its converter wants every id of the reloaded tokenizer below vocab_size (bench.sh's
# gotcha); ours keeps the 7B's 152064
(cd /tmp && taskset -c 12-15 python3 -m flashguard.bench.big --tokenizer $R/.devcarry/ds-tokenizer --budget 4GiB \
  --contexts $CONTEXTS --chunks $CHUNKS --steps 64 --cpu-layer --out "$OUT/big.md" --json "$OUT/big.json" \
  2> "$OUT/big.err" | tee "$OUT/big.jsonl" | grep -v '^{"chunk"')
tail -3 "$OUT/big.err"
el "our rows done"
[ -n "$LLAMA" ] || exit 0
wait $GGUF_PID; cat "$OUT/gguf.txt" | tail -2
while [ ! -f "$W/llama.built" ]; do sleep 2; done; tail -2 $L/build.log
el "llama.cpp built"
B=$L/llama.cpp/build/bin; M=$W/model-q4km.gguf
[ -x "$B/llama-bench" ] && [ -f "$M" ] || { echo "llama.cpp build or GGUF missing"; exit 1; }
peak() { local m=0; while kill -0 "$1" 2>/dev/null; do v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ "$v" -gt "$m" ] && m=$v; sleep 0.2; done; echo "$m"; }
{ echo "llama.cpp, $(basename $M) (random Q4_K_M, DeepSeek-R1-Distill-Qwen-7B shape), flash attention, KV q8_0, \
process memory fitted to $BUDGET_MIB MiB by llama-fit-params"
  echo
  for d in $CONTEXTS; do
    idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
    margin=$(( free - BUDGET_MIB ))
    fit=$(timeout 60 $B/llama-fit-params -m $M -c $((d + 64)) -fa on -ctk q8_0 -ctv q8_0 -fitt $margin -fitc $((d + 64)) \
      2> $W/fit_$d.log | tail -1)
    ngl=$(echo "$fit" | sed -n 's/.*-ngl \([0-9-]*\).*/\1/p')
    ot=$(echo "$fit" | sed -n 's/.*-ot "\([^"]*\)".*/\1/p')
    [ -n "$ngl" ] || { echo "fit failed for $d: $(tail -3 $W/fit_$d.log)"; ngl=16; }
    args=(-m $M -ngl $ngl -fa 1 -ctk q8_0 -ctv q8_0 -r 1 -o md)
    [ -n "$ot" ] && args+=(-ot "$ot")
    echo "context $d: llama-fit-params -> '$fit' (margin $margin MiB, GPU used before $idle MiB)" >&2
    for t in "-p 0 -n 64 -d $d" "-p $d -n 0"; do
      $B/llama-bench "${args[@]}" $t > $W/out.txt 2>&1 & p=$!; m=$(peak $p); wait $p
      grep "^| " $W/out.txt
      echo "peak GPU memory used (nvidia-smi, whole GPU, $idle MiB before) MiB: $m for: -ngl $ngl ${ot:+-ot $ot} $t"
    done
  done; } 2>&1 | tee "$OUT/llamacpp.md"
el "done"
