#!/usr/bin/env bash
# A new user's install, as the README gives it: a fresh venv, `pip install '.[torch]'` from this
# checkout (builds the Rust extension: about 11 min on 2 cores), then examples/quickstart.py in
# that venv, which must print "100 [9.0, 10.0, 11.0]". Prints the build time. Uses pip's cache;
# the venv goes to $FRESH_VENV (default: a temporary directory, removed on exit).
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
venv="${FRESH_VENV:-}"
if [ -z "$venv" ]; then
  venv="$(mktemp -d)/venv"
  trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
"$py" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
start=$(date +%s)
CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}" "$venv/bin/pip" install --quiet '.[torch]'
echo "fresh_install: pip install '.[torch]' took $(($(date +%s) - start)) s"
out="$("$venv/bin/python" examples/quickstart.py "$(mktemp -d)/ckpt" "$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')")"
echo "$out"
[ "$(echo "$out" | tail -1)" = "100 [9.0, 10.0, 11.0]" ] || { echo "fresh_install: the quickstart printed something else" >&2; exit 1; }
"$venv/bin/tessera" --version
echo "fresh_install: OK"
