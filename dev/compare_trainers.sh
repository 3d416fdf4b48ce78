#!/usr/bin/env bash
# Do two builds of train_gpt2cu compute the same bits? Runs the same training scenarios with both and
# compares, exactly: every step's loss and gradient norm and every validation loss (log.jsonl), the
# final model.bin, and every .bin file of every checkpoint, which must be the same files on both sides
# (not manifest.txt, which records each run's own output folder) (dev/compare_builds.sh times builds
# against each other). Needs a GPU and the quick-start shards (make data).
#   bash dev/compare_trainers.sh OLD_BINARY NEW_BINARY
# Scenarios (d6 and d12, shuffled data, gradient accumulation):
#   d6-ckpt     d6 B=8 T=256, 2 micro-steps, 20 steps, validation every 10, checkpoints at 10 and 20
#   d6-resume   the same run stopped at step 10, then resumed with -y 1 up to 20
#   d6-zero1    d6 as d6-ckpt on the NCCL path with one rank, ZeRO-1 (sharded checkpoint layout)
#   d12-accum   d12 B=16 T=1024, 2 micro-steps, 12 steps, checkpoint at 12
# Prints one PASS/FAIL line per scenario; exits 1 if any scenario differs.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: bash dev/compare_trainers.sh OLD_BINARY NEW_BINARY}
NEW=${2:?usage: bash dev/compare_trainers.sh OLD_BINARY NEW_BINARY}
ls data/quickstart_train_*.bin >/dev/null 2>&1 || { echo "data/ is missing: run make data first"; exit 1; }
work=$(mktemp -d /tmp/compare_trainers_XXXXXX)
trap 'rm -rf "$work"' EXIT
data=(-i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' -s 0 --seed 7 -l 1e-3 -u 5 -c 0.1)
failed=0

run() {  # run BINARY OUTDIR ARGS...: a failure is recorded in OUTDIR.errors, for that scenario's verdict
    local bin=$1 out=$2
    shift 2
    timeout -k 10 300 "$bin" "${data[@]}" -o "$out" "$@" >>"$out.log" 2>&1 || echo "  $bin $* exited $?" >>"$out.errors"
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

compare() {  # compare NAME: the runs in $work/old/NAME and $work/new/NAME
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

for side in old new; do
    bin=$OLD
    [ $side = new ] && bin=$NEW
    mkdir -p "$work/$side"
    d6=(-e d6 -b 8 -t 256 -d 4096 -v 10 -m 4)
    run "$bin" "$work/$side/d6-ckpt" "${d6[@]}" -x 20 -n 10
    run "$bin" "$work/$side/d6-resume" "${d6[@]}" -x 10 -n 10 --save-model 0
    run "$bin" "$work/$side/d6-resume" "${d6[@]}" -x 20 -n 10 -y 1
    run "$bin" "$work/$side/d6-zero1" "${d6[@]}" -x 20 -n 10 --multi-gpu 1 -z 1
    run "$bin" "$work/$side/d12-accum" -e d12 -b 16 -t 1024 -d 32768 -v 6 -m 2 -x 12 -n 12
done
for name in d6-ckpt d6-resume d6-zero1 d12-accum; do compare "$name"; done

exit $failed
