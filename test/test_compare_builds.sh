#!/usr/bin/env bash
# dev/compare_builds.sh with stand-in trainers (no GPU, no build), in a scratch copy of the script:
#   - flags after a variant's executable ("NAME=EXE FLAGS") reach that variant's runs only: one stand-in
#     run as two variants, one of them with a flag that halves its time, gives a ratio of 0.500 for it and
#     1.000 for the other, and every run the same losses;
#   - a flag that changes a loss is reported as a difference in that variant's runs;
#   - a name given twice is refused (exit 2).
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_compare_builds_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/tree/dev"
cp dev/compare_builds.sh "$dir/tree/dev/"

# The stand-in: 3 step lines and the trainer's average line; --half halves the time, --loss2 L sets step
# 2's loss; anything else given (ARGS, -v 0 -s 0 -o "") is ignored, but recorded in $dir/argv.
cat >"$dir/trainer" <<EOF
#!/usr/bin/env bash
ms=100.00 loss2=9.5
echo "\$*" >>"$dir/argv"
while [ \$# -gt 0 ]; do
    case \$1 in --half) ms=50.00 ;; --loss2) loss2=\$2; shift ;; esac
    shift
done
echo "step 1/3 | loss 10.5 | norm 1.25 | \$ms ms | 1000 tok/s"
echo "step 2/3 | loss \$loss2 | norm 1.25 | \$ms ms | 1000 tok/s"
echo "step 3/3 | loss 8.5 | norm 1.25 | \$ms ms | 1000 tok/s"
echo "average over 2 steps: \$ms ms/step, 1000 tok/s, MFU 1.0%"
EOF
chmod +x "$dir/trainer"
fail() { echo "FAIL: $*"; cat "$dir/out"; exit 1; }
run() {  # run SPEC...: output in $dir/out, exit code in rc
    rc=0
    : >"$dir/argv"
    ROUNDS=2 ARGS="-e d2" bash "$dir/tree/dev/compare_builds.sh" "$@" >"$dir/out" 2>&1 || rc=$?
}

run "plain=$dir/trainer" "half=$dir/trainer --half"
[ $rc -eq 0 ] || fail "exited $rc"
grep -Eq '^plain +100(\.00)? +1\.000 ' "$dir/out" || fail "plain's row is not 100 ms at 1.000"
grep -Eq '^half +50(\.00)? +0\.500 ' "$dir/out" || fail "half's row is not 50 ms at 0.500"
grep -q "every run printed the same" "$dir/out" || fail "the same losses were reported as different"
[ "$(grep -c -- '--half' "$dir/argv")" = 2 ] || fail "--half did not reach exactly half's 2 runs: $(cat "$dir/argv")"
grep -q -- '-e d2 --half' "$dir/argv" || fail "the variant's flags do not follow ARGS: $(cat "$dir/argv")"
echo "ok: a variant's flags reach its runs only"

run "plain=$dir/trainer" "other=$dir/trainer --loss2 9.25"
[ $rc -eq 0 ] || fail "exited $rc"
grep -q "different from plain's first run in: other (round 1) other (round 2)" "$dir/out" ||
    fail "a changed loss was not reported"
echo "ok: a flag that changes a loss is reported"

run "a=$dir/trainer" "a=$dir/trainer --half"
[ $rc -eq 2 ] || fail "a name given twice exited $rc, not 2"
grep -q "the name 'a' is given twice" "$dir/out" || fail "a name given twice: no message"
echo "ok: a name given twice is refused"
