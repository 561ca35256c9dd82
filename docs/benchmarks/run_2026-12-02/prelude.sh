# Sourced by this session's device scripts (profile.sh, call2.sh) from the repo root on the GPU machine, with OUT
# set: unpacks .devcarry/src.tar to /tmp/src, installs the carried wheels and the package into /tmp/site, makes the
# random-weight DeepSeek-R1-Distill-Qwen-1.5B-shape checkpoints (real tokenizer) in /tmp/e2e. Defines R, S, W, el.
R=$PWD; S=/tmp/src; W=/tmp/e2e; mkdir -p "$S" "$W" "$OUT"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
tar xf .devcarry/src.tar -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
  2>&1 | tail -2)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
(cd /tmp && python3 -c "from flashguard.bench.e2e import make_checkpoints; from pathlib import Path; \
  print(make_checkpoints(Path('$W'), '$R/.devcarry/ds-tokenizer'))" 2>&1 | tail -1)
el "installed"
