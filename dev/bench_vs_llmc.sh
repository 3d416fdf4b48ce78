#!/usr/bin/env bash
# Our trainer against llm.c on one GPU: speed, memory and energy, interleaved. For each configuration
# (model and batch) and round, ours runs and then llm.c, so clock and thermal drift fall on both alike. Every run trains T=1024 for STEPS steps from a random initialisation with nvidia-smi
# sampling every 100 ms; per run: the median ms/step of the steps after the first quarter (both programs'
# per-step lines), the most device memory in use (nvidia-smi memory.used, less what was in use before), and
# the median power and SM clock of the busy samples (utilisation >= 95%, first quarter of them dropped),
# whose product with ms/step is the energy of a step. Prints every run, then per configuration and program
# the medians over rounds and the speed-up over llm.c.
#   LLMC_PEER=<folder of bench_llmc.sh> bash dev/bench_vs_llmc.sh
#   CONFIGS="d12:64 d12:16 d24:80 d48:24,20" ROUNDS=2 LLMC_PEER=... bash dev/bench_vs_llmc.sh
# CONFIGS: MODEL:B, or MODEL:B1,B2,... to take, per program, the first batch that fits (probed in round 1).
# bench_llmc.sh builds llm.c (master, cuDNN attention) on its first call and makes its token shards; llm.c
# then runs from $LLMC_PEER/llm.c on those shards ($LLMC_DATA, default /tmp/llmc_data), ours on data/.
# RUN_LIMIT: seconds a run may take (300). Needs ./train_gpt2cu (make train_gpt2cu; TRAINER names another build) and data/ (make data).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIGS=${CONFIGS:-d12:64 d12:16}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-40}
LOGS=${LOGS:-build/bench-vs-llmc}
TRAINER=${TRAINER:-./train_gpt2cu}
LLMC_DATA=${LLMC_DATA:-/tmp/llmc_data}
die() { echo "bench_vs_llmc: $*" >&2; exit 2; }
[ -n "${LLMC_PEER:-}" ] && [ -f "$LLMC_PEER/bench_llmc.sh" ] || die "set LLMC_PEER to the folder holding bench_llmc.sh"
[ -x "$TRAINER" ] || die "$TRAINER is missing: run make train_gpt2cu"
for v in ROUNDS STEPS; do [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive whole number, not '${!v}'"; done
[ "$STEPS" -ge 8 ] || die "STEPS must be at least 8, not $STEPS"
for c in $CONFIGS; do [[ $c =~ ^d[0-9]+:[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "a configuration is MODEL:B[,B...], not '$c'"; done
gpu=$(nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader 2>/dev/null | head -n 1 || true)
[ -n "$gpu" ] || die "nvidia-smi found no GPU"
mkdir -p "$LOGS"
results="$LOGS/results.txt"
: >"$results"
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "GPU: $gpu"
echo "T=1024, $STEPS steps a run, $ROUNDS rounds; ms/step: median of steps after $((STEPS / 4))"
# Builds llm.c and makes its shards (and runs it once at B=16, a warm-up for the GPU).
bash "$LLMC_PEER/bench_llmc.sh" 16 >"$LOGS/llmc_build.log" 2>&1 || { tail -5 "$LOGS/llmc_build.log" >&2; exit 1; }
LLMC_BIN=$(cd "$LLMC_PEER/llm.c" && pwd)/train_gpt2cu
[ -x "$LLMC_BIN" ] || die "bench_llmc.sh left no $LLMC_BIN"

# measure NAME LOG CMD...: runs CMD with nvidia-smi sampling; appends "NAME ms mem_gib watts mhz" to results.
measure() {
    local name=$1 log=$2
    shift 2
    local base
    base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)
    nvidia-smi --query-gpu=power.draw,memory.used,utilization.gpu,clocks.sm --format=csv,noheader,nounits \
        -lms 100 >"$log.smi" 2>&1 &
    local smi=$!
    local rc=0
    timeout "${RUN_LIMIT:-300}" "$@" >"$log" 2>&1 || rc=$?
    kill "$smi" 2>/dev/null || true
    wait "$smi" 2>/dev/null || true
    [ $rc = 0 ] || return $rc
    python3 - "$log" "$STEPS" "$base" "$name" >>"$results" <<'PY'
import re, statistics as st, sys
log, steps, base, name = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
ms = [float(m.group(2)) for m in (re.match(r"step\s+(\d+)/\d+ \|.*?\| ([\d.]+) ms", l) for l in open(log))
      if m and int(m.group(1)) > steps // 4]
if not ms:
    sys.exit(f"bench_vs_llmc: no step timings past step {steps // 4} in {log}")
rows = []
for line in open(log + ".smi"):
    try:
        rows.append([float(x) for x in line.split(",")])
    except ValueError:
        pass
busy = [r for r in rows if r[2] >= 95]
busy = busy[len(busy) // 4:]
watts = st.median(r[0] for r in busy) if busy else float("nan")
mhz = st.median(r[3] for r in busy) if busy else float("nan")
mem = (max(r[1] for r in rows) - base) / 1024 if rows else float("nan")
print(f"{name} {st.median(ms):.2f} {mem:.2f} {watts:.0f} {mhz:.0f}")
PY
}

declare -A chosen  # "config|program" -> the batch that fitted in round 1
for round in $(seq 1 "$ROUNDS"); do
    for c in $CONFIGS; do
        model=${c%%:*} bs=${c#*:}
        for prog in ours llmc; do
            key="$c|$prog"
            list=${chosen[$key]:-$bs}
            ok=0
            for B in ${list//,/ }; do
                log="$LOGS/${model}_B${B}_${prog}_r$round.log"
                if [ "$prog" = llmc ]; then
                    cmd=("$LLMC_BIN" -i "$LLMC_DATA/train_*.bin" -j "$LLMC_DATA/val_*.bin" -e "$model" -b "$B"
                         -t 1024 -d $((B * 1024)) -x "$STEPS" -v 1000 -s 1000 -h 0 -r 0 -l 6e-4 -u 10)
                else
                    cmd=("$TRAINER" -e "$model" -b "$B" -t 1024 -x "$STEPS" -v 0 -s 0 -o "")
                fi
                if measure "$c $prog $B" "$log" "${cmd[@]}"; then ok=1; chosen[$key]=$B; break; fi
                echo "round $round  $model B=$B $prog: did not run (the end of $log: $(tail -n 1 "$log"))"
            done
            [ $ok = 1 ] || die "$model $prog ran at none of the batches $bs"
            echo "round $round  $(tail -n 1 "$results")"
        done
    done
done
python3 - "$results" <<'PY'
import statistics as st, sys
runs = {}
for line in open(sys.argv[1]):
    config, prog, b, ms, mem, w, mhz = line.split()
    runs.setdefault(config.split(":")[0] + " " + config.split(":")[1].split(",")[0], {}).setdefault(prog, []).append(
        (int(b), float(ms), float(mem), float(w), float(mhz)))
print(f"\n{'config':8s} {'program':14s} {'B':>4s} {'ms/step':>8s} {'tok/s':>8s} {'vs llm.c':>9s} {'GiB':>7s} "
      f"{'W':>5s} {'MHz':>5s} {'J/step':>7s}   ms/step of each round")
for model, progs in runs.items():
    med = lambda rs, i: st.median(r[i] for r in rs)
    ref = progs.get("llmc")
    ref_tok = ref[0][0] * 1024 / med(ref, 1) * 1000 if ref else None
    for prog, rs in sorted(progs.items(), key=lambda kv: kv[0] != "llmc"):
        for B in sorted({r[0] for r in rs}, reverse=True):
            rb = [r for r in rs if r[0] == B]
            ms, tok = med(rb, 1), B * 1024 / med(rb, 1) * 1000
            vs = f"{tok / ref_tok:8.3f}x" if ref_tok else "       -"
            name = "llm.c" if prog == "llmc" else "ours"
            print(f"{model:8s} {name:14s} {B:4d} {ms:8.2f} {tok:8.0f} {vs:>9s} {med(rb, 2):7.2f} {med(rb, 3):5.0f} "
                  f"{med(rb, 4):5.0f} {med(rb, 3) * ms / 1000:7.1f}   {' '.join(f'{r[1]:.2f}' for r in rb)}")
PY
