#!/usr/bin/env bash
# dev/ncu_step.py on an Nsight Compute CSV in ncu's exact layout (its "==PROF==" lines first, then one row
# per launch and metric, thousands separators in the values): three steps whose kernels differ, so a
# wrong step boundary changes every figure. Checked: the launches, ms and cycles of the last step (the
# launches after the next-to-last adamw_kernel, through the last), one kernel's sum over its template
# variants, the order (largest first), the sequence, and the errors for one step and for a missing metric.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_ncu_step_XXXXXX)
trap 'rm -rf "$dir"' EXIT

python3 - "$dir" <<'PY'
import sys
d = sys.argv[1]
head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
def rows(launches, metrics=("gpc__cycles_elapsed.avg.per_second", "gpu__time_duration.sum", "sm__cycles_elapsed.max")):
    out = ["==PROF== Connected to process 7 (/x/train_gpt2cu)", head]
    for i, (name, ns, mhz) in enumerate(launches):
        vals = {"gpu__time_duration.sum": ns, "sm__cycles_elapsed.max": ns * mhz / 1000,
                "gpc__cycles_elapsed.avg.per_second": mhz * 1e6}
        for m in metrics:
            out.append('"%d","7","train_gpt2cu","127.0.0.1","%s","1","13","(256, 1, 1)","(8, 1, 1)","0","9.0",'
                       '"Command line profiler metrics","%s","x","%s"' % (i, name, m, format(vals[m], ",.2f")))
    return "\n".join(out) + "\n"
step = lambda k: [("void llmc::layernorm_forward_kernel<3>(float *)", 50000 * k, 1900),
                  ("nvjet_sm90_tst_128x256_bias_TNN", 300000 * k, 1600),
                  ("void llmc::layernorm_forward_kernel<0>(float *)", 20000 * k, 2000),
                  ("llmc::adamw_kernel(float *, long)", 900000, 1950)]
open(d + "/three.csv", "w").write(rows(step(1) + step(2) + step(3)))
open(d + "/one.csv", "w").write(rows(step(1)))
open(d + "/nocycles.csv", "w").write(rows(step(1) + step(2), metrics=("gpu__time_duration.sum",)))
PY

fail() { echo "FAIL: $*"; exit 1; }
out=$(python3 dev/ncu_step.py "$dir/three.csv" --sequence 2)
echo "$out"
# Step 3: layernorm 150000 + 60000 ns, the matmul 900000 ns, adamw 900000 ns: 2.01 ms.
grep -q "^the last step: 4 launches, 2.01 ms" <<<"$out" || fail "the last step's launches and total"
grep -qE "^ +0\.210 +10\.4% +0\.405 +1950 +2  llmc::layernorm_forward_kernel$" <<<"$out" || fail "the two layernorm variants summed"
grep -qE "^ +0\.900 +44\.8% +1\.440 +1600 +1  nvjet_sm90_tst_128x256_bias_TNN$" <<<"$out" || fail "the matmul's row"
[ "$(grep -cE '^ +[0-9.]+ +[0-9.]+%' <<<"$out")" = 3 ] || fail "three kernel rows"
first=$(grep -m1 -E '^ +[0-9.]+ +[0-9.]+%' <<<"$out")
grep -qE "adamw_kernel|nvjet" <<<"$first" || fail "largest first: $first"
grep -qE "^ +0\.150 ms +1900 MHz  llmc::layernorm_forward_kernel$" <<<"$out" || fail "the sequence starts with the step's first launch"
if python3 dev/ncu_step.py "$dir/one.csv" >"$dir/err" 2>&1; then fail "one step accepted"; fi
grep -q "1 adamw_kernel launches; profile at least two steps" "$dir/err" || fail "one step's message: $(cat "$dir/err")"
if python3 dev/ncu_step.py "$dir/nocycles.csv" >"$dir/err" 2>&1; then fail "a CSV without the cycles accepted"; fi
grep -q "without the metrics sm__cycles_elapsed.max, gpc__cycles_elapsed.avg.per_second" "$dir/err" \
    || fail "missing metrics' message: $(cat "$dir/err")"
echo "PASS"
