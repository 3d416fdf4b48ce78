#!/usr/bin/env bash
# Long runs that survive (train_gpt2cu): the step guard, stopping on a signal or a time limit, resume.
# Without a GPU: the flags' command-line errors, and the CPU trainer's (train_gpt2's) step guard, the GPU
# trainer's in its flags and meaning: one injected bad step (--nan-at-step 2) is skipped and logged, and
# leaves the model as it was (the model after 2 steps is byte for byte the one after 1); with
# --max-bad-steps 1 it stops the run with exit code 6 and no model.bin; then exit 77. With a GPU, on
# synthetic shards:
#   - divergence: -l 1e4 drives d2 to non-finite losses; the run stops with exit code 6 within
#     --max-bad-steps + 1 steps of the first skipped step, every checkpoint on disk is whole and finite
#     (build/inspect_checkpoint), and -y 1 from the newest one reproduces the diverging run's step records
#     bitwise (the checkpoint holds exactly the state the run had);
#   - one injected bad step (--nan-at-step 7): the update is skipped, logged as skipped, the run goes on to
#     the end, and two such runs give bitwise equal step records;
#   - the step guard is checkpointed: resumed from the checkpoint of a skipped step, a run with
#     --max-bad-steps 2 stops (exit 6) at the next bad step, as the uninterrupted run would;
#   - SIGTERM at random moments after start-up (the first log record), SURVIVAL_TRIALS trials (default 10)
#     on the single-GPU path and 4 through NCCL with one rank (ZeRO-1): each run exits with code 7 within
#     one step plus a checkpoint save (the limit: 20 s), and -y 1 then finishes the run with every step
#     record and the final model.bin bitwise equal to an uninterrupted run's; validation and checkpoints
#     are frequent, so signals land in steps, saves and validations alike; at least half the trials must
#     have been stopped by their signal;
#   - --time-limit 6s: the run stops by itself with exit code 7 before 6 s, and -y 1 finishes it bitwise;
#   - the same stop delivered twice at once (two SIGINTs 20 ms apart, as from a terminal's process group
#     and a launcher passing it on) is one request: exit 7 with a checkpoint;
#   - a second signal, 0.8 s after the first (past the trainer's 0.5 s window for one request), ends the
#     run at once (d24, while the first one's checkpoint is being written), and the checkpoint it cut short
#     is not published.
# Exit 0 pass, 1 fail, 77 skip (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2 train_gpt2cu build/inspect_checkpoint
dir=$(mktemp -d /tmp/test_survival_XXXXXX)
trap 'rm -rf "$dir"' EXIT
trainer() { timeout -k 10 180 ./train_gpt2cu "$@"; }

source test/script_lib.sh
expect_bin=(trainer)
expect_exit 2 "--time-limit 'soon': expected seconds" --time-limit soon
expect_exit 2 "--time-limit '1:xx': expected seconds" --time-limit 1:xx
expect_exit 2 "--loss-spike 0.5: must be 0 (off) or above 1" --loss-spike 0.5
expect_exit 2 "flag --max-bad-steps: '0' is not an integer at least 1" --max-bad-steps 0
expect_bin=(./train_gpt2)
expect_exit 2 "flag --max-bad-steps: '0' is not an integer at least 1" --max-bad-steps 0
echo "flags: ok"

# --- the CPU trainer's step guard ----------------------------------------------------------------------
python3 test/make_synthetic_shards.py "$dir" cpu_train=4000 >/dev/null
cpu=(--layers 1 --channels 16 --heads 2 --max-seq-len 16 -i "$dir/cpu_train_*.bin" -j "" -b 2 -t 16 -k constant
     --tokenizer "$dir/none.bin")
./train_gpt2 "${cpu[@]}" -x 1 -o "$dir/cpu1" >"$dir/cpu1.log" 2>&1 || { echo "FAIL: train_gpt2 -x 1"; cat "$dir/cpu1.log"; exit 1; }
./train_gpt2 "${cpu[@]}" -x 2 --nan-at-step 2 -o "$dir/cpu2" >"$dir/cpu2.log" 2>&1 ||
    { echo "FAIL: train_gpt2 with one bad step failed"; cat "$dir/cpu2.log"; exit 1; }
grep -q '^step     2/2 | loss nan .* | update skipped: a loss is not finite$' "$dir/cpu2.log" ||
    { echo "FAIL: train_gpt2 did not print step 2 as skipped"; cat "$dir/cpu2.log"; exit 1; }
grep -q '^{"step":2,"skipped":"a loss is not finite"}$' "$dir/cpu2/log.jsonl" ||
    { echo "FAIL: train_gpt2 did not log step 2 as skipped"; cat "$dir/cpu2/log.jsonl"; exit 1; }
cmp -s "$dir/cpu1/model.bin" "$dir/cpu2/model.bin" ||
    { echo "FAIL: train_gpt2's skipped step 2 changed the model (it differs from the model after step 1)"; exit 1; }
expect_exit 6 "error: step 2: 1 steps in a row were skipped (the last because a loss is not finite); stopping. The model is as it was before them, and no model file was written: run again with a lower" \
    "${cpu[@]}" -x 4 --nan-at-step 2 --max-bad-steps 1 -o "$dir/cpu_bad"
[ ! -e "$dir/cpu_bad/model.bin" ] || { echo "FAIL: a run stopped by the step guard wrote model.bin"; exit 1; }
echo "train_gpt2's step guard: a bad step skipped and logged, the model unchanged; --max-bad-steps stops with exit 6 and no model: ok"

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no NVIDIA GPU (the command-line checks above passed)"
    exit 77
fi

python3 test/make_synthetic_shards.py "$dir" syn_train=60000,60000 syn_val=8000
base=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -d 512 -u 5 -c 0.1 --seed 5 -s 0)

# The per-step records of a log, one line each (step, loss, norm), for bitwise comparison.
steps() { python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line) if line.strip() else {}
    if "loss" in r: print(r["step"], repr(r["loss"]), repr(r["norm"]))' "$1/log.jsonl" | sort -n -u; }

# --- divergence ---------------------------------------------------------------------------------------
rc=0
trainer "${base[@]}" -l 1e4 -x 200 -n 2 -v 0 --max-bad-steps 4 -o "$dir/nan" >"$dir/nan.log" 2>&1 || rc=$?
[ $rc -eq 6 ] || { echo "FAIL: a diverging run exited $rc, not 6"; tail "$dir/nan.log"; exit 1; }
first_bad=$(python3 -c '
import json, sys
print(min(r["step"] for r in map(json.loads, open(sys.argv[1])) if "skipped" in r))' "$dir/nan/log.jsonl")
last_step=$(steps "$dir/nan" | tail -n 1 | cut -d" " -f1)
[ $((last_step - first_bad)) -le 4 ] || { echo "FAIL: first skipped step $first_bad, stopped at $last_step"; exit 1; }
grep -q "4 steps in a row were skipped" "$dir/nan.log" || { echo "FAIL: no divergence message"; cat "$dir/nan.log"; exit 1; }
./build/inspect_checkpoint --all -q "$dir/nan" >"$dir/inspect.log" || { echo "FAIL: a checkpoint is bad"; cat "$dir/inspect.log"; exit 1; }
n_ckpt=$(grep -c ': ok$' "$dir/inspect.log")
[ "$n_ckpt" -ge 1 ] || { echo "FAIL: the diverging run left no checkpoint"; exit 1; }
# Resume from the oldest checkpoint: its steps up to where the run stopped must repeat bitwise.
cp -r "$dir/nan" "$dir/nan_resumed"
oldest=$(ls -d "$dir/nan_resumed"/ckpt_* | sort | head -n 1)
for c in "$dir/nan_resumed"/ckpt_*; do [ "$c" = "$oldest" ] || rm -rf "$c"; done
from=$((10#${oldest##*ckpt_}))
[ "$from" -lt "$last_step" ] || { echo "FAIL: no checkpoint before the last step ($from, $last_step)"; exit 1; }
rc=0
trainer "${base[@]}" -l 1e4 -x 200 -n 2 -v 0 --max-bad-steps 4 -o "$dir/nan_resumed" -y 1 >"$dir/nan2.log" 2>&1 || rc=$?
[ $rc -eq 6 ] || { echo "FAIL: the resumed diverging run exited $rc, not 6"; tail "$dir/nan2.log"; exit 1; }
upto() { steps "$1" | awk -v n="$2" '$1 <= n'; }
cmp -s <(upto "$dir/nan" "$last_step") <(upto "$dir/nan_resumed" "$last_step") ||
    { echo "FAIL: resuming the diverged run's step-$from checkpoint did not reproduce its steps"; exit 1; }
echo "divergence: exit 6 at step $last_step (first skipped $first_bad), $n_ckpt checkpoints whole and finite, resume from step $from bitwise: ok"

# --- one bad step -------------------------------------------------------------------------------------
for r in 1 2; do
    trainer "${base[@]}" -l 3e-3 -x 20 -v 10 -m 2 --nan-at-step 7 -o "$dir/bad$r" >"$dir/bad$r.log" 2>&1 ||
        { echo "FAIL: the run with one bad step failed"; tail "$dir/bad$r.log"; exit 1; }
done
grep -q '"step":7,"skipped"' "$dir/bad1/log.jsonl" || { echo "FAIL: step 7 not logged as skipped"; exit 1; }
[ "$(grep -c '"skipped"' "$dir/bad1/log.jsonl")" -eq 1 ] || { echo "FAIL: more than one step skipped"; exit 1; }
[ "$(steps "$dir/bad1" | wc -l)" -eq 20 ] || { echo "FAIL: the run did not go on to step 20"; exit 1; }
cmp -s <(steps "$dir/bad1") <(steps "$dir/bad2") || { echo "FAIL: two runs with the bad step differ"; exit 1; }
echo "one bad step: skipped, logged, run finished, reproducible: ok"

# --- the step guard across a resume -------------------------------------------------------------------
# Step 10's update is skipped and the step-10 checkpoint is written after it: with --max-bad-steps 2 a
# second bad step right after the resume is the second in a row, as it would be in the uninterrupted run.
trainer "${base[@]}" -l 3e-3 -x 12 -v 0 -n 10 --nan-at-step 10 --max-bad-steps 2 -o "$dir/guard" >"$dir/guard.log" 2>&1 ||
    { echo "FAIL: the run with a bad step 10 failed"; tail "$dir/guard.log"; exit 1; }
grep -q '"step":10,"skipped"' "$dir/guard/log.jsonl" || { echo "FAIL: step 10 not skipped"; exit 1; }
grep -q "^blob step_guard " "$dir/guard/ckpt_00000010/manifest.txt" ||
    { echo "FAIL: the checkpoint holds no step guard state"; cat "$dir/guard/ckpt_00000010/manifest.txt"; exit 1; }
mkdir -p "$dir/guard_r" && cp -r "$dir/guard/ckpt_00000010" "$dir/guard_r/"
rc=0
trainer "${base[@]}" -l 3e-3 -x 12 -v 0 -n 10 --nan-at-step 11 --max-bad-steps 2 -y 1 -o "$dir/guard_r" \
    >"$dir/guard_r.log" 2>&1 || rc=$?
[ $rc -eq 6 ] && grep -q "step 11: 2 steps in a row were skipped" "$dir/guard_r.log" ||
    { echo "FAIL: after resuming next to a skipped step, a second one must stop the run (exit $rc)"; tail "$dir/guard_r.log"; exit 1; }
echo "the step guard across a resume: ok"

# --- SIGTERM at random moments ------------------------------------------------------------------------
sig_common=(-l 3e-3 -x 150 -n 4 -v 3 -m 40 -nk 3)
# Starts the trainer in the background (its pid in $pid) and returns once its first log record is written
# (start-up is over: CUDA, NCCL, data) or it has ended.
start_trainer() {  # start_trainer OUT_DIR LOG args...
    local out=$1 log=$2; shift 2
    ./train_gpt2cu "$@" -o "$out" >"$log" 2>&1 &
    pid=$!
    local i
    for i in $(seq 1 3000); do
        [ -s "$out/log.jsonl" ] && return 0
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.01
    done
}
# The straight runs, timed from the first log record to the end: the window the signals land in.
t0=$(date +%s.%N)
start_trainer "$dir/straight" "$dir/straight.log" "${base[@]}" "${sig_common[@]}"
t1=$(date +%s.%N)
wait "$pid" || { echo "FAIL: the straight run failed"; tail "$dir/straight.log"; exit 1; }
run_s=$(python3 -c "import time; print(round(time.time() - $t1, 3))")
start_trainer "$dir/straight_nccl" "$dir/straight_nccl.log" "${base[@]}" "${sig_common[@]}" --multi-gpu 1 -z 1
wait "$pid" || { echo "FAIL: the straight NCCL run failed"; tail "$dir/straight_nccl.log"; exit 1; }
echo "straight run: $run_s s from the first log record to the end"
trials=${SURVIVAL_TRIALS:-10}
nccl_trials=$(( trials < 4 ? trials : 4 ))
signalled=0
for t in $(seq 1 $((trials + nccl_trials))); do
    extra=()
    ref=$dir/straight
    if [ "$t" -gt "$trials" ]; then extra=(--multi-gpu 1 -z 1); ref=$dir/straight_nccl; fi
    out=$dir/sig$t
    start_trainer "$out" "$out.log" "${base[@]}" "${sig_common[@]}" "${extra[@]}"
    # A moment within the training: steps, validations and checkpoint saves alike.
    sleep "$(python3 -c "import random; print(round(random.Random($t).uniform(0.0, 0.9 * $run_s), 3))")"
    t0=$(date +%s.%N)
    kill -TERM "$pid" 2>/dev/null || true
    rc=0
    wait "$pid" || rc=$?
    took=$(python3 -c "import time; print(round(time.time() - $t0, 2))")
    if [ $rc -eq 0 ]; then
        echo "  trial $t: the run had finished before the signal"
    else
        [ $rc -eq 7 ] || { echo "FAIL: trial $t exited $rc after SIGTERM, not 7"; tail "$out.log"; exit 1; }
        python3 -c "import sys; sys.exit(0 if $took < 20 else 1)" || { echo "FAIL: trial $t took $took s to stop"; exit 1; }
        trainer "${base[@]}" "${sig_common[@]}" "${extra[@]}" -o "$out" -y 1 >"$out.resume.log" 2>&1 ||
            { echo "FAIL: trial $t's resume failed"; tail "$out.resume.log"; exit 1; }
        signalled=$((signalled + 1))
        echo "  trial $t: stopped after step $(grep -o 'stopped after step [0-9]*' "$out.log" | grep -o '[0-9]*$') in $took s, resumed"
    fi
    cmp -s <(steps "$ref") <(steps "$out") || { echo "FAIL: trial $t's step records differ from the straight run"; exit 1; }
    cmp -s "$ref/model.bin" "$out/model.bin" || { echo "FAIL: trial $t's model.bin differs"; exit 1; }
done
# A trial whose run ended before its signal tests nothing; most must have been stopped by it.
[ $((2 * signalled)) -ge $((trials + nccl_trials)) ] ||
    { echo "FAIL: only $signalled of $((trials + nccl_trials)) trials were stopped by their signal"; exit 1; }
echo "SIGTERM: $signalled of $trials single-GPU and $nccl_trials NCCL trials stopped with exit 7 and resumed bitwise: ok"

# --- time limit ---------------------------------------------------------------------------------------
rc=0
start=$(date +%s.%N)
trainer "${base[@]}" -k constant -l 3e-3 -x 100000 -v 0 --time-limit 6s -o "$dir/limit" >"$dir/limit.log" 2>&1 || rc=$?
took=$(python3 -c "import time; print(round(time.time() - $start, 2))")
[ $rc -eq 7 ] || { echo "FAIL: --time-limit run exited $rc, not 7"; tail "$dir/limit.log"; exit 1; }
python3 -c "import sys; sys.exit(0 if $took < 6 else 1)" || { echo "FAIL: --time-limit 6s took $took s"; exit 1; }
stopped=$(grep -o 'stopped after step [0-9]*' "$dir/limit.log" | grep -o '[0-9]*$')
limit_more=(-k constant -l 3e-3 -x $((stopped + 20)) -v 0)
trainer "${base[@]}" "${limit_more[@]}" -o "$dir/limit" -y 1 >"$dir/limit2.log" 2>&1 || { echo "FAIL: resume after the time limit"; exit 1; }
trainer "${base[@]}" "${limit_more[@]}" -o "$dir/limit_straight" >"$dir/limit3.log" 2>&1 || { echo "FAIL: straight run"; exit 1; }
cmp -s "$dir/limit/model.bin" "$dir/limit_straight/model.bin" || { echo "FAIL: time-limited + resumed model differs"; exit 1; }
echo "time limit: stopped after step $stopped in $took s (limit 6 s), resumed bitwise: ok"

# --- the same signal twice at once is one stop request -------------------------------------------------
start_trainer "$dir/once" "$dir/once.log" "${base[@]}" -l 3e-3 -x 100000 -v 0
sleep 0.3
kill -INT "$pid" 2>/dev/null || true
sleep 0.02
kill -INT "$pid" 2>/dev/null || true
rc=0
wait "$pid" || rc=$?
[ $rc -eq 7 ] && grep -q "stopped after step" "$dir/once.log" ||
    { echo "FAIL: two SIGINTs 20 ms apart (one stop delivered twice) gave exit code $rc, not 7 with a checkpoint"; tail -5 "$dir/once.log"; exit 1; }
ls "$dir/once" | grep -q '^ckpt_[0-9]*$' || { echo "FAIL: no checkpoint after one stop delivered twice"; ls "$dir/once"; exit 1; }
echo "one stop delivered twice (20 ms apart): exit code 7 with a checkpoint: ok"

# --- a second signal ends the run at once ---------------------------------------------------------------
# d24, so that the checkpoint the first signal starts (about 5 GB of state) is still being written when the
# second arrives, 0.8 s later (a signal within 0.5 s of the first is taken as the same one); the
# half-written checkpoint must not be published.
start_trainer "$dir/twice" "$dir/twice.log" -e d24 -i "$dir/syn_train_*.bin" -j "" -b 4 -t 64 -l 3e-4 -x 100000 -v 0 -s 0
sleep 0.5
kill -INT "$pid" 2>/dev/null || true
sleep 0.8
kill -INT "$pid" 2>/dev/null || true
rc=0
wait "$pid" || rc=$?
grep -q "stopped after step" "$dir/twice.log" && { echo "FAIL: the first signal's checkpoint finished before the second signal"; tail -3 "$dir/twice.log"; exit 1; }
[ $rc -ne 0 ] && [ $rc -ne 7 ] || { echo "FAIL: two signals gave exit code $rc (expected death by the signal)"; tail -5 "$dir/twice.log"; exit 1; }
if ls "$dir/twice" | grep -q '^ckpt_[0-9]*$'; then echo "FAIL: a checkpoint cut short was published:"; ls "$dir/twice"; exit 1; fi
echo "second signal during the checkpoint: exit code $rc at once, nothing half-written published: ok"
