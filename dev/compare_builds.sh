#!/usr/bin/env bash
# Runs trainers built from different commits against each other, in one run on one GPU: each NAME=REV is
# built from git revision REV (empty: the working tree as it is; the path of an executable: that trainer,
# built elsewhere) as build/cmp_NAME, in parallel, then all are run ROUNDS times, interleaved (a b c a b
# c ...), so clock and thermal drift fall on every variant alike. Prints each run's average ms/step (the
# trainer's own "average over N steps" line: CUDA events, step 1 left out), then per variant the median
# over rounds and its ratio to the first variant, and whether every run printed the same per-step losses
# and gradient norms as the first variant's first run (same seed and flags: a change that should leave
# the results alone must keep them).
#   bash dev/compare_builds.sh "NAME=REV" ...      e.g. "new=" "old=HEAD~1" or "old=build/old_trainer"
#   ROUNDS=3 ARGS="-e d12 -b 64 -t 1024 -x 30" bash dev/compare_builds.sh ...
# Flags after REV (one argument: "NAME=REV FLAGS...") go to that variant's runs only, after ARGS: e.g.
# "one=build/t --dw-stream 0" "two=build/t --dw-stream 2" compares two settings of one trainer.
# A revision is built with its own Makefile (for the GPU this machine has, as `make` picks it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
ARGS=${ARGS:-"-e d12 -b 64 -t 1024 -x 30"}
if [ $# -lt 1 ]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi
names=()
pids=()
mkdir -p build
build_variant() {  # build_variant NAME REV
    local name=$1 rev=$2
    if [ -z "$rev" ]; then
        make -s train_gpt2cu && cp train_gpt2cu "build/cmp_$name"
        return
    fi
    if [ -f "$rev" ] && [ -x "$rev" ]; then
        cp "$rev" "build/cmp_$name"
        return
    fi
    local src="build/cmp_src/$name"
    rm -rf "$src"
    mkdir -p "$src"
    git archive "$rev" | tar -x -C "$src"
    make -s -C "$src" train_gpt2cu && cp "$src/train_gpt2cu" "build/cmp_$name"
}
declare -A flags
for spec in "$@"; do
    name=${spec%%=*}
    rev=${spec#*=}
    flags[$name]=""
    if [[ "$rev" == *" "* ]]; then
        flags[$name]=${rev#* }
        rev=${rev%% *}
    fi
    [ "$name" = "$spec" ] && { echo "compare_builds: '$spec' is not NAME=REV" >&2; exit 2; }
    for n in "${names[@]}"; do
        [ "$n" = "$name" ] && { echo "compare_builds: the name '$name' is given twice" >&2; exit 2; }
    done
    if [ -n "$rev" ] && ! [ -x "$rev" ] && ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null 2>&1; then
        echo "compare_builds: '$rev' is neither an executable nor a commit of this repository" >&2
        exit 2
    fi
    names+=("$name")
    build_variant "$name" "$rev" >"build/cmp_$name.log" 2>&1 &
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
reference=""
differs=()
for r in $(seq 1 "$ROUNDS"); do
    for name in "${names[@]}"; do
        # shellcheck disable=SC2086
        out=$("./build/cmp_$name" $ARGS ${flags[$name]} -v 0 -s 0 -o "" 2>&1 || true)
        line=$(echo "$out" | grep "^average over" || true)
        ms=$(echo "$line" | sed -E 's/.*: ([0-9.]+) ms\/step.*/\1/')
        [ -z "$ms" ] && { echo "compare_builds: build/cmp_$name printed no average (ARGS: $ARGS ${flags[$name]})" >&2; exit 1; }
        echo "round $r  $name: $line"
        runs[$name]="${runs[$name]:-} $ms"
        results=$(echo "$out" | grep -E "^step " | sed -E 's/ \| [0-9.]+ ms \|.*//')
        if [ -z "$reference" ]; then
            reference=$results
        elif [ "$results" != "$reference" ]; then
            differs+=("$name (round $r)")
        fi
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
if [ ${#differs[@]} -eq 0 ]; then
    echo "losses and norms: every run printed the same as ${names[0]}'s first"
else
    echo "losses and norms: different from ${names[0]}'s first run in: ${differs[*]}"
fi
