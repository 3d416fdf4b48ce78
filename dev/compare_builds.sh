#!/usr/bin/env bash
# Times trainers built with different compile-time choices against each other, in one run on one GPU:
# each variant is built (in parallel) as build/cmp_NAME, then all are run ROUNDS times, interleaved
# (a b c a b c ...), so clock and thermal drift fall on every variant alike. Prints each run's average
# ms/step (the trainer's own "average over N steps" line: CUDA events, step 1 left out), then per variant
# the median over rounds and its ratio to the first variant.
#   bash dev/compare_builds.sh "NAME=FLAGS" ...      e.g. "base=" "nogelu=-DLLMC_GELU_EPILOGUE=0"
#   ROUNDS=3 ARGS="-e d12 -b 64 -t 1024 -x 30" bash dev/compare_builds.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
ARGS=${ARGS:-"-e d12 -b 64 -t 1024 -x 30"}
if [ $# -lt 1 ]; then
    sed -n '2,8p' "$0" >&2
    exit 2
fi
names=()
pids=()
mkdir -p build
for spec in "$@"; do
    name=${spec%%=*}
    flags=${spec#*=}
    [ "$name" = "$spec" ] && { echo "compare_builds: '$spec' is not NAME=FLAGS" >&2; exit 2; }
    names+=("$name")
    # shellcheck disable=SC2086  # FLAGS is a list of compiler options
    make -s -B "build/cmp_$name" NVCC_EXTRA="$flags" >"build/cmp_$name.log" 2>&1 &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "compare_builds: building ${names[$i]} failed:" >&2
        tail -n 20 "build/cmp_${names[$i]}.log" >&2
        exit 1
    fi
done
declare -A runs
for r in $(seq 1 "$ROUNDS"); do
    for name in "${names[@]}"; do
        # shellcheck disable=SC2086
        line=$("./build/cmp_$name" $ARGS -v 0 -s 0 -o "" 2>&1 | grep "^average over" || true)
        ms=$(echo "$line" | sed -E 's/.*: ([0-9.]+) ms\/step.*/\1/')
        [ -z "$ms" ] && { echo "compare_builds: build/cmp_$name printed no average (ARGS: $ARGS)" >&2; exit 1; }
        echo "round $r  $name: $line"
        runs[$name]="${runs[$name]:-} $ms"
    done
done
echo
printf '%-16s %12s %8s   %s\n' variant "median ms" "ratio" "runs (ms/step)"
base=""
for name in "${names[@]}"; do
    med=$(echo "${runs[$name]}" | tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END{print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}')
    [ -z "$base" ] && base=$med
    printf '%-16s %12s %8s  %s\n' "$name" "$med" "$(awk -v a="$med" -v b="$base" 'BEGIN{printf "%.3f", a / b}')" "${runs[$name]}"
done
