#!/usr/bin/env bash
# Issue 17's peer-GPU tier benchmark on nvidia-h200-x2, one device call (repo root; carry .whl and .devcarry, where
# .devcarry/src.tar is `git archive HEAD` of the commit measured):
#   bash docs/benchmarks/run_peer/run.sh "$OUT" [extra flashguard.bench.peer arguments]
# 1. the dead-peer check alone (a tiny model, NCCL, the peer process killed mid-decode): hard bound 90 s;
# 2. the rows l2 / peer / resident / split at 128K and the (c) sharded-attention check: --deadline 300 inside,
#    `timeout` 330 outside (it kills the peer processes too: same process group).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others, as KINDS.md asks).
set -uo pipefail
OUT=${1:?usage: run.sh OUTDIR [bench args]}; shift
R=$PWD; S=/tmp/src; mkdir -p "$S" "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=8
if [ -f .devcarry/src.tar ]; then tar xf .devcarry/src.tar -C $S; else S=$R; fi   # else: the tree as carried
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
(cd $S && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 \
  | tail -2)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/smi.txt"
nvidia-smi topo -m >> "$OUT/smi.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
  torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__)" \
  >> "$OUT/smi.txt" 2>&1
cat "$OUT/smi.txt"
t0=$(date +%s)
(cd /tmp && timeout -k 10 90 python3 -m flashguard.bench.peer --dead-peer --peer-timeout 10 --deadline 80 \
  --out "$OUT/dead_peer.md" --json "$OUT/dead_peer.json" > "$OUT/dead_peer.log" 2>&1)
echo "dead-peer check: rc $? after $(( $(date +%s) - t0 )) s"; tail -22 "$OUT/dead_peer.log"
t1=$(date +%s)
(cd /tmp && timeout -k 10 330 python3 -m flashguard.bench.peer --context 131072 --deadline 300 "$@" \
  --out "$OUT/peer.md" --json "$OUT/peer.json" > "$OUT/peer.log" 2> "$OUT/peer.err")
echo "rows: rc $? after $(( $(date +%s) - t1 )) s"; cat "$OUT/peer.log" | grep -v '^{"' | tail -40
tail -5 "$OUT/peer.err"
