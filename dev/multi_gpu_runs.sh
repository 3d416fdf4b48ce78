#!/usr/bin/env bash
# The multi-GPU runs of issue 10 on one node of N GPUs (N >= 2), in one call:
#   bash dev/multi_gpu_runs.sh N          (data/ from `make data` must be present; train_gpt2cu built)
# Logs go to $LOGS (default build/multi-gpu-logs); a table is printed last. Every run has a time limit.
#  1. Correctness: d12, the same global batch (32K tokens: 2 micro-steps of B=16 on one GPU, one per rank
#     on two), 100 steps from the same model file: per-step losses of 2 ranks (ZeRO-1 and plain data
#     parallel) against 1 GPU, at most 0.02 apart; ZeRO-1 against plain data parallel, at most 0.02.
#  2. Weak scaling: tokens/s of d12 (B=64) and d48 (B=8) with 64K / 8K tokens per rank per step on 1 and
#     on N GPUs (and 2, 4 when N is larger): efficiency = tok/s(N) / (N * tok/s(1)), target >= 0.95.
#  3. Checkpoints: 20 steps on N GPUs (ZeRO-1, a checkpoint every 10) straight, and resumed from step
#     10 on N GPUs (bitwise the straight run's losses) and on 1 GPU (re-sharded; within 0.02).
#  4. A peer killed with kill -9 at step ~15 (--hang-timeout 60): rank 0 must stop with a clear error
#     within the timeout (not hang), and -y 1 then resumes from the step-10 checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bash dev/multi_gpu_runs.sh N_GPUS}
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
ranks() {  # ranks WORLD LOG LIMIT ARGS...: WORLD local ranks; rank 0's output to LOG, the others' to LOG.rR
    local world=$1 log=$2 limit=$3 rdv pids=() rc=0 r
    shift 3
    rdv=$(mktemp -d "$work/rdv_XXXXXX")
    for ((r = 0; r < world; r++)); do
        local dest="$LOGS/$log"; [ $r -gt 0 ] && dest="$work/$log.r$r"
        timeout -k 10 "$limit" "$trainer" --rank $r --world-size "$world" --local-rank $r --rendezvous "$rdv" \
            --rendezvous-job "$log" "$@" >"$dest" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    return $rc
}
tok_s() { sed -n 's/^average over .* ms\/step, \([0-9]*\) tok\/s.*/\1/p' "$LOGS/$1" | tail -n 1; }

# A common start: the same d12 model file for every correctness run.
single init.log 120 -e d12 -x 0 -v 0 -s 0 -o "$work/init" || { note "d12 init failed"; exit 1; }
init="$work/init/model.bin"
hp=(-e "$init" -b 16 -t 1024 -d 32768 -x 100 -l 6e-4 -u 30 -c 0.1 -v 50 -m 5 -s 0 --save-model 0)

# 1. Correctness.
single one_gpu.log 300 "${hp[@]}" -o "$work/one" ; note "1 GPU d12 100 steps: rc=$?"
ranks 2 two_z1.log 300 "${hp[@]}" -z 1 -o "$work/z1" ; note "2 GPUs -z 1: rc=$?"
ranks 2 two_z0.log 300 "${hp[@]}" -z 0 -o "$work/z0" ; note "2 GPUs -z 0: rc=$?"
python3 - "$work" <<'PY' | tee -a "$summary"
import json, sys
w = sys.argv[1]
def losses(run):
    try:
        return {r["step"]: r["loss"] for r in map(json.loads, open(f"{w}/{run}/log.jsonl")) if "loss" in r}
    except OSError:
        return {}
one, z1, z0 = losses("one"), losses("z1"), losses("z0")
for name, a, b in (("2 GPUs ZeRO-1 vs 1 GPU", z1, one), ("2 GPUs plain DP vs 1 GPU", z0, one), ("ZeRO-1 vs plain DP", z1, z0)):
    common = sorted(set(a) & set(b))
    if len(common) < 100:
        print(f"{name}: only {len(common)} common steps: FAIL"); continue
    worst = max(abs(a[s] - b[s]) for s in common)
    print(f"{name}: max |loss diff| {worst:.4f} over {len(common)} steps (limit 0.02) {'PASS' if worst <= 0.02 else 'FAIL'}")
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
ranks "$N" ck_first.log 300 "${ck[@]}" -x 10 -n 10 -o "$work/ck_n" ; note "$N GPUs to step 10 with a checkpoint: rc=$?"
ls "$work/ck_n/ckpt_00000010" >"$LOGS/ck_files.txt" 2>&1
cp -r "$work/ck_n" "$work/ck_1"
ranks "$N" ck_resume_n.log 300 "${ck[@]}" -n 10 -y 1 -o "$work/ck_n" ; note "resume on $N GPUs: rc=$?"
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

# 4. A peer killed mid-run.
kill_args=(-e "$init" -b 16 -t 1024 -d $((16 * 1024 * N)) -x 200 -l 6e-4 -u 5 -v 0 -s 0 --save-model 0 -z 1 -n 10
           --hang-timeout 60)
rdv=$(mktemp -d "$work/rdv_XXXXXX")
pids=()
start=$(date +%s)
for ((r = 0; r < N; r++)); do
    dest="$LOGS/kill_r0.log"; [ $r -gt 0 ] && dest="$work/kill_r$r.log"
    timeout -k 10 400 "$trainer" --rank $r --world-size "$N" --local-rank $r --rendezvous "$rdv" --rendezvous-job kill \
        "${kill_args[@]}" -o "$work/kill" >"$dest" 2>&1 &
    pids+=($!)
done
for _ in $(seq 1 600); do grep -qE '^step +1[5-9]/' "$LOGS/kill_r0.log" 2>/dev/null && break; sleep 0.5; done
kill -9 "${pids[1]}"
killed=$(date +%s)
rc0=0; wait "${pids[0]}" || rc0=$?
for p in "${pids[@]:2}"; do wait "$p" 2>/dev/null || true; done
secs=$(( $(date +%s) - killed ))
note "peer killed: rank 0 exited $rc0 after ${secs}s (hang timeout 60 s): $(grep -m1 -iE 'error' "$LOGS/kill_r0.log" || echo 'no error line')"
if [ "$rc0" -ne 0 ] && [ "$rc0" -ne 124 ] && [ "$rc0" -ne 137 ] && [ "$secs" -le 120 ]; then note "peer killed: PASS"; else note "peer killed: FAIL"; fi
ranks "$N" kill_resume.log 400 "${kill_args[@]}" -x 30 -y 1 -o "$work/kill"; rc=$?
note "resume after the kill: rc=$rc, $(grep -m1 'resume: restored' "$LOGS/kill_resume.log" || echo 'no resume line')"
rm -rf "$work"
echo
echo "==== summary"
cat "$summary"
