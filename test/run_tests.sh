#!/usr/bin/env bash
# Runs test programs and prints one summary line at the end: "N passed, N failed, N skipped".
# GoogleTest binaries are counted per test case (their own summary lines are read); a script counts as
# one test: exit 0 passes, exit 77 skips (it should print why), anything else fails.
# A log of each program is kept in build/test-logs/; the end of a failing program's log is shown.
set -u
logdir=build/test-logs
mkdir -p "$logdir"
passed=0 failed=0 skipped=0

for t in "$@"; do
    name=$(basename "$t")
    log="$logdir/$name.log"
    start=$(date +%s)
    if [[ "$t" == *.sh ]]; then
        bash "$t" >"$log" 2>&1
        rc=$?
        secs=$(( $(date +%s) - start ))
        if [ $rc -eq 0 ]; then passed=$((passed + 1)); echo "PASS  $name (${secs}s)"
        elif [ $rc -eq 77 ]; then skipped=$((skipped + 1)); echo "SKIP  $name: $(tail -n 1 "$log")"
        else failed=$((failed + 1)); echo "FAIL  $name (exit $rc), last lines of $log:"; tail -n 20 "$log" | sed 's/^/      /'
        fi
        continue
    fi
    "$t" --gtest_brief=1 >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -n 1)
    f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -n 1)
    s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log" | tail -n 1)
    p=${p:-0} f=${f:-0} s=${s:-0}
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi   # crashed or exited before its summary
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
    if [ "$f" -gt 0 ]; then
        echo "FAIL  $name: $p passed, $f failed (exit $rc), last lines of $log:"
        grep -E '^\[  FAILED  \]|Failure|error' "$log" | head -n 20 | sed 's/^/      /'
        tail -n 10 "$log" | sed 's/^/      /'
    elif [ "$s" -gt 0 ]; then
        reason=$(grep -m1 -i 'skipped:' "$log" | sed 's/^ *//')
        echo "SKIP  $name: $p passed, $s skipped${reason:+ ($reason)} (${secs}s)"
    else
        echo "PASS  $name: $p passed (${secs}s)"
    fi
done

echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
