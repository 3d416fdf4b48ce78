#!/usr/bin/env bash
# dev/multi_gpu_runs.sh N refuses an N that is not a whole number of at least 2 (exit 2, before building,
# creating its log folder or starting a trainer): its runs compare 2 ranks with 1 from the start and kill
# rank 1 in part 4, so N=1 would start two ranks on one GPU and end on an unbound rank 1. Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_multi_gpu_runs_args_XXXXXX)
trap 'rm -rf "$dir"' EXIT
printf '#!/usr/bin/env bash\necho "$@" >>%q\nexit 1\n' "$dir/calls" >"$dir/trainer"
chmod +x "$dir/trainer"
for n in 1 0 two 2x; do
    rc=0
    LOGS=$dir/logs TRAINER=$dir/trainer bash dev/multi_gpu_runs.sh "$n" >"$dir/out" 2>&1 || rc=$?
    if [ $rc -ne 2 ] || ! grep -q "at least 2" "$dir/out" || [ -e "$dir/calls" ] || [ -e "$dir/logs" ]; then
        echo "FAIL: multi_gpu_runs.sh '$n' exited $rc (expected 2 with a usage line, nothing run):"
        cat "$dir/out"; [ ! -e "$dir/calls" ] || { echo "trainer calls:"; cat "$dir/calls"; }
        exit 1
    fi
done
echo "ok: N = 1, 0, two, 2x refused with exit 2"
