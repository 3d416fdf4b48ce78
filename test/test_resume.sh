#!/usr/bin/env bash
# Checkpoints and resume of the GPU trainer (train_gpt2cu), end to end on synthetic shards and d2.
# Without a GPU: the checkpoint flags' command-line errors, then exit 77. With a GPU:
#   - bit-exact resume: a 30-step run (-d: 2 micro-steps per step, shuffled, 3 small shards, so the
#     steps cross shard and epoch boundaries; checkpoints every 10) against a run resumed from its step-10
#     checkpoint (-y 1): steps 11..30 have bitwise identical losses (log.jsonl, 17 digits) and norms, and
#     the final model.bin is byte-identical; the same with the data streamed from the host; cadence flags
#     may change on resume;
#   - the checkpoint directory: the files, manifest, model.bin readable as an llm.c v3 file (-e loads it),
#     rotation (-nk 2 -nm 20 keeps 20, 30 and the newest), no .tmp left;
#   - a flipped bit in the newest checkpoint: -y 1 says it skips it and resumes from the one before, still
#     bit-exact; a different batch size or model shape is refused naming the setting; different data is
#     refused by the DataLoader state;
#   - kill -9 at random moments, 20 trials (RESUME_KILL_TRIALS=N for fewer), each in its own directory:
#     killed once or twice and restarted with -y 1, every restart resumes from a valid checkpoint (or
#     starts, before the first one) without an error, every step record any attempt wrote equals the
#     straight run's bitwise, and the finished run's model.bin equals the straight run's. Every run not
#     killed on purpose has a time limit.
# Synchronous saves (a run without -n that must stop) are test_run_survival.sh's; that they write what
# asynchronous ones do is test_checkpoint_gpu's.
# Exit 0 pass, 1 fail, 77 skip (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2cu
dir=$(mktemp -d /tmp/test_resume_XXXXXX)
trap 'rm -rf "$dir"' EXIT
# Every run not killed on purpose has a time limit, so a hang fails the test rather than hold the GPU.
trainer() { timeout -k 10 180 ./train_gpt2cu "$@"; }

source test/script_lib.sh
expect_bin=(trainer)
expect_exit 2 "needs an output directory (-o)" -y 1 -o ""
expect_exit 2 "flag -nk: '-1' is not an integer at least 0" -nk -1
expect_exit 2 "flag -nm: '-2' is not an integer at least 0" -nm -2
echo "checkpoint flags: ok"

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no NVIDIA GPU (the command-line checks above passed)"
    exit 77
fi

# 3 shards of ~30 samples of 65 tokens: 22 batches of 4, 11 steps of 2 micro-batches per epoch; other_train
# is data of the same shape that is not the same (the resume must refuse it).
python3 test/make_synthetic_shards.py "$dir" syn_train=1950,1963,1976 other_train=5000 syn_val=3000 --seeds 10,99,3

common=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -d 512 -l 3e-3 -u 3 -c 0.1 --seed 5
        -v 10 -m 2 -s 0 -x 30)

# Compares the step records of log.jsonl files against a reference log: each record in a file must equal
# the reference's for its step bitwise (loss, norm); the steps from FIRST to 30 must all be present.
compare_logs() {  # compare_logs REFERENCE FIRST FILES...
    python3 - "$@" <<'PY'
import json, sys
ref_path, first, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def records(path):
    out = []
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut by kill -9
        if "loss" in r: out.append(r)
    return out
ref = {r["step"]: (r["loss"], r["norm"]) for r in records(ref_path)}
seen, bad = set(), []
for f in files:
    for r in records(f):
        seen.add(r["step"])
        if ref.get(r["step"]) != (r["loss"], r["norm"]):
            bad.append("%s step %d: %r, straight run %r" % (f, r["step"], (r["loss"], r["norm"]), ref.get(r["step"])))
missing = [s for s in range(first, 31) if s not in seen]
if bad or missing:
    print("FAIL: resumed losses differ from the straight run:\n  " + "\n  ".join(bad[:10]) + ("\nmissing steps %s" % missing if missing else ""))
    sys.exit(1)
print("bitwise identical to the straight run: %d records, steps %d..30" % (sum(len(records(f)) for f in files), first))
PY
}
same_file() {  # same_file A B WHAT
    cmp -s "$1" "$2" || { echo "FAIL: $3: $1 and $2 differ"; exit 1; }
}

# The straight run, checkpoints every 10 steps (async), keeping the newest 2 and every 20th.
t0=$(date +%s.%N)
trainer "${common[@]}" -n 10 -nk 2 -nm 20 -o "$dir/straight" >"$dir/straight.out" 2>&1 ||
    { echo "FAIL: the straight run"; cat "$dir/straight.out"; exit 1; }
straight_s=$(python3 -c "print($(date +%s.%N) - $t0)")
grep -q "checkpoints: every 10 steps" "$dir/straight.out" || { echo "FAIL: no checkpoint line"; cat "$dir/straight.out"; exit 1; }
grep -qE "checkpoint .*ckpt_00000030: .* training stalled .* \(async\)" "$dir/straight.out" ||
    { echo "FAIL: no report of the step-30 checkpoint"; cat "$dir/straight.out"; exit 1; }
ls "$dir/straight" >"$dir/ls"
[ "$(grep -c '^ckpt_' "$dir/ls")" -eq 2 ] && grep -q ckpt_00000020 "$dir/ls" && grep -q ckpt_00000030 "$dir/ls" ||
    { echo "FAIL: rotation kept:"; cat "$dir/ls"; exit 1; }
for f in manifest.txt model.bin params_bf16.bin adam_m.bin adam_v.bin; do
    [ -f "$dir/straight/ckpt_00000030/$f" ] || { echo "FAIL: ckpt_00000030 lacks $f"; exit 1; }
done
same_file "$dir/straight/model.bin" "$dir/straight/ckpt_00000030/model.bin" "final model.bin and the step-30 checkpoint's"
# The checkpoint's model.bin is an llm.c model file the trainer loads.
trainer -e "$dir/straight/ckpt_00000030/model.bin" -i "$dir/syn_train_*.bin" -j "" -b 4 -t 64 -x 1 -s 0 -o "" \
    >"$dir/load.out" || { echo "FAIL: the checkpoint's model.bin does not load"; cat "$dir/load.out"; exit 1; }
echo "straight run, layout, rotation: ok"

# Bit-exact resume from step 10 (checkpoint made by a separate 10-step-cadence run with the same settings,
# since rotation removed the straight run's).
trainer "${common[@]}" -n 10 -o "$dir/all" >"$dir/all.out" 2>&1 || { echo "FAIL: the run for step-10 checkpoints"; cat "$dir/all.out"; exit 1; }
for variant in async streamed; do
    rm -rf "$dir/r_$variant" && mkdir -p "$dir/r_$variant"
    cp -r "$dir/all/ckpt_00000010" "$dir/r_$variant/"
    extra=()
    [ $variant = streamed ] && extra=(--data-on-gpu-mib 0)
    # Cadence flags differ on purpose: they may change on resume.
    trainer "${common[@]}" "${extra[@]}" -n 7 -v 5 --log-every 3 -y 1 -o "$dir/r_$variant" >"$dir/r_$variant.out" ||
        { echo "FAIL: resume ($variant)"; cat "$dir/r_$variant.out"; exit 1; }
    grep -q "resume: restored .*ckpt_00000010: step 10" "$dir/r_$variant.out" ||
        { echo "FAIL: no restore line ($variant)"; cat "$dir/r_$variant.out"; exit 1; }
    compare_logs "$dir/straight/log.jsonl" 11 "$dir/r_$variant/log.jsonl"
    same_file "$dir/straight/model.bin" "$dir/r_$variant/model.bin" "final weights after resume ($variant)"
done
echo "bit-exact resume (async, streamed): ok"

# A flipped bit in the newest checkpoint: skipped with the reason, resume from the one before.
rm -rf "$dir/flip" && cp -r "$dir/all" "$dir/flip" && rm "$dir/flip/log.jsonl" "$dir/flip/model.bin"
python3 - "$dir/flip/ckpt_00000030/adam_v.bin" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
b[len(b) // 3] ^= 0x20
open(p, "wb").write(b)
PY
trainer "${common[@]}" -y 1 -o "$dir/flip" >"$dir/flip.out" || { echo "FAIL: resume after a flipped bit"; cat "$dir/flip.out"; exit 1; }
grep -q "resume: skipping .*ckpt_00000030: .*adam_v.bin' is corrupted" "$dir/flip.out" ||
    { echo "FAIL: the flipped bit was not reported"; cat "$dir/flip.out"; exit 1; }
grep -q "resume: restored .*ckpt_00000020 (after skipping 1 newer): step 20" "$dir/flip.out" ||
    { echo "FAIL: no fallback to step 20"; cat "$dir/flip.out"; exit 1; }
compare_logs "$dir/straight/log.jsonl" 21 "$dir/flip/log.jsonl"
# A truncated newest checkpoint is skipped too.
truncate -s 1000 "$dir/flip/ckpt_00000030/params_bf16.bin"
trainer "${common[@]}" -y 1 -o "$dir/flip" >"$dir/trunc.out" || { echo "FAIL: resume after truncation"; cat "$dir/trunc.out"; exit 1; }
grep -q "resume: skipping .*ckpt_00000030: .*params_bf16.bin' is 1000 bytes" "$dir/trunc.out" ||
    { echo "FAIL: truncation not reported"; cat "$dir/trunc.out"; exit 1; }
echo "corrupted and truncated checkpoints: skipped, ok"

# Incompatible configurations are refused with what differs.
expect_exit 2 "batch_size: checkpoint has '4', this run has '2'" "${common[@]}" -b 2 -y 1 -o "$dir/all"
expect_exit 2 "model: checkpoint has 'maxT=1024 V=50257 Vp=50304 L=2 NH=2 C=128'" "${common[@]}" -e d6 -y 1 -o "$dir/all"
expect_exit 2 "the data is not the same" "${common[@]}" -i "$dir/other_train_*.bin" -y 1 -o "$dir/all"
echo "incompatible configurations refused: ok"

# kill -9 at random moments: each trial starts a run in its own directory with -y 1 (nothing to resume),
# kills it at a random moment of the straight run's duration, restarts it with -y 1 and (every other trial)
# kills that too, then lets a last -y 1 finish.
kill_at() {  # kill_at FRACTION-OF-STRAIGHT-RUN OUT ARGS...: runs ARGS in the background, kill -9 after a random time
    local frac=$1 out=$2 pid delay
    shift 2
    delay=$(python3 -c "import random; print(round(random.uniform(0.05, $frac) * $straight_s, 2))")
    ./train_gpt2cu "$@" >"$out" 2>&1 &
    pid=$!
    sleep "$delay"
    kill -9 $pid 2>/dev/null || true
    echo "killed after ${delay}s" >>"$out"
    wait $pid 2>/dev/null || true
}
check_clean() {  # check_clean OUT: no error, no skipped checkpoint
    if grep -q "^error:" "$1" || grep -q "resume: skipping" "$1"; then echo "FAIL: $1:"; cat "$1"; exit 1; fi
}
trials=${RESUME_KILL_TRIALS:-20}  # fewer when GPU time is short
for trial in $(seq 1 "$trials"); do
    kdir="$dir/kill_$trial"
    args=("${common[@]}" -n 2 -nk 2 -y 1 -o "$kdir")
    kill_at 1.0 "$dir/k${trial}_a.out" "${args[@]}"
    check_clean "$dir/k${trial}_a.out"
    if [ $((trial % 2)) -eq 0 ]; then
        kill_at 0.8 "$dir/k${trial}_b.out" "${args[@]}"
        check_clean "$dir/k${trial}_b.out"
    fi
    trainer "${args[@]}" >"$dir/k${trial}_c.out" 2>&1 || { echo "FAIL: trial $trial, the final restart:"; cat "$dir/k${trial}_c.out"; exit 1; }
    check_clean "$dir/k${trial}_c.out"
    echo "trial $trial: $(grep -ohE 'resume: (restored [^:]*: step [0-9]+|no checkpoint)|killed after .*' "$dir/k${trial}"_*.out | sed 's|/tmp/[^ ]*/||' | tr '\n' ';')"
    compare_logs "$dir/straight/log.jsonl" 1 "$kdir/log.jsonl"
    same_file "$dir/straight/model.bin" "$kdir/model.bin" "final weights after kill -9 (trial $trial)"
    ls "$kdir" | grep -q '\.tmp$' && { echo "FAIL: a .tmp directory was left in $kdir"; ls "$kdir"; exit 1; }
    rm -rf "$kdir"
done
echo "kill -9, $trials trials: ok"
echo "ok"
