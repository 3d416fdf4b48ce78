#!/usr/bin/env bash
# dev/gpu_runs.sh checks its section names before it runs anything (no GPU needed): a misspelt one, or
# none, exits 2 naming the known ones; and its list of sections is exactly the sections its case handles,
# so that the check cannot refuse a real section or pass one that would only print "unknown".
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp /tmp/test_gpu_runs_XXXXXX)
trap 'rm -f "$out"' EXIT
rc=0; LOGS=/nonexistent/logs bash dev/gpu_runs.sh build trhoughput >"$out" 2>&1 || rc=$?
[ $rc -eq 2 ] && grep -q "unknown section 'trhoughput'" "$out" && grep -q "fp8-throughput" "$out" ||
    { echo "FAIL: a misspelt section gave exit $rc:"; cat "$out"; exit 1; }
rc=0; bash dev/gpu_runs.sh >"$out" 2>&1 || rc=$?
[ $rc -eq 2 ] && grep -q "usage:" "$out" || { echo "FAIL: no section gave exit $rc:"; cat "$out"; exit 1; }
listed=$(sed -n '/^sections="/,/"$/p' dev/gpu_runs.sh | tr -d '"' | sed 's/^sections=//' | tr -s ' \n' '\n' | grep . | sort)
handled=$(grep -oE '^        [a-z0-9|-]+\)' dev/gpu_runs.sh | tr -d ' )' | tr '|' '\n' | sort)
[ "$listed" = "$handled" ] || { echo "FAIL: listed and handled sections differ:"; diff <(echo "$listed") <(echo "$handled"); exit 1; }
echo "ok: $(echo "$listed" | wc -l) sections, a misspelt one refused before anything runs"
