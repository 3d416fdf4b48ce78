#!/usr/bin/env bash
# The multi-GPU runs on one node of N GPUs (N >= 2), in one call:
#   bash dev/multi_gpu_runs.sh N          (data/ from `make data` must be present; train_gpt2cu built)
# Logs go to $LOGS (default build/multi-gpu-logs): rank 0's as NAME.log, rank r's as NAME.log.rR; a table
# of PASS/FAIL lines is printed last. Every run has a time limit; ranks are started directly (not under
# `timeout`), so the pids this script holds, waits for and kills are the trainers themselves.
#  1. Correctness: d12, the same global batch (32K tokens: 2 micro-steps of B=16 on one GPU, one per rank
#     on two), 100 steps from the same model file: per-step losses of 2 ranks (ZeRO-1 and plain data
#     parallel) against 1 GPU, at most 0.02 apart; ZeRO-1 against plain data parallel, at most 0.02.
#     After every several-rank run, each rank's "rank R parameter checksum HEX" line (the bf16 parameters
#     at the end) must be the same on all ranks: replicas that drift apart (under -z 0 each rank updates
#     its own copy) are caught even when the losses look fine. The ZeRO-1 run again with one visible GPU
#     per rank (CUDA_VISIBLE_DEVICES=r, as Slurm's --gpus-per-task=1 gives): the same losses and checksum.
#  2. Weak scaling: tokens/s of d12 (B=64) and d48 (B=8) with 64K / 8K tokens per rank per step on 1 and
#     on N GPUs (and 2, 4 when N is larger): efficiency = tok/s(N) / (N * tok/s(1)), target >= 0.95.
#  3. Checkpoints: 20 steps on N GPUs (ZeRO-1, a checkpoint every 10) straight, and resumed from step
#     10 on N GPUs (bitwise the straight run's losses) and on 1 GPU (re-sharded; within 0.02).
#  4. A peer killed with kill -9 at step ~15 (--hang-timeout 60): every other rank must stop with a clear
#     error within the timeout and a margin (not hang), and -y 1 then resumes from the step-10 checkpoint.
#  5. A rank-local error: a token id out of the vocabulary in a sample only rank 1 reads (at step 5, with
#     --shuffle 0 and the data streamed): rank 1 must exit with the data error, and the other ranks must
#     stop with an error within --hang-timeout 60 and a margin instead of waiting in a collective.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bash dev/multi_gpu_runs.sh N_GPUS}
# Part 1 runs 2 ranks whatever N is and part 4 kills rank 1: one GPU cannot hold these runs.
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 2 ] || { echo "usage: bash dev/multi_gpu_runs.sh N_GPUS (at least 2), not '$N'" >&2; exit 2; }
LOGS=${LOGS:-build/multi-gpu-logs}
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0
work=$(mktemp -d /tmp/multi_gpu_runs_XXXXXX)
summary="$LOGS/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
trainer=${TRAINER:-./train_gpt2cu}  # TRAINER=...: another binary (a stand-in, to try this script without GPUs)
[ -x "$trainer" ] || make -j16 train_gpt2cu >/dev/null
ls data/quickstart_train_*.bin >/dev/null || { echo "data/ is missing: run make data first"; exit 1; }

single() {  # single LOG LIMIT ARGS...: one GPU, no NCCL
    local log=$1 limit=$2; shift 2
    timeout -k 10 "$limit" "$trainer" "$@" >"$LOGS/$log" 2>&1
}
rank_log() { if [ "$2" = 0 ]; then echo "$LOGS/$1"; else echo "$LOGS/$1.r$2"; fi; }

# start_ranks WORLD LOG ARGS...: WORLD local ranks in the background; their pids in rank_pids (rank order).
# VISIBLE_PER_RANK=1: each rank sees only its own GPU (CUDA_VISIBLE_DEVICES=r) and still gets --local-rank r.
rank_pids=()
start_ranks() {
    local world=$1 log=$2 rdv r
    shift 2
    rdv=$(mktemp -d "$work/rdv_XXXXXX")
    rank_pids=()
    for ((r = 0; r < world; r++)); do
        if [ "${VISIBLE_PER_RANK:-0}" = 1 ]; then
            CUDA_VISIBLE_DEVICES=$r "$trainer" --rank $r --world-size "$world" --local-rank $r --rendezvous "$rdv" \
                --rendezvous-job "$log" "$@" >"$(rank_log "$log" $r)" 2>&1 &
        else
            "$trainer" --rank $r --world-size "$world" --local-rank $r --rendezvous "$rdv" \
                --rendezvous-job "$log" "$@" >"$(rank_log "$log" $r)" 2>&1 &
        fi
        rank_pids+=($!)
    done
}
# wait_ranks SECONDS [PID...]: waits for the given trainers (default: rank_pids) for at most SECONDS, then
# kills (-9) any still running, so a rank that hangs (a peer gone, a collective never matched) cannot stall
# the script; sets rank_rc (exit codes in the same order, 137 for a killed one) and returns the first
# non-zero one.
rank_rc=()
wait_ranks() {
    local wait_s=$1 kill_at p alive rc=0 st
    shift
    local pids=("$@")
    [ ${#pids[@]} -gt 0 ] || pids=("${rank_pids[@]}")
    kill_at=$((SECONDS + wait_s))
    while :; do
        alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        if [ $SECONDS -ge $kill_at ]; then
            for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
            break
        fi
        sleep 0.5
    done
    rank_rc=()
    for p in "${pids[@]}"; do
        st=0
        wait "$p" 2>/dev/null || st=$?
        rank_rc+=("$st")
        [ $rc = 0 ] && rc=$st
    done
    return $rc
}
ranks() {  # ranks WORLD LOG LIMIT ARGS...: one several-rank run to its end (or its limit)
    local world=$1 log=$2 limit=$3
    shift 3
    start_ranks "$world" "$log" "$@"
    wait_ranks "$limit"
}
# checksums LOG WORLD: the ranks' parameter checksums, one per rank ("missing" where a rank printed none).
checksums() {
    local log=$1 world=$2 r sum
    for ((r = 0; r < world; r++)); do
        sum=$(sed -n "s/^rank $r parameter checksum \([0-9a-fA-F]*\)\$/\1/p" "$(rank_log "$log" $r)" 2>/dev/null |
              tail -n 1)
        echo "${sum:-missing}"
    done
}
agree() {  # agree NAME LOG WORLD: PASS when every rank printed one and the same parameter checksum
    local name=$1 log=$2 world=$3 sums
    mapfile -t sums < <(checksums "$log" "$world")
    if [ "${#sums[@]}" = "$world" ] && [ "${sums[0]}" != missing ] &&
        [ "$(printf '%s\n' "${sums[@]}" | sort -u | wc -l)" = 1 ]; then
        note "$name: the $world ranks' parameter checksums agree (${sums[0]}): PASS"
    else
        note "$name: parameter checksums by rank: ${sums[*]}: FAIL (replicas differ, or a rank printed none)"
    fi
}
tok_s() { sed -n 's/^average over .* ms\/step, \([0-9]*\) tok\/s.*/\1/p' "$LOGS/$1" | tail -n 1; }

# A common start: the same d12 model file for every correctness run.
single init.log 120 -e d12 -x 0 -v 0 -s 0 --save-model llmc -o "$work/init" || { note "d12 init failed"; exit 1; }
init="$work/init/model.bin"
hp=(-e "$init" -b 16 -t 1024 -d 32768 -x 100 -l 6e-4 -u 30 -c 0.1 -v 50 -m 5 -s 0 --save-model 0)

# 1. Correctness.
single one_gpu.log 300 "${hp[@]}" -o "$work/one" ; note "1 GPU d12 100 steps: rc=$?"
ranks 2 two_z1.log 300 "${hp[@]}" -z 1 -o "$work/z1" ; note "2 GPUs -z 1: rc=$?"
agree "2 GPUs -z 1" two_z1.log 2
ranks 2 two_z0.log 300 "${hp[@]}" -z 0 -o "$work/z0" ; note "2 GPUs -z 0: rc=$?"
agree "2 GPUs -z 0" two_z0.log 2
VISIBLE_PER_RANK=1 ranks 2 two_z1_own_gpu.log 300 "${hp[@]}" -z 1 -o "$work/z1_own"
note "2 GPUs -z 1, one visible GPU per rank: rc=$?"
agree "2 GPUs -z 1, one visible GPU per rank" two_z1_own_gpu.log 2
a=$(checksums two_z1.log 1) b=$(checksums two_z1_own_gpu.log 1)
if [ "$a" != missing ] && [ "$a" = "$b" ]; then
    note "one visible GPU per rank: the same parameters as the plain 2-GPU run ($a): PASS"
else
    note "one visible GPU per rank: checksum $b, the plain 2-GPU run's $a: FAIL"
fi
python3 - "$work" <<'PY' | tee -a "$summary"
import json, sys
w = sys.argv[1]
def losses(run):
    try:
        return {r["step"]: r["loss"] for r in map(json.loads, open(f"{w}/{run}/log.jsonl")) if "loss" in r}
    except OSError:
        return {}
one, z1, z0, own = losses("one"), losses("z1"), losses("z0"), losses("z1_own")
for name, a, b in (("2 GPUs ZeRO-1 vs 1 GPU", z1, one), ("2 GPUs plain DP vs 1 GPU", z0, one),
                   ("ZeRO-1 vs plain DP", z1, z0), ("one visible GPU per rank vs the plain 2-GPU ZeRO-1 run", own, z1)):
    common = sorted(set(a) & set(b))
    if len(common) < 100:
        print(f"{name}: only {len(common)} common steps: FAIL"); continue
    worst = max(abs(a[s] - b[s]) for s in common)
    bitwise = " (bitwise)" if worst == 0 else ""
    print(f"{name}: max |loss diff| {worst:.4f} over {len(common)} steps (limit 0.02){bitwise} "
          f"{'PASS' if worst <= 0.02 else 'FAIL'}")
PY

# 2. Weak scaling.
counts=(1)
for n in 2 4 8; do [ $n -le "$N" ] && counts+=($n); done
for spec in "d12 64" "d48 8"; do
    set -- $spec
    model=$1 B=$2
    base=""
    for n in "${counts[@]}"; do
        args=(-e "$model" -b "$B" -t 1024 -d $((B * 1024 * n)) -x 30 -v 0 -s 0 -o "")
        if [ "$n" = 1 ]; then single "scale_${model}_1.log" 300 "${args[@]}"; else ranks "$n" "scale_${model}_$n.log" 300 "${args[@]}"; fi
        t=$(tok_s "scale_${model}_$n.log")
        [ "$n" = 1 ] && base=$t
        if [ -n "$t" ] && [ -n "$base" ]; then
            note "$(python3 -c "import sys; t,b,n=float(sys.argv[1]),float(sys.argv[2]),int(sys.argv[3]); e=t/(n*b); print(f'{sys.argv[4]} B={sys.argv[5]} on {n} GPU(s): {t:.0f} tok/s, weak-scaling efficiency {e:.3f} (target >= 0.95) {\"PASS\" if e >= 0.95 or n == 1 else \"FAIL\"}')" "$t" "$base" "$n" "$model" "$B")"
        else
            note "$model B=$B on $n GPU(s): no throughput line (see $LOGS/scale_${model}_$n.log)"
        fi
    done
done

# 3. Checkpoints on N GPUs: straight, resumed on N, resumed on 1.
ck=(-e "$init" -b 16 -t 1024 -d $((16 * 1024 * N)) -x 20 -l 6e-4 -u 5 -c 0.1 -v 0 -s 0 --save-model 0 -z 1)
ranks "$N" ck_straight.log 300 "${ck[@]}" -o "$work/ck_straight" ; note "checkpoint run, $N GPUs straight: rc=$?"
agree "checkpoint run, $N GPUs straight" ck_straight.log "$N"
ranks "$N" ck_first.log 300 "${ck[@]}" -x 10 -n 10 -o "$work/ck_n" ; note "$N GPUs to step 10 with a checkpoint: rc=$?"
ls "$work/ck_n/ckpt_00000010" >"$LOGS/ck_files.txt" 2>&1
cp -r "$work/ck_n" "$work/ck_1"
ranks "$N" ck_resume_n.log 300 "${ck[@]}" -n 10 -y 1 -o "$work/ck_n" ; note "resume on $N GPUs: rc=$?"
agree "resume on $N GPUs" ck_resume_n.log "$N"
a=$(checksums ck_straight.log 1) b=$(checksums ck_resume_n.log 1)
if [ "$a" != missing ] && [ "$a" = "$b" ]; then
    note "resume on $N GPUs: the straight run's parameters at step 20 ($a): PASS"
else
    note "resume on $N GPUs: checksum $b, the straight run's $a: FAIL"
fi
single ck_resume_1.log 300 "${ck[@]}" -z 0 -n 10 -y 1 -o "$work/ck_1" ; note "resume on 1 GPU: rc=$?"
python3 - "$work" "$N" <<'PY' | tee -a "$summary"
import json, sys
w, n = sys.argv[1], sys.argv[2]
def losses(run):
    try:
        return {r["step"]: r["loss"] for r in map(json.loads, open(f"{w}/{run}/log.jsonl")) if "loss" in r}
    except OSError:
        return {}
ref, same, one = losses("ck_straight"), losses("ck_n"), losses("ck_1")
tail = [s for s in range(11, 21)]
ok = all(s in same and s in ref and same[s] == ref[s] for s in tail)
print(f"resume on {n} GPUs: steps 11-20 {'bitwise identical: PASS' if ok else 'differ: FAIL'}")
if all(s in one and s in ref for s in tail):
    worst = max(abs(one[s] - ref[s]) for s in tail)
    print(f"resume on 1 GPU (re-sharded): max |loss diff| {worst:.4f} over steps 11-20 (limit 0.02) {'PASS' if worst <= 0.02 else 'FAIL'}")
else:
    print("resume on 1 GPU: steps missing: FAIL")
PY
grep -E "re-sharded|written by" "$LOGS/ck_resume_1.log" | tee -a "$summary"

# stopped NAME LOG LIMIT RANK...: after a rank failed or was killed, the given ranks of the run in
# rank_pids must all end with an error (not killed at the limit) within LIMIT seconds.
stopped() {
    local name=$1 log=$2 limit=$3 t0=$SECONDS ok=1 i r line
    shift 3
    local which=("$@") pids=()
    for r in "${which[@]}"; do pids+=("${rank_pids[$r]}"); done
    wait_ranks "$limit" "${pids[@]}"
    local secs=$((SECONDS - t0))
    for i in "${!which[@]}"; do
        r=${which[$i]}
        line=$(grep -m1 -E '^error' "$(rank_log "$log" "$r")" || echo 'no error line')
        note "$name: rank $r exited ${rank_rc[$i]} ($line)"
        case "${rank_rc[$i]}" in 0 | 124 | 137) ok=0 ;; esac
    done
    if [ $ok = 1 ] && [ $secs -le "$limit" ]; then
        note "$name: the other ranks stopped with an error within ${secs}s: PASS"
    else
        note "$name: the other ranks did not all stop with an error within ${limit}s (took ${secs}s): FAIL"
    fi
}

# 4. A peer killed mid-run. The rank-1 pid is the trainer itself, so kill -9 reaches it.
kill_args=(-e "$init" -b 16 -t 1024 -d $((16 * 1024 * N)) -x 200 -l 6e-4 -u 5 -v 0 -s 0 --save-model 0 -z 1 -n 10
           --hang-timeout 60)
start_ranks "$N" kill.log "${kill_args[@]}" -o "$work/kill"
for _ in $(seq 1 600); do grep -qE '^step +1[5-9]/' "$LOGS/kill.log" 2>/dev/null && break; sleep 0.5; done
kill -9 "${rank_pids[1]}"
wait_ranks 10 "${rank_pids[1]}"
note "peer killed: rank 1 (pid ${rank_pids[1]}) exited ${rank_rc[0]} (137: killed)"
others=(0)
for ((r = 2; r < N; r++)); do others+=($r); done
stopped "peer killed" kill.log 120 "${others[@]}"
ranks "$N" kill_resume.log 400 "${kill_args[@]}" -x 30 -y 1 -o "$work/kill"; rc=$?
note "resume after the kill: rc=$rc, $(grep -m1 'resume: restored' "$LOGS/kill_resume.log" || echo 'no resume line')"
agree "resume after the kill" kill_resume.log "$N"

# 5. A rank-local error: one bad token in a sample of rank 1's slice at step 5.
mkdir -p "$work/bad"
cp data/quickstart_train_*.bin "$work/bad/"
B=16 T=1024
python3 - "$work/bad" "$N" "$B" "$T" <<'PY' | tee -a "$summary"
import glob, struct, sys
d, n, B, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# --shuffle 0: shards in name order, samples in file order; global batch k holds samples [k*B*n, (k+1)*B*n),
# rank r the B of them from (k*n + r)*B. A sample is T+1 tokens from a multiple of T; a shard of m tokens
# holds (m - 1) // T of them.
s = (5 * n + 1) * B + 3
for path in sorted(glob.glob(f"{d}/quickstart_train_*.bin")):
    m = struct.unpack("<256i", open(path, "rb").read(1024))[2]
    if s < (m - 1) // T:
        tok = s * T + 7
        with open(path, "r+b") as f:
            f.seek(1024 + 2 * tok)
            f.write(struct.pack("<H", 65535))
        print(f"bad token: id 65535 at token {tok} of {path} (sample {s}: rank 1's, step 5)")
        break
    s -= (m - 1) // T
PY
bad_args=(-e "$init" -b "$B" -t "$T" -d $((B * T * N)) -x 30 -l 6e-4 -u 5 -v 0 -s 0 --save-model 0 -z 1 --shuffle 0
          --data-on-gpu-mib 0 --hang-timeout 60 -i "$work/bad/quickstart_train_*.bin")
start_ranks "$N" bad_token.log "${bad_args[@]}" -o "$work/bad_out"
wait_ranks 300 "${rank_pids[1]}"
rc1=${rank_rc[0]}
if [ "$rc1" = 4 ] && grep -q "has id 65535" "$LOGS/bad_token.log.r1"; then
    note "bad token: rank 1 exited 4 naming it: PASS"
else
    note "bad token: rank 1 exited $rc1: $(grep -m1 -E '^error' "$LOGS/bad_token.log.r1" || echo 'no error line'): FAIL"
fi
stopped "bad token on rank 1" bad_token.log 120 "${others[@]}"

rm -rf "$work"
echo
echo "==== summary"
cat "$summary"
