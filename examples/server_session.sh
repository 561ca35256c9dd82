#!/usr/bin/env bash
# Start the guarded server on 127.0.0.1 and ask it twice (plain and streaming).
#   bash examples/server_session.sh
set -euo pipefail
flashguard serve --config configs/flash --port 8000 &
server=$!
trap 'kill $server' EXIT
until curl -sf 127.0.0.1:8000/v1/rails/configs >/dev/null; do sleep 1; done
curl -s 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model": "flashguard", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
echo
curl -sN 127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model": "flashguard", "stream": true, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
echo
