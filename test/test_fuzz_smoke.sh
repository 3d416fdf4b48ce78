#!/usr/bin/env bash
# The fuzz targets (test/fuzz.cpp), briefly: builds build/fuzz, checks that each seed the program makes is
# refused (exit code 4, one line) when its name starts "bad_" and accepted otherwise, replays every seed and
# regression input in test/data/fuzz/<target>/, then fuzzes each target for FUZZ_SMOKE_SECONDS (default 5),
# two at a time, from a fresh corpus (logs and findings in build/fuzz-smoke/). Fails on any crash,
# sanitizer report, leak, hang or refusal with the wrong exit code; skips (77) where clang or libFuzzer is
# missing (bash scripts/setup.sh --tests installs them).
set -u
cd "$(dirname "$0")/.."

if ! command -v clang++ >/dev/null; then
    echo "skipped: clang++ is not installed (apt-get install clang libclang-rt-14-dev)"; exit 77
fi
probe=$(mktemp -d)
corpus=$(mktemp -d)
trap 'rm -rf "$probe" "$corpus"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cpp"
if ! clang++ -fsanitize=fuzzer "$probe/p.cpp" -o "$probe/p" 2>"$probe/err"; then
    echo "skipped: clang++ cannot link libFuzzer (apt-get install libclang-rt-14-dev): $(head -n 1 "$probe/err")"
    exit 77
fi

make -s build/fuzz || { echo "FAIL: build/fuzz does not build"; exit 1; }
if ! FUZZ_WRITE_SEEDS=$probe/seeds build/fuzz >/dev/null; then
    echo "FAIL: a seed is not refused or accepted as its name says"; exit 1
fi
FUZZ_SECONDS=${FUZZ_SMOKE_SECONDS:-5} FUZZ_JOBS=2 FUZZ_CORPUS=$corpus FUZZ_OUT=build/fuzz-smoke \
    bash scripts/fuzz.sh
