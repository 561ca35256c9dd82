#!/usr/bin/env bash
# Issue 13's L3 rows on the H200, one device call from the repo root (the working tree is what runs), about 3 min:
#   bash docs/benchmarks/run_l3/run.sh "$OUT"      (PROFILE=1: where the decoding thread's time goes, bench.sampler)
# carry .whl (zstandard, cryptography, cffi, pycparser for Python 3.12) and .devcarry/ds-tokenizer (the real
# DeepSeek-R1-Distill tokenizer, saved from the GGUF package: `python -c "from flashguard.bench.e2e import
# tokenizer; tokenizer(None).save_pretrained('.devcarry/ds-tokenizer')"`). No NeMo: bench.l3 drives the engine.
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR}; R=$PWD
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$R PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
echo "installed in $(( $(date +%s) - t0 )) s"
timeout ${L3_TIMEOUT:-190} python3 -m flashguard.bench.l3 --tokenizer "$R/.devcarry/ds-tokenizer" --workdir /tmp/l3 \
  --context 131072 --budget 4GiB --l2-small 16384 --warm-steps 16 --steps 48 \
  ${PROFILE:+--profile "$OUT/steady.txt" --profile-ttft "$OUT/ttft.txt"} \
  --out "$OUT/l3.md" --json "$OUT/l3.json" > "$OUT/l3.log" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s"
grep -v "^{" "$OUT/l3.log" | grep -v -i "warn" | tail -25
