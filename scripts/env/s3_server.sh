#!/usr/bin/env bash
# A local S3 server for benchmarks and manual tries: moto_server (in memory; installed into .venv
# by scripts/env/python_env.sh) on a free loopback port, with a bucket created. It either runs a
# command with the AWS_* environment pointing at the server, or prints that environment and
# waits; the server is stopped on exit either way.
#
#   bash scripts/env/s3_server.sh [--bucket B] -- COMMAND [ARGS...]   # COMMAND against the server
#   bash scripts/env/s3_server.sh [--bucket B]                       # print the env, wait for Ctrl-C
#
# The environment: AWS_ENDPOINT_URL=http://127.0.0.1:PORT, AWS_ALLOW_HTTP=true,
# AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (moto accepts any), AWS_REGION=us-east-1, and
# TESSERA_S3_URL=s3://B (default bucket: tessera). The server's log goes to
# target/s3-server.log; TESSERA_MOTO_SERVER names another moto_server binary.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"

bucket=tessera
while [ $# -gt 0 ]; do
  case "$1" in
    --bucket) bucket="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--bucket B] [-- COMMAND [ARGS...]]" >&2; exit 2 ;;
  esac
done

moto="${TESSERA_MOTO_SERVER:-$root/.venv/bin/moto_server}"
if [ ! -x "$moto" ]; then
  echo "s3_server: no $moto (run: bash scripts/env/python_env.sh, which installs moto into .venv)" >&2
  exit 1
fi
python="$root/.venv/bin/python"
[ -x "$python" ] || python=python3

port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mkdir -p "$root/target"
log="$root/target/s3-server.log"
"$moto" -H 127.0.0.1 -p "$port" >"$log" 2>&1 &
moto_pid=$!
stop() {
  kill "$moto_pid" 2>/dev/null || true
  wait "$moto_pid" 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

# Wait for the port (moto takes a few seconds to import).
for _ in $(seq 1 300); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    break
  fi
  if ! kill -0 "$moto_pid" 2>/dev/null; then
    echo "s3_server: moto_server exited; see $log" >&2
    exit 1
  fi
  sleep 0.2
done

# Create the bucket: one plain HTTP PUT (moto accepts unsigned requests); 409: it exists.
exec 3<>"/dev/tcp/127.0.0.1/$port"
printf 'PUT /%s HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n' "$bucket" "$port" >&3
status="$(head -n 1 <&3 | awk '{print $2}')"
exec 3>&-
case "$status" in
  200 | 409) ;;
  *) echo "s3_server: creating bucket $bucket: HTTP ${status:-no answer}" >&2; exit 1 ;;
esac

export AWS_ENDPOINT_URL="http://127.0.0.1:$port"
export AWS_ALLOW_HTTP=true
export AWS_ACCESS_KEY_ID=test
export AWS_SECRET_ACCESS_KEY=test
export AWS_REGION=us-east-1
export TESSERA_S3_URL="s3://$bucket"
unset AWS_SESSION_TOKEN AWS_PROFILE

if [ $# -gt 0 ]; then
  echo "s3_server: moto_server on $AWS_ENDPOINT_URL, bucket $bucket" >&2
  set +e
  "$@"
  rc=$?
  set -e
  exit "$rc"
fi

cat <<EOF
moto_server on $AWS_ENDPOINT_URL, bucket $bucket (log: $log); in another shell:
export AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL AWS_ALLOW_HTTP=true AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1
tessera demo --size 64MiB --dir $TESSERA_S3_URL/demo
Ctrl-C stops the server.
EOF
wait "$moto_pid"
