#!/usr/bin/env bash
# Runs the fuzz targets of build/fuzz (test/fuzz.cpp; `make fuzz` builds it and calls this), each for
# FUZZ_SECONDS, FUZZ_JOBS targets at a time, and prints a table of what each did. docs/fuzzing.md.
#
#   FUZZ_SECONDS=60        fuzzing time per target, after its seeds are replayed
#   FUZZ_JOBS=1            targets run at once (one core each)
#   FUZZ_TARGETS="a b"     the targets to run (default: every one build/fuzz lists)
#   FUZZ_CORPUS=build/fuzz-corpus  working corpora, one folder per target, kept between runs
#   FUZZ_OUT=build         where fuzz-logs/<target>.log and fuzz-findings/<target>/ go
#
# A target starts from its working corpus and its seeds and regression inputs in test/data/fuzz/<target>/
# (read, never written), with test/data/fuzz/<target>.dict where there is one. Exit 0 when no target found
# anything; 1 when one crashed, hung, leaked, ran out of memory or failed a check of test/fuzz.cpp: the
# input that did it is in fuzz-findings/<target>/, and its path and the log's report are printed.
set -u
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-1}
corpus_root=${FUZZ_CORPUS:-build/fuzz-corpus}
out=${FUZZ_OUT:-build}
bin=build/fuzz
for v in "$seconds" "$jobs"; do
    if ! [[ "$v" =~ ^[1-9][0-9]*$ ]]; then
        echo "fuzz: error: FUZZ_SECONDS and FUZZ_JOBS take a positive integer, got '$v'" >&2; exit 2
    fi
done
if [ ! -x "$bin" ]; then echo "fuzz: error: $bin is not built (make build/fuzz)" >&2; exit 2; fi
targets=${FUZZ_TARGETS:-$(FUZZ_TARGET=list "$bin")}

# Inputs and fixtures go to a scratch folder in memory, removed at the end even after a crash.
scratch=$(mktemp -d /dev/shm/llmc-fuzz.XXXXXX 2>/dev/null || mktemp -d)
trap 'rm -rf "$scratch"' EXIT
logs=$out/fuzz-logs
mkdir -p "$logs"

# Runs one target; leaves "seconds executions corpus findings" in $logs/<target>.result.
run_target() {
    local t=$1 seeds=test/data/fuzz/$1 corpus=$corpus_root/$1 findings=$out/fuzz-findings/$1 log=$logs/$1.log
    local inputs=("$corpus") dict=() start rc
    mkdir -p "$corpus"
    rm -rf "$findings" && mkdir -p "$findings"
    [ -d "$seeds" ] && inputs+=("$seeds")
    [ -f "$seeds.dict" ] && dict=(-dict="$seeds.dict")
    start=$(date +%s)
    FUZZ_TARGET=$t TMPDIR=$scratch "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -malloc_limit_mb=512 -error_exitcode=1 -timeout_exitcode=1 -print_final_stats=1 \
        -artifact_prefix="$findings/" "${dict[@]}" "${inputs[@]}" >"$log" 2>&1
    rc=$?
    local execs units found
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    units=$(sed -n 's/.* corp: \([0-9]*\)\/.*/\1/p' "$log" | tail -n 1)
    found=$(find "$findings" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) |
            wc -l)
    if [ $rc -eq 77 ]; then
        echo "skipped: $(tail -n 1 "$log")" >"$logs/$t.result"
        return
    fi
    if [ $rc -ne 0 ] && [ "$found" -eq 0 ]; then found=1; fi  # died without saving its input
    echo "$(( $(date +%s) - start )) ${execs:-?} ${units:-?} $found" >"$logs/$t.result"
}

for t in $targets; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    echo "fuzz: $t for ${seconds}s"
    rm -f "$logs/$t.result"
    run_target "$t" &
done
wait

status=0
printf '\n%-12s %8s %12s %8s %s\n' target seconds executions corpus findings
for t in $targets; do
    read -r r <"$logs/$t.result" 2>/dev/null || r="? ? ? 1"
    if [[ "$r" == skipped:* ]]; then printf '%-12s %s\n' "$t" "$r"; continue; fi
    read -r secs execs units found <<<"$r"
    printf '%-12s %8s %12s %8s %s\n' "$t" "$secs" "$execs" "$units" "$found"
    [ "$found" = 0 ] && continue
    status=1
    echo "  $t: log $logs/$t.log, input(s):"
    find "$out/fuzz-findings/$t" -type f | sed 's/^/    /'
    grep -m 3 -E '^(==[0-9]+==ERROR|fuzz: |SUMMARY|.*runtime error)' "$logs/$t.log" | sed 's/^/    /'
done
exit $status
