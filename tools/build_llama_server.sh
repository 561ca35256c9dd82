#!/usr/bin/env bash
# Builds llama.cpp's llama-server (an OpenAI-compatible server with a per-slot prompt cache) for this machine's
# CPU, once, into the user cache: ~/.cache/flashguard/llama-server/bin/llama-server (FLASHGUARD_CACHE_DIR moves it).
# The remote-backend tests (tests/remote/) use it and skip with a one-line reason where it is absent.
#
# usage (from the project's root): bash tools/build_llama_server.sh [LLAMA_CPP_SOURCE_DIR]
#   the source: the argument, else .devcarry/llamacpp.tgz (../shared/anchors/llamacpp/prepare.sh packs it: llama.cpp
#   as vendored in the llama-cpp-python 0.3.36 sdist), else that sdist fetched from PyPI here.
# About 8-12 minutes on 2 cores. Windows users take llama.cpp's own release builds instead (llama-server.exe) and
# point `base_url` at it; this script is for the tests.
set -euo pipefail
CACHE=${FLASHGUARD_CACHE_DIR:-$HOME/.cache/flashguard}   # loader.user_cache_dir's folder (Linux / macOS)
DEST=$CACHE/llama-server
BIN=$DEST/bin/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
WORK=${TMPDIR:-/tmp}/flashguard-llama-server; mkdir -p "$WORK" "$DEST"
SRC=${1:-}
if [ -z "$SRC" ]; then
  if [ ! -d "$WORK/llama.cpp/tools/server" ]; then
    if [ -f .devcarry/llamacpp.tgz ]; then
      tar xzf .devcarry/llamacpp.tgz -C "$WORK"
    else
      python3 -m pip download -q --no-deps --no-binary :all: -d "$WORK" llama-cpp-python==0.3.36
      tar xzf "$WORK"/llama_cpp_python-0.3.36.tar.gz -C "$WORK"
      mv "$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp" "$WORK/llama.cpp"
    fi
  fi
  SRC=$WORK/llama.cpp
fi
# Not GGML_NATIVE: on VMs that list AMX the native build dies with an illegal instruction; name the ISA instead.
ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
grep -q avx512f /proc/cpuinfo 2>/dev/null && ISA="$ISA -DGGML_AVX512=ON"
grep -q avx512_vnni /proc/cpuinfo 2>/dev/null && ISA="$ISA -DGGML_AVX512_VNNI=ON"
grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null && ISA="$ISA -DGGML_AVX512_BF16=ON"
cd "$SRC"
# a static build: the binary alone goes to the cache, no shared libraries beside it
cmake -B build-srv $ISA -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release > "$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; exit 1; }
cmake --build build-srv -j"$(nproc)" --target llama-server >> "$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; exit 1; }
mkdir -p "$DEST/bin"
cp build-srv/bin/llama-server "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "$BIN"
