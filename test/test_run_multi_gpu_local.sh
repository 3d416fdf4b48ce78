#!/usr/bin/env bash
# scripts/run_multi_gpu.sh local NPROC: how the launcher ends, with a stand-in trainer (TRAINER=) that
# behaves as train_gpt2cu's ranks do, so no GPU is needed:
#   - every rank stops early with a checkpoint (exit 7, as on --time-limit or a signal), rank 0 last: the
#     script exits 7 (requeue and resume with -y 1), does not call it a failure and lets every rank end
#     on its own (none is killed while it finishes);
#   - one rank fails (exit 4, a bad shard): the script exits 4, names the rank, shows its log and stops
#     the other ranks (which would otherwise wait for it in a collective);
#   - the same, with ranks that behave as train_gpt2cu's do when a peer has died: one SIGTERM only asks
#     them to stop after the step, which they cannot finish while they wait for the dead rank in a
#     collective (they would sit there until their hang timeout, 15 minutes by default): the script still
#     ends within seconds, exit 4, no rank left running;
#   - a SIGTERM to the script alone reaches every rank once (they checkpoint, exit 7; so does the
#     script); one to its process group reaches them twice (or once, when the two merge while pending),
#     within the trainer's window for one request;
#   - all ranks succeed: exit 0, and the rendezvous folder is removed;
#   - an NPROC that is not a positive integer ("0", "-e", "2x") is refused with exit 2, not run as no
#     ranks at all (which exited 0 having trained nothing) or failed on an unbound variable.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_run_multi_gpu_local_XXXXXX)
trap 'pkill -f "$dir/trainer" 2>/dev/null || true; rm -rf "$dir"' EXIT

# The stand-in: MOCK=stop: wait for a 'go' file, then exit 7 after 0.3 s x (world - rank) (rank 0 last,
# as rank 0 publishes the checkpoint); a SIGTERM is recorded in DIR/killed.R. MOCK=fail1: rank 1 exits 4
# once the other ranks are ready (their SIGTERM trap set: DIR/ready.R), the others wait until they are
# stopped. MOCK=ok: exit 0. Every rank records its arguments.
cat >"$dir/trainer" <<'EOF'
#!/usr/bin/env bash
rank=-1 world=-1
args=("$@")
while [ $# -gt 0 ]; do
    case $1 in --rank) rank=$2; shift ;; --world-size) world=$2; shift ;; esac
    shift
done
echo "${args[*]}" >"$MOCK_DIR/args.$rank"
trap 'echo TERM >"$MOCK_DIR/killed.$rank"; exit 143' TERM
touch "$MOCK_DIR/ready.$rank"
case $MOCK in
    stop) sleep "$(awk -v r="$rank" -v w="$world" 'BEGIN { print 0.3 * (w - r) }')" & wait $!
          echo "rank $rank: stopped after step 5: time limit; resume with -y 1"; exit 7 ;;
    fail1) if [ "$rank" = 1 ]; then
               for r in $(seq 0 $((world - 1))); do
                   while [ ! -f "$MOCK_DIR/ready.$r" ]; do sleep 0.05; done
               done
               echo "error: bad shard 'x.bin' at offset 1024" >&2; exit 4
           fi
           sleep 30 & wait $!; exit 0 ;;
    stuck) trap 'echo TERM >>"$MOCK_DIR/termed.$rank"; [ "$(wc -l <"$MOCK_DIR/termed.$rank")" -ge 2 ] && exit 143' TERM
           if [ "$rank" = 1 ]; then
               for r in $(seq 0 $((world - 1))); do
                   while [ ! -f "$MOCK_DIR/ready.$r" ]; do sleep 0.05; done
               done
               echo "error: bad shard 'x.bin' at offset 1024" >&2; exit 4
           fi
           end=$((SECONDS + 40))  # the hang timeout, shortened
           while [ $SECONDS -lt $end ]; do sleep 0.2 & wait $!; done
           echo "rank $rank: no progress for 40 s" >>"$MOCK_DIR/hung"; exit 5 ;;
    signal) trap 'echo "$EPOCHREALTIME" >>"$MOCK_DIR/signals.$rank"; got=1' TERM  # no subshell in the trap
            got=0 end=$((SECONDS + 30))
            touch "$MOCK_DIR/waiting.$rank"
            while [ $got = 0 ] && [ $SECONDS -lt $end ]; do sleep 0.1 & wait $!; done
            [ $got = 1 ] || exit 5
            # Finishing the step and checkpointing (rank 0 last), as train_gpt2cu does on a stop signal.
            sleep "$(awk -v r="$rank" -v w="$world" 'BEGIN { print 0.3 * (w - r) + 0.2 }')" & wait $!
            echo "rank $rank: stopped after step 5: signal; resume with -y 1"; exit 7 ;;
    ok) exit 0 ;;
esac
EOF
chmod +x "$dir/trainer"
export TRAINER=$dir/trainer MOCK_DIR=$dir
fail() { echo "FAIL: $*"; cat "$dir/out"; exit 1; }
launch() {  # launch MOCK ARGS...: the script's exit code in rc, its output in $dir/out
    rm -f "$dir"/killed.* "$dir"/args.* "$dir"/ready.*
    rc=0
    MOCK=$1 timeout 60 bash scripts/run_multi_gpu.sh "${@:2}" >"$dir/out" 2>&1 || rc=$?
    # After a failure the script keeps the ranks' logs in the rendezvous folder and names it.
    local kept
    kept=$(sed -n "s|^run_multi_gpu: the ranks' logs are in \(/tmp/llmc_rendezvous_[A-Za-z0-9]*\)$|\1|p" "$dir/out")
    if [ -n "$kept" ]; then rm -rf "$kept"; fi
}

launch stop local 3 -e d12 -x 100
[ $rc -eq 7 ] || fail "all ranks stopped with a checkpoint (exit 7): the script exited $rc, not 7"
! ls "$dir"/killed.* >/dev/null 2>&1 || fail "a rank that was finishing its stop was killed: $(ls "$dir"/killed.*)"
! grep -q "failed" "$dir/out" || fail "a stop with a checkpoint was reported as a failure"
grep -q "rank 0: stopped after step 5" "$dir/out" || fail "rank 0's output was not shown"
echo "ok: every rank stopping with a checkpoint gives exit 7, no rank killed"

launch fail1 local 3 -e d12
[ $rc -eq 4 ] || fail "rank 1 exited 4: the script exited $rc, not 4"
grep -q "rank 1 failed (exit 4)" "$dir/out" || fail "the failing rank is not named"
grep -q "error: bad shard 'x.bin'" "$dir/out" || fail "the failing rank's log is not shown"
[ -f "$dir/killed.0" ] && [ -f "$dir/killed.2" ] || fail "the other ranks were not stopped"
echo "ok: a rank's failure gives its exit code, names it and stops the others"

rm -f "$dir"/termed.* "$dir/hung"
start=$SECONDS
RANK_STOP_GRACE=2 launch stuck local 3 -e d12
[ $rc -eq 4 ] || fail "rank 1 exited 4 while the others hung: the script exited $rc, not 4"
[ $((SECONDS - start)) -lt 30 ] || fail "the script waited $((SECONDS - start)) s for ranks stuck in a collective"
[ ! -f "$dir/hung" ] || fail "a rank ran on until its hang timeout: $(cat "$dir/hung")"
pgrep -f "$dir/trainer" >/dev/null && fail "ranks outlived the script: $(pgrep -af "$dir/trainer")"
grep -q "rank(s) 0 2 still running 2 s after the failure; killing them" "$dir/out" ||
    grep -q "rank(s) 2 0 still running 2 s after the failure; killing them" "$dir/out" || fail "the kill is not reported"
echo "ok: ranks stuck in a collective after a failure are ended within seconds"

launch ok local 2 -e d12 -i 'data/a b*.bin'
[ $rc -eq 0 ] || fail "all ranks succeeded: the script exited $rc"
[ "$(cat "$dir/args.1")" = "--rank 1 --world-size 2 --local-rank 1 --rendezvous $(sed 's/ -e d12.*//; s/.*--rendezvous //' "$dir/args.0") -e d12 -i data/a b*.bin" ] ||
    fail "rank 1's arguments: $(cat "$dir/args.1")"
rdv=$(sed 's/ -e d12.*//; s/.*--rendezvous //' "$dir/args.0")
[ ! -e "$rdv" ] || fail "the rendezvous folder $rdv was left behind"
echo "ok: all ranks succeeding gives exit 0, arguments passed as given"

# A stop signal sent to the script alone is passed on to each rank once; sent to its process group as well
# (Ctrl-C), each rank gets it twice, close enough together for the trainer to take them as one
# (llmc/run_control.h, kStopSignalRepeatNs: 0.5 s). Either way the ranks checkpoint and the script exits 7.
stop_by_signal() {  # stop_by_signal script|group
    rm -f "$dir"/signals.* "$dir"/waiting.*
    MOCK=signal setsid bash scripts/run_multi_gpu.sh local 3 -e d12 >"$dir/out" 2>&1 &
    local pid=$! r
    for r in 0 1 2; do
        for _ in $(seq 200); do [ -f "$dir/waiting.$r" ] && break; sleep 0.05; done
        [ -f "$dir/waiting.$r" ] || fail "rank $r did not start"
    done
    [ "$(ps -o pgid= -p "$pid" | tr -d ' ')" = "$pid" ] || fail "the script does not lead its process group"
    if [ "$1" = script ]; then kill -TERM "$pid"; else kill -TERM -- "-$pid"; fi
    rc=0
    wait "$pid" || rc=$?
}
stop_by_signal script
[ $rc -eq 7 ] || fail "SIGTERM to the script: it exited $rc, not 7"
grep -q "SIGTERM: passing it on" "$dir/out" || fail "the script did not say it passed the signal on"
for r in 0 1 2; do
    [ "$(wc -l <"$dir/signals.$r")" = 1 ] || fail "rank $r got $(wc -l <"$dir/signals.$r") signals, not 1"
done
pgrep -f "$dir/trainer" >/dev/null && fail "ranks outlived the script: $(pgrep -af "$dir/trainer")"
echo "ok: a SIGTERM to the script alone reaches every rank once; they checkpoint, exit 7"
stop_by_signal group
[ $rc -eq 7 ] || fail "SIGTERM to the process group: the script exited $rc, not 7"
# (A signal that arrives while the same one is still pending is merged with it: a rank may record one.)
apart=""
for r in 0 1 2; do
    n=$(wc -l <"$dir/signals.$r")
    [ "$n" = 1 ] || [ "$n" = 2 ] || fail "rank $r got $n signals from the group and the script, not 1 or 2"
    [ "$n" = 2 ] || continue
    apart=$(awk 'NR == 1 { a = $1 } NR == 2 { printf "%.3f", $1 - a }' "$dir/signals.$r")
    awk -v d="$apart" 'BEGIN { exit !(d < 0.25) }' ||
        fail "rank $r got the group's signal and the script's $apart s apart: too far for the trainer's 0.5 s to take them as one"
done
pgrep -f "$dir/trainer" >/dev/null && fail "ranks outlived the script: $(pgrep -af "$dir/trainer")"
echo "ok: a SIGTERM to the process group reaches every rank once or twice${apart:+ (last seen $apart s apart)}, one request to the trainer; exit 7"

for nproc in 0 -e 2x; do
    launch ok local "$nproc" -e d12
    [ $rc -eq 2 ] || fail "local '$nproc': exited $rc, not 2"
    grep -q "NPROC" "$dir/out" || fail "local '$nproc': no usage text"
    ! ls "$dir"/args.* >/dev/null 2>&1 || fail "local '$nproc' started a rank"
done
echo "ok: an NPROC that is not a positive integer is refused with exit 2"
