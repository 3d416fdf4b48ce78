#!/usr/bin/env bash
# dev/ncu_stalls.py on a small Nsight Compute source-page CSV made here (the columns ncu writes, fewer of
# them): the total, the shares by opcode (predicates dropped, the mnemonic before its first '.'), the
# instructions sorted by samples with their running total and the stall reasons that hold a tenth of an
# instruction's samples (issued and not-issued counted once), and a clear error for a CSV without samples.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/ncu_stalls_XXXXXX)
trap 'rm -rf "$dir"' EXIT
csv=$dir/sass.csv
{
    echo '"Kernel Name","void k<(bool)1>(int)",'
    echo '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_math","stall_barrier (Not Issued)","stall_long_sb (Not Issued)"'
    echo '"0x7f0000000010","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R6","100","90","0","5","95","0","5"'
    echo '"0x7f0000000020","@!P0  BRA 0x7f0000000900","5,000","4,900","0","4,950","50","0","4,900"'
    echo '"0x7f0000000030","      WARPGROUP.DEPBAR.LE gsb0, 0x1","3000","2990","2,990","0","10","2,990","0"'
    echo '"0x7f0000000040","      MUFU.EX2 R5, R5","1500","700","0","0","1,500","0","0"'
    echo '"0x7f0000000050","      MUFU.EX2 R6, R6","400","100","0","0","40","0","0"'
    echo '"0x7f0000000060","@P1   BRA 0x7f0000000010","0","0","0","0","0","0","0"'
} >"$csv"

fail() { echo "FAIL: $*"; echo "--- output:"; cat "$dir/out"; exit 1; }

python3 dev/ncu_stalls.py "$csv" --top 3 >"$dir/out"
grep -q '^kernel: void k<(bool)1>(int)$' "$dir/out" || fail "kernel name"
grep -q '^10000 samples over 6 instructions$' "$dir/out" || fail "total"
grep -qE '^  BRA +50\.0%$' "$dir/out" || fail "BRA share (the predicate dropped, both branches summed)"
grep -qE '^  WARPGROUP +30\.0%$' "$dir/out" || fail "WARPGROUP share"
grep -qE '^  MUFU +19\.0%$' "$dir/out" || fail "MUFU share (two instructions)"
grep -qE '^  SYNCS +1\.0%$' "$dir/out" || fail "SYNCS share"
# the top three in order, with running totals and reasons (>= 10% of the instruction's samples only)
mapfile -t top < <(sed -n '/instructions with the most samples/,$p' "$dir/out" | tail -n +2)
[ ${#top[@]} -eq 3 ] || fail "--top 3 listed ${#top[@]}"
[[ ${top[0]} =~ ^\ +000020\ +50\.0%\ +50\.0%\ +@!P0\ +BRA\ 0x7f0000000900\ +long_sb\ 99%$ ]] || fail "first: ${top[0]}"
[[ ${top[1]} =~ ^\ +000030\ +30\.0%\ +80\.0%\ +WARPGROUP\.DEPBAR\.LE\ gsb0,\ 0x1\ +barrier\ 100%$ ]] || fail "second: ${top[1]}"
[[ ${top[2]} =~ ^\ +000040\ +15\.0%\ +95\.0%\ +MUFU\.EX2\ R5,\ R5\ +math\ 100%$ ]] || fail "third: ${top[2]}"

# no samples column: an error that says what is missing
head -n 1 "$csv" >"$dir/bad.csv"
echo '"Address","Source","Instructions Executed"' >>"$dir/bad.csv"
echo '"0x1","NOP","5"' >>"$dir/bad.csv"
if python3 dev/ncu_stalls.py "$dir/bad.csv" >"$dir/out" 2>&1; then fail "a CSV without samples passed"; fi
grep -q "no header with 'Source' and 'Warp Stall Sampling (All Samples)'" "$dir/out" || fail "the error does not name the columns"
if python3 dev/ncu_stalls.py "$dir/missing.csv" >"$dir/out" 2>&1; then fail "a missing file passed"; fi
grep -q "cannot read" "$dir/out" || fail "a missing file's error"
echo "ncu_stalls: shares, order, reasons and errors pass"
