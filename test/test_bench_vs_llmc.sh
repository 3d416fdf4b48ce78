#!/usr/bin/env bash
# dev/bench_vs_llmc.sh with a stand-in trainer, llm.c peer and nvidia-smi (no GPU needed): it leaves steps
# 1-10 out of our median, takes the median over rounds of both, prints the speed-up over llm.c from them,
# passes each --fp8 mode to the trainer, and stops with a message on bad settings, a failing trainer, a
# peer that prints no timing and a machine without a GPU. Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_bench_vs_llmc_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/bin" "$dir/peer"
fail() { echo "FAIL: $*"; [ ! -f "$dir/out" ] || cat "$dir/out"; exit 1; }

# The trainer: steps 1-10 at 500 ms (warm-up, to be left out), then 100 and 102 ms in turn (median 101)
# with --fp8 0, 80 ms with any other mode; every call's arguments go to calls.
cat >"$dir/trainer" <<EOS
#!/usr/bin/env bash
echo "\$*" >>"$dir/calls"
mode=\${@: -1}
[ "\$mode" != broken ] || { echo "cudaMalloc failed" >&2; exit 3; }
steps=0; while [ \$# -gt 0 ]; do [ "\$1" = -x ] && steps=\$2; shift; done
for i in \$(seq 1 \$steps); do
    if [ \$i -le 10 ]; then ms=500.00; elif [ "\$mode" = 0 ]; then ms=\$((100 + 2 * (i % 2))).00; else ms=80.00; fi
    echo "step \$i/\$steps | loss 9.9 | lr 6.00e-04 | norm 1.0 | \$ms ms | 1000 tok/s | MFU 1.0% | ETA 1s"
done
echo "step \$steps/\$steps | val loss 9.8"
EOS
# The peer: 120 ms in its first call, 124 in the next (median 122); SILENT=1: no timing line.
cat >"$dir/peer/bench_llmc.sh" <<EOS
n=\$(cat "$dir/peer_calls" 2>/dev/null || echo 0); echo \$((n + 1)) >"$dir/peer_calls"
[ -z "\${SILENT:-}" ] || exit 0
echo "LLMC B=\$1 ms_per_step=\$((120 + 4 * n)).00 tok_per_s=1 (median of 30 steps after 10)"
EOS
printf '#!/bin/sh\n[ -z "$NO_GPU" ] || exit 9\necho "Stand-in GPU, 1.0, 700.00 W"\n' >"$dir/bin/nvidia-smi"
chmod +x "$dir/trainer" "$dir/bin/nvidia-smi"
run() { PATH="$dir/bin:$PATH" NO_GPU=${NO_GPU:-} TRAINER=$dir/trainer LLMC_PEER=$dir/peer LOGS=$dir/logs \
        bash dev/bench_vs_llmc.sh >"$dir/out" 2>&1; }

rc=0; ROUNDS=2 MODES="0 fp8x" run || rc=$?
[ $rc -eq 0 ] || fail "exit $rc on a good run"
grep -Eq '^llm\.c +122\.00 +537180 +1\.000x +120\.00 124\.00$' "$dir/out" || fail "llm.c's row"
grep -Eq '^ours --fp8 0 +101\.00 +648871 +1\.208x +101\.00 101\.00$' "$dir/out" || fail "bf16's row (steps 1-10 left out?)"
grep -Eq '^ours --fp8 fp8x +80\.00 +819200 +1\.525x +80\.00 80\.00$' "$dir/out" || fail "fp8x's row"
grep -q '^GPU: Stand-in GPU' "$dir/out" || fail "no GPU line"
[ "$(wc -l <"$dir/calls")" -eq 4 ] || fail "expected 4 trainer runs, got $(wc -l <"$dir/calls")"
grep -q -- '-e d12 -b 64 -t 1024 -x 40 .*--fp8 0$' "$dir/calls" || fail "trainer arguments: $(cat "$dir/calls")"
grep -q -- '--fp8 fp8x$' "$dir/calls" || fail "the second mode never reached the trainer"
echo "ok: medians, speed-ups and the trainer's arguments"

expect_error() {  # expect_error RC TEXT: the last run exited RC and said TEXT
    [ "$rc" -eq "$1" ] && grep -qF "$2" "$dir/out" || fail "expected exit $1 with '$2', got $rc"
}
rc=0; ROUNDS=two run || rc=$?; expect_error 2 "ROUNDS must be a positive whole number"
rc=0; B=0 run || rc=$?; expect_error 2 "B must be a positive whole number"
rc=0; NO_GPU=1 run || rc=$?; expect_error 2 "found no GPU"
rc=0; MODES="0 broken" run || rc=$?; expect_error 1 "our trainer failed (--fp8 broken, round 1)"
grep -q "cudaMalloc failed" "$dir/out" || fail "the failing trainer's log was not shown"
rc=0; SILENT=1 ROUNDS=1 MODES=0 run || rc=$?; expect_error 1 "llm.c printed no timing in round 1"
rc=0; PATH="$dir/bin:$PATH" TRAINER=$dir/trainer bash dev/bench_vs_llmc.sh >"$dir/out" 2>&1 || rc=$?
[ $rc -eq 2 ] && grep -q "set LLMC_PEER" "$dir/out" || fail "no LLMC_PEER: exit $rc"
echo "ok: bad settings, no GPU, a failing trainer, a silent peer and no peer are refused with a message"
