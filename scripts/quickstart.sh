#!/usr/bin/env bash
# The main job for a fresh machine: build, then exercise what exists so far.
set -euo pipefail
cd "$(dirname "$0")/.."
make -j"$(nproc)"
