# Shared by the test scripts (sourced, not run; the runner only picks up test_*.sh).
# expect_exit CODE MESSAGE-FRAGMENT ARGS...: runs "${expect_bin[@]}" ARGS (the script sets expect_bin, e.g.
# (./train_gpt2cu)) and fails the test unless it exits with CODE and its output contains the fragment.
# Output goes to $dir/out.
expect_exit() {
    local code=$1 fragment=$2 rc=0
    shift 2
    "${expect_bin[@]}" "$@" >"$dir/out" 2>&1 || rc=$?
    if [ $rc -ne "$code" ] || ! grep -q -- "$fragment" "$dir/out"; then
        echo "FAIL: ${expect_bin[-1]} $* exited $rc (expected $code with '$fragment'):"; cat "$dir/out"; exit 1
    fi
}
