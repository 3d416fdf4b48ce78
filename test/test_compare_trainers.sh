#!/usr/bin/env bash
# dev/compare_trainers.sh with two stand-in trainers (no GPU needed), in a scratch copy of the script
# beside an empty quick-start shard so that the repository's data/ is neither needed nor touched:
#   - both stand-ins write the same numbers and files: every scenario PASSes, exit 0;
#   - the new one fails (exit 5, as out of memory) in the d12 scenario only: that scenario FAILs naming
#     the failed run, the d6 scenarios still PASS (a failed run is charged to its own scenario, not to
#     whichever is compared first), exit 1;
#   - the new one writes another loss at step 3 of every run: every scenario FAILs on the log numbers;
#   - the new one writes a checkpoint the old one does not: every scenario FAILs naming it (only the old
#     run's files were looked for in the new one's folder, so an extra file passed unseen).
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_compare_trainers_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/tree/dev" "$dir/tree/data"
cp dev/compare_trainers.sh "$dir/tree/dev/"
: >"$dir/tree/data/quickstart_train_000000.bin"

# The stand-in: writes OUT/log.jsonl (5 steps and a validation) and OUT/model.bin; FAIL_D12=1 exits 5 for
# -e d12 before writing anything; LOSS3 changes the loss of step 3.
cat >"$dir/trainer" <<'EOF'
#!/usr/bin/env bash
out="" model=""
while [ $# -gt 0 ]; do
    case $1 in -o) out=$2; shift ;; -e) model=$2; shift ;; esac
    shift
done
if [ "${FAIL_D12:-0}" = 1 ] && [ "$model" = d12 ]; then echo "error: cudaMalloc of 40 GiB failed" >&2; exit 5; fi
mkdir -p "$out"
for s in 1 2 3 4 5; do
    loss=$((11 - s)).5
    [ $s = 3 ] && loss=${LOSS3:-$loss}
    echo "{\"step\":$s,\"loss\":$loss,\"norm\":1.25}" >>"$out/log.jsonl"
done
echo '{"step":5,"val_loss":6.25}' >>"$out/log.jsonl"
echo "$model" >"$out/model.bin"
if [ "${EXTRA:-0}" = 1 ]; then mkdir -p "$out/ckpt_00000003" && echo 1 >"$out/ckpt_00000003/adam_m.bin"; fi
EOF
chmod +x "$dir/trainer"
printf '#!/usr/bin/env bash\nexec %q "$@"\n' "$dir/trainer" >"$dir/old"
printf '#!/usr/bin/env bash\nFAIL_D12=1 exec %q "$@"\n' "$dir/trainer" >"$dir/new_oom"
printf '#!/usr/bin/env bash\nLOSS3=8.25 exec %q "$@"\n' "$dir/trainer" >"$dir/new_loss"
printf '#!/usr/bin/env bash\nEXTRA=1 exec %q "$@"\n' "$dir/trainer" >"$dir/new_extra"
chmod +x "$dir/old" "$dir/new_oom" "$dir/new_loss" "$dir/new_extra"

compare() {  # compare NEW: the script's output in $dir/out, its exit code in rc
    rc=0
    bash "$dir/tree/dev/compare_trainers.sh" "$dir/old" "$dir/$1" >"$dir/out" 2>&1 || rc=$?
}
fail() { echo "FAIL: $*"; cat "$dir/out"; exit 1; }

compare old
[ $rc -eq 0 ] || fail "the same trainer twice exited $rc"
[ "$(grep -c '^PASS' "$dir/out")" = 4 ] || fail "the same trainer twice: not 4 PASS lines"
echo "ok: the same trainer twice passes every scenario"

compare new_oom
[ $rc -eq 1 ] || fail "a failed d12 run exited $rc, not 1"
for s in d6-ckpt d6-resume d6-zero1; do
    grep -q "^PASS $s:" "$dir/out" || fail "scenario $s was charged with another scenario's failed run"
done
grep -q "^FAIL d12-accum: a run failed: .*new_oom .*-e d12.* exited 5" "$dir/out" ||
    fail "the d12 scenario does not name its failed run"
echo "ok: a failed run fails its own scenario only, naming it"

compare new_loss
[ $rc -eq 1 ] || fail "another loss exited $rc, not 1"
[ "$(grep -c '^FAIL .*log numbers differ' "$dir/out")" = 4 ] || fail "another loss at step 3: not 4 FAIL lines"
echo "ok: another loss fails every scenario"

compare new_extra
[ $rc -eq 1 ] || fail "an extra checkpoint in the new runs exited $rc, not 1"
[ "$(grep -c '^FAIL .*ckpt_00000003/adam_m.bin (new only)' "$dir/out")" = 4 ] || fail "an extra checkpoint: not 4 FAIL lines naming it"
echo "ok: a file only the new build writes fails every scenario"
