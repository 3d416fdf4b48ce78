#!/usr/bin/env bash
# Trainers built from different commits against each other, on one GPU. Each NAME=REV is built from git
# revision REV (empty: the working tree as it is; the path of an executable: that trainer, built
# elsewhere) as build/cmp_NAME, in parallel (a revision with its own Makefile, for the GPU this machine
# has, as `make` picks it). Flags after REV (one argument: "NAME=REV FLAGS...") go to that variant's runs
# only: e.g. "r0=build/t -r 0" "r1=build/t -r 1" compares two settings of one trainer.
#
# Timing (the default):
#   bash dev/compare_builds.sh "NAME=REV" ...      e.g. "new=" "old=HEAD~1" or "old=build/old_trainer"
#   ROUNDS=3 ARGS="-e d12 -b 64 -t 1024 -x 30" bash dev/compare_builds.sh ...
# runs them all ROUNDS times, interleaved (a b c a b c ...), so clock and thermal drift fall on every
# variant alike. Prints each run's average ms/step (the trainer's own "average over N steps" line: wall
# time from one step's end to the next, step 1 left out), then per variant the median over rounds and its ratio to the first variant,
# and whether every run printed the same per-step losses and gradient norms as the first variant's first
# run (same seed and flags: a change that should leave the results alone must keep them).
#
# Bitwise (do two builds compute the same bits?):
#   bash dev/compare_builds.sh --bitwise "OLD=REV" "NEW=REV"     e.g. old=HEAD~1 new=
# runs the same training scenarios with both and compares, exactly: every step's loss and gradient norm
# and every validation loss (log.jsonl), the final model.bin, and every .bin file of every checkpoint,
# which must be the same files on both sides (not manifest.txt, which records each run's own output
# folder). Needs the quick-start shards (make data). Scenarios (d6 and d12, shuffled data, gradient
# accumulation):
#   d6-ckpt     d6 B=8 T=256, 2 micro-steps, 20 steps, validation every 10, checkpoints at 10 and 20
#   d6-resume   the same run stopped at step 10, then resumed with -y 1 up to 20
#   d6-zero1    d6 as d6-ckpt on the NCCL path with one rank, ZeRO-1 (sharded checkpoint layout)
#   d12-accum   d12 B=16 T=1024, 2 micro-steps, 12 steps, checkpoint at 12
# Prints one PASS/FAIL line per scenario; exits 1 if any scenario differs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
ARGS=${ARGS:-"-e d12 -b 64 -t 1024 -x 30"}
bitwise=0
if [ "${1:-}" = --bitwise ]; then
    bitwise=1
    shift
    [ $# -eq 2 ] || { echo "compare_builds: --bitwise takes two variants, OLD=REV NEW=REV" >&2; exit 2; }
    ls data/quickstart_train_*.bin >/dev/null 2>&1 || { echo "data/ is missing: run make data first" >&2; exit 1; }
fi
if [ $# -lt 1 ]; then
    sed -n "2,$(($(grep -n '^set -euo' "$0" | head -n 1 | cut -d: -f1) - 1))p" "$0" >&2
    exit 2
fi
# --bitwise: bitwise_run VARIANT OUTDIR ARGS... runs build/cmp_VARIANT with the scenario's arguments, then
# the variant's own flags; a failure is recorded in OUTDIR.errors, for that scenario's verdict.
bitwise_run() {
    local bin=build/cmp_$1 own=${flags[$1]} out=$2
    shift 2
    # shellcheck disable=SC2086
    timeout -k 10 300 "$bin" "${data[@]}" -o "$out" "$@" $own >>"$out.log" 2>&1 ||
        echo "  $bin $* $own exited $?" >>"$out.errors"
}

# The numbers a run produced, one line each: steps (loss, norm) and validations, in log order.
numbers() {
    python3 - "$1/log.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        continue
    r = json.loads(line)
    if "loss" in r:
        print("step", r["step"], repr(r["loss"]), repr(r["norm"]))
    elif "val_loss" in r:
        print("val", r["step"], repr(r["val_loss"]))
PY
}

bitwise_compare() {  # bitwise_compare SCENARIO: the runs in $work/old/SCENARIO and $work/new/SCENARIO
    local name=$1 a=$work/old/$1 b=$work/new/$1 why=""
    if [ -s "$a.errors" ] || [ -s "$b.errors" ]; then
        why="a run failed: $(cat "$a.errors" "$b.errors" 2>/dev/null | tr '\n' ' ')"
    fi
    if [ -z "$why" ] && ! cmp -s <(numbers "$a") <(numbers "$b"); then
        why="log numbers differ: $(diff <(numbers "$a") <(numbers "$b") | head -n 3 | tr '\n' ' ')"
    fi
    local n_files=0
    if [ -z "$why" ]; then
        # Both sides' lists first: a file only one build writes (say an extra checkpoint) is a difference too.
        local only
        only=$(diff <(cd "$a" && find . -name '*.bin' | sort) <(cd "$b" && find . -name '*.bin' | sort) |
               sed -n 's/^< \(.*\)/\1 (old only)/p; s/^> \(.*\)/\1 (new only)/p' | head -n 3 | tr '\n' ' ')
        [ -n "$only" ] && why="not the same files: $only"
    fi
    if [ -z "$why" ]; then
        while IFS= read -r f; do
            n_files=$((n_files + 1))
            cmp -s "$a/$f" "$b/$f" || { why="$f differs"; break; }
        done < <(cd "$a" && find . -name '*.bin' | sort)
        [ -z "$why" ] && [ "$n_files" -eq 0 ] && why="no model or checkpoint files were written"
    fi
    local steps
    steps=$(numbers "$a" | grep -c '^step' || true)
    if [ -z "$why" ]; then
        echo "PASS $name: $steps steps, losses, norms, validation losses and $n_files .bin files bitwise equal"
    else
        echo "FAIL $name: $why"
        failed=1
    fi
}

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
if [ $bitwise = 1 ]; then
    set +e
    old=${names[0]} new=${names[1]}
    work=$(mktemp -d /tmp/compare_builds_XXXXXX)
    trap 'rm -rf "$work"' EXIT
    data=(-i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' -s 0 --seed 7 -l 1e-3 -u 5 -c 0.1)
    failed=0
    for side in old new; do
        variant=${!side}
        mkdir -p "$work/$side"
        d6=(-e d6 -b 8 -t 256 -d 4096 -v 10 -m 4)
        bitwise_run "$variant" "$work/$side/d6-ckpt" "${d6[@]}" -x 20 -n 10
        bitwise_run "$variant" "$work/$side/d6-resume" "${d6[@]}" -x 10 -n 10 --save-model 0
        bitwise_run "$variant" "$work/$side/d6-resume" "${d6[@]}" -x 20 -n 10 -y 1
        bitwise_run "$variant" "$work/$side/d6-zero1" "${d6[@]}" -x 20 -n 10 --multi-gpu 1 -z 1
        bitwise_run "$variant" "$work/$side/d12-accum" -e d12 -b 16 -t 1024 -d 32768 -v 6 -m 2 -x 12 -n 12
    done
    for scenario in d6-ckpt d6-resume d6-zero1 d12-accum; do bitwise_compare "$scenario"; done
    exit $failed
fi

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
