set -uo pipefail
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/new /tmp/old; mkdir -p /tmp/new /tmp/old
tar cf - --exclude=./.whl --exclude=./.devcarry . | tar xf - -C /tmp/new; tar xf .devcarry/src_old.tar -C /tmp/old
for t in new old; do echo "=== $t"; (cd /tmp/$t && PYTHONPATH=/tmp/$t:/tmp/site timeout 100 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider -k "graph_steps_match_eager_steps and sparse" --tb=long 2>&1 | grep -v Warning | tail -40); done
(cd /tmp/new && PYTHONPATH=/tmp/new:/tmp/site timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider --tb=short 2>&1 | grep -v -i warn | tail -25)
