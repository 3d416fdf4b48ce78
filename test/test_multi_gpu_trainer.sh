#!/usr/bin/env bash
# train_gpt2cu's NCCL path (data parallel, ZeRO-1) against its single-GPU path, with one rank. Without a
# GPU: the multi-GPU command-line errors and the launchers' environments that must be refused (exit 2
# with their message, before CUDA is touched); then exit 77. With a GPU, on synthetic shards (a noisy
# Markov chain over 97 GPT-2 token ids) and d2:
#   - 10 steps with a constant schedule, with 1 and with 2 micro-steps per step: the plain run,
#     --multi-gpu 1 -z 0 (per-layer all-reduce) and --multi-gpu 1 -z 1 (reduce-scatter, sharded AdamW,
#     all-gather) give bitwise identical losses, norms and validation losses in log.jsonl (17
#     significant digits), and identical model files (-z 1 gathers the shards to write it);
#   - a checkpoint written at step 5 with --multi-gpu 1 -z 1 (the sharded layout: model.bin as bf16
#     version 5, master_/adam_m_/adam_v_00000.bin) resumes with -y 1 on the NCCL path (its own layout)
#     and on the plain path (re-sharded into one whole copy), and a plain (whole layout) checkpoint
#     resumes with -z 1 (re-sharded into rank 0's shard): steps 6..10 match the uninterrupted run bitwise;
#   - a peer that never comes (--world-size 2, only rank 0 started, --nccl-timeout 5) ends in a clear
#     error well within the timeout, not a hang;
#   - one visible GPU and --local-rank 1 (as under Slurm's --gpus-per-task=1): it trains on that GPU;
#   - --hang-timeout 1 with a d12 validation and sample that each outlast it: the run finishes;
#   - a flipped bit in a ZeRO-1 shard file of the newest checkpoint: -y 1 names the file, falls back to
#     the checkpoint before and continues bitwise;
#   - with two GPUs: two ranks (-z 0, -z 1, and -z 1 with one visible GPU per rank) train 10 steps within
#     0.02 of one GPU's losses, both ranks print the same "rank R parameter checksum HEX" line, and the
#     two -z 1 runs end with the same parameters (a sum of two ranks is one rounding in any order, so the
#     GPUs' visibility must not change a bit; -z 0 may differ from -z 1 in the last bit of the norm).
# Exit 0 pass, 1 fail, 77 skip (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2cu
dir=$(mktemp -d /tmp/multi_gpu_trainer_XXXXXX)
trap 'rm -rf "$dir"' EXIT
export NCCL_NVLS_ENABLE=0

source test/script_lib.sh
expect_bin=(./train_gpt2cu)
expect_exit 0 "--zero-stage" --help
expect_exit 0 "--rendezvous-job" --help
expect_exit 2 "flag --multi-gpu: '2' is not an integer from -1 to 1" -e d2 --multi-gpu 2
expect_exit 2 "flag -z: '3' is not an integer from -1 to 1" -e d2 -z 3
expect_exit 2 "zero-stage 1 needs the NCCL path" -e d2 -z 1
expect_exit 2 "--rendezvous needs the NCCL path" -e d2 --rendezvous "$dir/rdv"
expect_exit 2 "drop --multi-gpu 0" -e d2 --multi-gpu 0 --rank 0 --world-size 2
expect_exit 2 "--rank and --world-size go together" -e d2 --rank 1
expect_exit 2 "rank 2 is outside 0..1" -e d2 --rank 2 --world-size 2
expect_exit 2 "need a meeting point" -e d2 --rank 0 --world-size 2
expect_exit 2 "expected tcp://HOST:PORT" -e d2 --rank 0 --world-size 2 --rendezvous tcp://nohost
expect_exit 2 "--nccl-timeout 0: must be positive" -e d2 --multi-gpu 1 --nccl-timeout 0
# A huge wait meant as "for ever" overflowed the deadline's clock and ended the rendezvous at once.
expect_exit 2 "flag --nccl-timeout: '1e10' is not a number from 0 to" -e d2 --multi-gpu 1 --nccl-timeout 1e10
expect_exit 2 "flag --hang-timeout: '-1' is not a number at least 0" -e d2 --multi-gpu 1 --hang-timeout -1
expect_exit 2 "not a multiple of B\*T\*ranks = 4\*64\*2" -e d2 -b 4 -t 64 -d 256 --rank 0 --world-size 2 \
    --rendezvous "$dir/rdv"
# Launchers that say several ranks: their variables are read (so --multi-gpu 0 contradicts them), and an
# incomplete set is refused rather than run as rank 0 of 1.
expect_bin=(env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 ./train_gpt2cu)
expect_exit 2 "--multi-gpu 0, but torchrun says there are 2 ranks" -e d2 --multi-gpu 0
expect_bin=(env MV2_COMM_WORLD_RANK=0 MV2_COMM_WORLD_SIZE=4 MV2_COMM_WORLD_LOCAL_RANK=0 ./train_gpt2cu)
expect_exit 2 "--multi-gpu 0, but mvapich says there are 4 ranks" -e d2 --multi-gpu 0
expect_bin=(env PMI_RANK=1 PMI_SIZE=2 ./train_gpt2cu)
expect_exit 2 "MPI_LOCALRANKID is not set" -e d2
expect_bin=(env RANK=3 ./train_gpt2cu)
expect_exit 2 "RANK=3 says this is one of several ranks" -e d2
expect_bin=(./train_gpt2cu)
out=$(DRY_RUN=1 bash scripts/run_multi_gpu.sh mpiexec 4 -e d2)
[ "$out" = "NCCL_NVLS_ENABLE=0 mpiexec -n 4 -genv NCCL_NVLS_ENABLE 0 ./train_gpt2cu -e d2" ] ||
    { echo "FAIL: run_multi_gpu.sh mpiexec printed: $out"; exit 1; }
echo "command-line errors: ok"

train() {  # train LOG ARGS...: a run that must succeed; a hang (e.g. in NCCL) ends after 120 s, not never
    local log=$1 rc=0
    shift
    timeout -k 10 120 ./train_gpt2cu "$@" >"$log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAIL: train_gpt2cu $* exited $rc$([ $rc -eq 124 ] && echo ' (killed after 120 s)'), last lines:"
        tail -n 30 "$log"; exit 1
    fi
}

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no NVIDIA GPU (the command-line checks above passed)"
    exit 77
fi

python3 test/make_synthetic_shards.py "$dir" syn_train=60000,60000 syn_val=8000

mkdir -p "$dir/rdv"
# A constant schedule (after warmup), so that a run stopped at step 5 and resumed to 10 sees the same rates.
common=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -l 3e-3 -u 3 -k constant -c 0.1
        --seed 3 -v 5 -m 2 -s 0)
nccl=(--multi-gpu 1 --rendezvous "$dir/rdv" --rendezvous-job single)

# Each configuration with one micro-step per step and with two (-d 512: the gradients are averaged only
# after the second).
for acc in 256 512; do
    train "$dir/log_plain_$acc" "${common[@]}" -x 10 -d $acc -o "$dir/plain_$acc"
    for z in 0 1; do
        train "$dir/log_z${z}_$acc" "${common[@]}" -x 10 -d $acc -o "$dir/z${z}_$acc" "${nccl[@]}" -z $z
        grep -q "data parallel: 1 rank(s)" "$dir/log_z${z}_$acc" ||
            { echo "FAIL: -z $z did not take the NCCL path"; cat "$dir/log_z${z}_$acc"; exit 1; }
        cmp "$dir/plain_$acc/model.bin" "$dir/z${z}_$acc/model.bin" ||
            { echo "FAIL: -z $z -d $acc: model.bin differs from the plain run's"; exit 1; }
    done
    if grep -q "data parallel" "$dir/log_plain_$acc"; then echo "FAIL: the plain run took the NCCL path"; exit 1; fi
done
grep -q "ZeRO-1" "$dir/log_z1_256" || { echo "FAIL: -z 1 did not report ZeRO-1"; cat "$dir/log_z1_256"; exit 1; }

# Resume: checkpoint at step 5 on the NCCL path (ZeRO-1), then continue to 10, on the NCCL path and plain.
train "$dir/log_ck" "${common[@]}" -x 5 -n 5 -o "$dir/ck" "${nccl[@]}" -z 1 --save-model 0
cp -r "$dir/ck" "$dir/ck_plain"
train "$dir/log_ck2" "${common[@]}" -x 10 -n 5 -y 1 -o "$dir/ck" "${nccl[@]}" -z 1 --save-model 0
grep -q "resume: restored" "$dir/log_ck2" || { echo "FAIL: no resume on the NCCL path"; cat "$dir/log_ck2"; exit 1; }
train "$dir/log_ck3" "${common[@]}" -x 10 -n 5 -y 1 -o "$dir/ck_plain" --save-model 0
grep -q "resume: restored" "$dir/log_ck3" || { echo "FAIL: no plain resume"; cat "$dir/log_ck3"; exit 1; }
grep -q "re-sharded to one whole copy" "$dir/log_ck3" || { echo "FAIL: the plain resume did not re-shard"; cat "$dir/log_ck3"; exit 1; }
ls "$dir/ck/ckpt_00000005" >"$dir/ls_sharded"
for f in model.bin master_00000.bin adam_m_00000.bin adam_v_00000.bin manifest.txt; do
    grep -qx "$f" "$dir/ls_sharded" || { echo "FAIL: the -z 1 checkpoint lacks $f:"; cat "$dir/ls_sharded"; exit 1; }
done
python3 -c "import struct,sys; h=struct.unpack('<2i', open(sys.argv[1],'rb').read(8)); sys.exit(0 if h==(20240326,5) else 1)" \
    "$dir/ck/ckpt_00000005/model.bin" || { echo "FAIL: the -z 1 checkpoint's model.bin is not an llm.c bf16 (v5) file"; exit 1; }
# A plain checkpoint (whole layout) resumed on the NCCL path with ZeRO-1.
train "$dir/log_ckw" "${common[@]}" -x 5 -n 5 -o "$dir/ck_whole" --save-model 0
train "$dir/log_ckw2" "${common[@]}" -x 10 -n 5 -y 1 -o "$dir/ck_whole" "${nccl[@]}" -z 1 --save-model 0
grep -q "re-sharded to rank 0 of 1" "$dir/log_ckw2" || { echo "FAIL: the -z 1 resume did not re-shard"; cat "$dir/log_ckw2"; exit 1; }

python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def records(run):
    out = []
    for l in open("%s/%s/log.jsonl" % (d, run)):
        r = json.loads(l)
        if "loss" in r: out.append(("train", r["step"], repr(r["loss"]), repr(r["norm"])))
        elif "val_loss" in r: out.append(("val", r["step"], repr(r["val_loss"])))
    return out
def fail(msg):
    print("FAIL:", msg); sys.exit(1)
for acc in (256, 512):
    plain = records("plain_%d" % acc)
    if len([r for r in plain if r[0] == "train"]) != 10: fail("plain run: %s" % plain)
    for z in (0, 1):
        got = records("z%d_%d" % (z, acc))
        if got != plain: fail("--multi-gpu 1 -z %d -d %d differs from the plain run:\n%s\n%s" % (z, acc, plain, got))
print("one rank through NCCL (-z 0 and -z 1, 1 and 2 micro-steps): 10 steps bitwise identical to the plain run")
plain = records("plain_256")
tail = [r for r in plain if r[1] > 5 or (r[0] == "val" and r[1] == 5)]
for run in ("ck", "ck_plain", "ck_whole"):
    got = [r for r in records(run) if r[1] > 5 or (r[0] == "val" and r[1] == 5)]
    # The first run logs val at step 5 at its end, the resumed one again at its start: keep one of each.
    got = sorted(set(got), key=lambda r: (r[1], r[0] != "val"))
    want = sorted(set(tail), key=lambda r: (r[1], r[0] != "val"))
    if got != want: fail("resumed run %s differs from the uninterrupted one:\n%s\n%s" % (run, want, got))
print("a -z 1 checkpoint at step 5 resumes bitwise (on the NCCL path and on the plain path), a plain one with -z 1")
PY

# A peer that never comes: only rank 0 of 2 starts; it must fail with a message within the timeout.
rc=0
start=$(date +%s)
timeout 120 ./train_gpt2cu "${common[@]}" -x 2 -o "" --world-size 2 --rank 0 --local-rank 0 \
    --rendezvous "$dir/rdv" --rendezvous-job lonely --nccl-timeout 5 >"$dir/log_lonely" 2>&1 || rc=$?
secs=$(( $(date +%s) - start ))
if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "FAIL: a lonely rank 0 exited $rc after ${secs}s (expected a clear error)"; cat "$dir/log_lonely"; exit 1
fi
grep -q "never read the id" "$dir/log_lonely" || { echo "FAIL: no clear message:"; cat "$dir/log_lonely"; exit 1; }
[ $secs -le 60 ] || { echo "FAIL: the lonely rank took ${secs}s to give up (timeout 5 s)"; exit 1; }
echo "a missing peer: exit $rc after ${secs}s: $(grep -m1 'never read the id' "$dir/log_lonely")"

# One visible GPU, local rank 1: the rank uses the GPU it sees.
first_gpu=${CUDA_VISIBLE_DEVICES:-0}
CUDA_VISIBLE_DEVICES=${first_gpu%%,*} train "$dir/log_own_gpu" "${common[@]}" -x 2 -d 256 -o "" --multi-gpu 1 \
    --local-rank 1
grep -q "data parallel: 1 rank(s)" "$dir/log_own_gpu" ||
    { echo "FAIL: --local-rank 1 with one visible GPU did not train on the NCCL path"; cat "$dir/log_own_gpu"; exit 1; }
echo "one visible GPU, --local-rank 1: trains"

# --hang-timeout watches every phase, not only steps: with a 1 s timeout, a d12 validation over 2M tokens
# and a 600-token sample (each several seconds on one GPU, heartbeating as they go) finish.
python3 test/make_synthetic_shards.py "$dir" long_val=2000000
t0=$(date +%s.%N)
train "$dir/log_hang" -e d12 -i "$dir/syn_train_*.bin" -j "$dir/long_val_*.bin" -b 4 -t 1024 -x 1 -v 1 -m -1 \
    -s 1 -g 600 -o "" "${nccl[@]}" --rendezvous-job hang --hang-timeout 1
secs=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
python3 -c "import sys; sys.exit(0 if $secs > 3 else 1)" ||
    { echo "FAIL: the --hang-timeout run took only $secs s: its phases did not outlast the timeout"; exit 1; }
echo "--hang-timeout 1 with a long validation and a long sample: finished in $secs s"

# A damaged shard file in the newest ZeRO-1 checkpoint: -y 1 says so and falls back to the one before,
# and the run continues bitwise.
train "$dir/log_dmg" "${common[@]}" -x 10 -n 5 -o "$dir/dmg" "${nccl[@]}" -z 1 --save-model 0
python3 - "$dir/dmg/ckpt_00000010/adam_m_00000.bin" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(100)
    b = f.read(1)
    f.seek(100)
    f.write(bytes([b[0] ^ 0x10]))
PY
rm "$dir/dmg/log.jsonl"
train "$dir/log_dmg2" "${common[@]}" -x 10 -n 5 -y 1 -o "$dir/dmg" "${nccl[@]}" -z 1 --save-model 0
grep -q "resume: skipping .*ckpt_00000010: .*adam_m_00000.bin" "$dir/log_dmg2" ||
    { echo "FAIL: the damaged shard file was not reported"; cat "$dir/log_dmg2"; exit 1; }
grep -q "resume: restored .*ckpt_00000005 (after skipping 1 newer): step 5" "$dir/log_dmg2" ||
    { echo "FAIL: no fallback to step 5"; cat "$dir/log_dmg2"; exit 1; }
python3 - "$dir/ck/log.jsonl" "$dir/dmg/log.jsonl" <<'PY'
import json, sys
def steps(path):
    return {r["step"]: (r["loss"], r["norm"]) for r in map(json.loads, open(path)) if "loss" in r}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
bad = [s for s in range(6, 11) if s not in b or a.get(s) != b[s]]
if bad:
    print("FAIL: after the fallback, steps %s differ from the uninterrupted -z 1 run" % bad); sys.exit(1)
PY
echo "a damaged ZeRO-1 shard file: skipped with its name, resumed from step 5, steps 6..10 bitwise: ok"

gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -lt 2 ]; then
    echo "ok (the two-rank checks need 2 GPUs; this machine has $gpus)"
    exit 0
fi
# two_ranks NAME ARGS...: ranks 0 and 1 on GPUs 0 and 1 (or, with OWN_GPU=1, each seeing only its own).
two_ranks() {
    local name=$1 r pids=() rc=0
    shift
    mkdir -p "$dir/rdv_$name"
    for r in 0 1; do
        if [ "${OWN_GPU:-0}" = 1 ]; then
            CUDA_VISIBLE_DEVICES=$r timeout -k 10 120 ./train_gpt2cu "$@" --rank $r --world-size 2 --local-rank $r \
                --rendezvous "$dir/rdv_$name" >"$dir/log_${name}_r$r" 2>&1 &
        else
            timeout -k 10 120 ./train_gpt2cu "$@" --rank $r --world-size 2 --local-rank $r \
                --rendezvous "$dir/rdv_$name" >"$dir/log_${name}_r$r" 2>&1 &
        fi
        pids+=($!)
    done
    for r in 0 1; do wait "${pids[$r]}" || rc=$?; done
    if [ $rc -ne 0 ]; then
        echo "FAIL: two ranks ($name) exited $rc:"; tail -n 20 "$dir/log_${name}_r0" "$dir/log_${name}_r1"; exit 1
    fi
    local a b
    a=$(sed -n 's/^rank 0 parameter checksum \([0-9a-fA-F]*\)$/\1/p' "$dir/log_${name}_r0")
    b=$(sed -n 's/^rank 1 parameter checksum \([0-9a-fA-F]*\)$/\1/p' "$dir/log_${name}_r1")
    if [ -z "$a" ] || [ "$a" != "$b" ]; then
        echo "FAIL: two ranks ($name): parameter checksums '$a' and '$b'"; exit 1
    fi
    echo "$a" >"$dir/sum_$name"
}
train "$dir/log_one_512" "${common[@]}" -x 10 -d 512 -o "$dir/one_512" --save-model 0
two_ranks z0 "${common[@]}" -x 10 -d 512 -o "$dir/two_z0" --save-model 0 -z 0
two_ranks z1 "${common[@]}" -x 10 -d 512 -o "$dir/two_z1" --save-model 0 -z 1
OWN_GPU=1 two_ranks z1_own "${common[@]}" -x 10 -d 512 -o "$dir/two_z1_own" --save-model 0 -z 1
cmp -s "$dir/sum_z1" "$dir/sum_z1_own" || {
    echo "FAIL: one visible GPU per rank changed the parameters ($(cat "$dir/sum_z1") vs $(cat "$dir/sum_z1_own"))"
    exit 1
}
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{d}/{run}/log.jsonl")) if "loss" in r}
one = losses("one_512")
for run in ("two_z0", "two_z1", "two_z1_own"):
    got = losses(run)
    if sorted(got) != sorted(one):
        print(f"FAIL: {run} logged steps {sorted(got)}, one GPU {sorted(one)}"); sys.exit(1)
    worst = max(abs(got[s] - one[s]) for s in one)
    if worst > 0.02:
        print(f"FAIL: {run}: max |loss diff| {worst:.4f} against one GPU (limit 0.02)"); sys.exit(1)
    print(f"{run}: 10 steps within {worst:.5f} of one GPU's losses")
PY
echo "two ranks (-z 0, -z 1, one GPU per rank): the same parameters on both ranks; one GPU per rank changes no bit"
echo "ok"
