#!/usr/bin/env bash
# dev/ncu_summary.py on a small Nsight Compute CSV made here: --steps divides every kernel's time by the
# number of steps; --last-step keeps only the kernels after the second-to-last launch of the named kernel
# (the trainer's first step also runs the gemm tuner's trial matmuls, which must not count), and sums
# them by kind (matmul, attention, other); a marker that is not there twice is an error.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/ncu_summary_XXXXXX)
trap 'rm -rf "$dir"' EXIT
csv=$dir/prof.csv
{
    echo '==PROF== Connected to process 1'
    echo '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
    id=0
    row() {  # row KERNEL NANOSECONDS
        echo "\"$id\",\"1\",\"t\",\"h\",\"$1\",\"1\",\"13\",\"(256, 1, 1)\",\"(8, 1, 1)\",\"0\",\"9.0\",\"m\",\"gpu__time_duration.sum\",\"ns\",\"$2\""
        id=$((id + 1))
    }
    # Step 1: the tuner's trials, then the step; steps 2 and 3: the step alone.
    row "detail::gemm_fingerprint_kernel(const float *)" "9,000,000"
    row "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT" "5,000,000"
    for step in 1 2 3; do
        row "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT" "2,000,000"
        row "void llmc::flash90_detail::flash90_fwd_kernel<1>(__nv_bfloat16 *, float *)" "1,000,000"
        row "llmc::layernorm_forward_kernel(__nv_bfloat16 *)" "250,000"
        row "cublasLt::splitKreduce_kernel(float *)" "500,000"
        row "llmc::adamw_kernel(float *, int)" "$((step * 100000))"
    done
} >"$csv"

fail() { echo "FAIL: $*"; echo "--- output:"; cat "$dir/out"; exit 1; }

python3 dev/ncu_summary.py "$csv" --steps 3 >"$dir/out"
# (9 + 5 + 3 * 3.75 + 0.6) / 3 ms per step
grep -q "total kernel time: 8.62 ms/step over 6 kernel names (3 step(s))" "$dir/out" || fail "--steps 3 total"
grep -q "| detail::gemm_fingerprint_kernel | 0.3 | 3.000 |" "$dir/out" || fail "--steps 3 tuner row"

python3 dev/ncu_summary.py "$csv" --last-step adamw_kernel >"$dir/out"
grep -q "total kernel time: 4.05 ms/step over 5 kernel names (1 step(s))" "$dir/out" || fail "--last-step total"
grep -q "gemm_fingerprint" "$dir/out" && fail "--last-step kept the tuner's kernel"
grep -q "| nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT | 1.0 | 2.000 |" "$dir/out" || fail "--last-step matmul row"
grep -q "| llmc::adamw_kernel | 1.0 | 0.300 |" "$dir/out" || fail "--last-step must end with the last adamw"
grep -q "by kind (ms/step): matmul 2.50, attention 1.00, other 0.55" "$dir/out" || fail "--last-step kinds"

if python3 dev/ncu_summary.py "$csv" --last-step no_such_kernel >"$dir/out" 2>&1; then fail "a missing marker passed"; fi
grep -q "needs two launches of a kernel named like 'no_such_kernel', found 0" "$dir/out" || fail "missing-marker message"
echo "ncu_summary: --steps and --last-step pass"
