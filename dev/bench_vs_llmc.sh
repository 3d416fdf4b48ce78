#!/usr/bin/env bash
# Our trainer against llm.c on one GPU, interleaved: each round runs ours once per --fp8 mode, then llm.c,
# so clock and thermal drift fall on both alike. Both are timed the same way: d12 T=1024 at batch B for
# 40 steps (what bench_llmc.sh runs), the median ms/step of steps 11-40 (llm.c's bench_llmc.sh reports that
# median; ours is taken from the trainer's per-step lines). Prints every run, then per mode the median over rounds and its
# speed-up over llm.c's median.
#   LLMC_PEER=<folder of bench_llmc.sh> bash dev/bench_vs_llmc.sh
#   ROUNDS=3 B=64 MODES="0 1" LLMC_PEER=... bash dev/bench_vs_llmc.sh
# bench_llmc.sh builds llm.c on its first call (about a minute).
# Needs ./train_gpt2cu (make train_gpt2cu; TRAINER names another build) and data/ (make data).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
B=${B:-64}
MODES=${MODES:-"0 1"}
LOGS=${LOGS:-build/bench-vs-llmc}
TRAINER=${TRAINER:-./train_gpt2cu}
[ -n "${LLMC_PEER:-}" ] && [ -f "$LLMC_PEER/bench_llmc.sh" ] ||
    { echo "bench_vs_llmc: set LLMC_PEER to the folder holding bench_llmc.sh" >&2; exit 2; }
[ -x "$TRAINER" ] || { echo "bench_vs_llmc: $TRAINER is missing: run make train_gpt2cu" >&2; exit 2; }
for v in ROUNDS B; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "bench_vs_llmc: $v must be a positive whole number, not '${!v}'" >&2; exit 2; }
done
gpu=$(nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader 2>/dev/null | head -n 1 || true)
[ -n "$gpu" ] || { echo "bench_vs_llmc: nvidia-smi found no GPU" >&2; exit 2; }
mkdir -p "$LOGS"
results="$LOGS/results.txt"
: >"$results"
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "GPU: $gpu"
echo "d12 B=$B T=1024, $ROUNDS rounds, median ms/step of steps 11-40"
for round in $(seq 1 "$ROUNDS"); do
    for mode in $MODES; do
        log="$LOGS/ours_${mode//[^a-z0-9]/_}_r$round.log"
        if ! "$TRAINER" -e d12 -b "$B" -t 1024 -x 40 -v 0 -s 0 -o "" --fp8 "$mode" >"$log" 2>&1; then
            echo "bench_vs_llmc: our trainer failed (--fp8 $mode, round $round); the end of $log:" >&2
            tail -5 "$log" >&2
            exit 1
        fi
        ms=$(python3 - "$log" <<'PY'
import re, statistics, sys
ms = [float(m.group(2)) for m in (re.match(r"step\s+(\d+)/\d+ .*\| ([\d.]+) ms", l) for l in open(sys.argv[1]))
      if m and int(m.group(1)) > 10]
if not ms:
    sys.exit(f"no step lines past step 10 in {sys.argv[1]}")
print(f"{statistics.median(ms):.2f}")
PY
)
        echo "ours --fp8 $mode $ms" >>"$results"
        echo "round $round  ours --fp8 $mode: $ms ms/step"
    done
    line=$(bash "$LLMC_PEER/bench_llmc.sh" "$B" | grep "^LLMC B=$B " || true)
    ms=$(echo "$line" | sed -n 's/.*ms_per_step=\([0-9.]*\).*/\1/p')
    [ -n "$ms" ] || { echo "bench_vs_llmc: llm.c printed no timing in round $round (see /tmp/llmc_B$B.log)" >&2; exit 1; }
    echo "llmc $ms" >>"$results"
    echo "round $round  llm.c: $ms ms/step"
done
python3 - "$results" "$B" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    *name, ms = line.split()
    runs.setdefault(" ".join(name), []).append(float(ms))
B = int(sys.argv[2])
peer = runs.pop("llmc")
ref = statistics.median(peer)
print(f"{'':34s} {'ms/step':>8s} {'tok/s':>8s} {'vs llm.c':>8s}   runs")
print(f"{'llm.c':34s} {ref:8.2f} {B * 1024 / ref * 1000:8.0f} {1:8.3f}x   {' '.join(f'{m:.2f}' for m in peer)}")
for name, ms in runs.items():
    med = statistics.median(ms)
    print(f"{name:34s} {med:8.2f} {B * 1024 / med * 1000:8.0f} {ref / med:8.3f}x   {' '.join(f'{m:.2f}' for m in ms)}")
PY
