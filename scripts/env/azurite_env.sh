#!/usr/bin/env bash
# Installs Azurite (Microsoft's Azure Storage emulator, npm package `azurite`) into
# target/azurite if missing, for the az:// tests (crates/tessera-testkit/src/azure.rs and
# tests/python/test_storage_options.py start `azurite-blob` from there, in memory, on a free
# loopback port). Installs Node.js and npm with apt first if they are missing (sudo when not
# root). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=3.37.0
bin=target/azurite/node_modules/.bin/azurite-blob
if [ -x "$bin" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
mkdir -p target/azurite
npm install --prefix target/azurite --no-audit --no-fund --silent "azurite@$version"
"$bin" --version
