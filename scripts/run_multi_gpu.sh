#!/usr/bin/env bash
# Launch recipes for data-parallel training with train_gpt2cu on several GPUs (NCCL). Every rank runs
# the same command; rank 0 alone prints and writes the model file. A rank uses the GPU of its local
# rank, or the only GPU it sees.
#
#   scripts/run_multi_gpu.sh mpirun NPROC [trainer flags...]
#       one node, NPROC ranks started by OpenMPI's mpirun; the ranks meet in /tmp (no flag needed).
#   scripts/run_multi_gpu.sh mpiexec NPROC [trainer flags...]
#       the same with MPICH's or Intel MPI's mpiexec (Hydra; MVAPICH's works too).
#   scripts/run_multi_gpu.sh local NPROC [trainer flags...]
#       one node without MPI: NPROC background processes with explicit --rank/--world-size/--local-rank,
#       meeting in a fresh directory under /tmp; the script waits for all and exits with the first
#       failing rank's code (7 when the ranks stopped early with a checkpoint: resume with -y 1). A stop
#       signal (TERM, INT, USR1) to the script is passed on to the ranks.
#   scripts/run_multi_gpu.sh slurm-file DIR [trainer flags...]
#       inside a Slurm allocation (sbatch or salloc): srun starts one rank per task; the ranks meet in
#       DIR, which every node must see (NFS, Lustre, ...).
#   scripts/run_multi_gpu.sh slurm-tcp PORT [trainer flags...]
#       inside a Slurm allocation: the ranks meet over TCP at the first node of the allocation, PORT.
#
# A batch file for two nodes of 8 GPUs, for example:
#   #!/bin/bash
#   #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 --time=24:00:00
#   scripts/run_multi_gpu.sh slurm-tcp 29500 -e d12 -i 'data/fineweb_train_*.bin' -j 'data/fineweb_val_*.bin' \
#       -b 64 -t 1024 -d 1048576 -o out/d12
#
# Other launchers need no recipe: torchrun-style ones (torchrun --nproc-per-node 8 --no-python
# ./train_gpt2cu ...) set RANK/WORLD_SIZE/LOCAL_RANK, which the trainer reads; a launcher that shows each
# rank only its own GPU (srun --gpus-per-task=1, --gpu-bind, a per-rank CUDA_VISIBLE_DEVICES) is fine.
# Over several nodes every launcher needs --rendezvous (tcp://HOST:PORT or a shared DIR).
#
# Knobs (environment): TRAINER (default ./train_gpt2cu), DRY_RUN=1 prints the command instead of running it,
# RANK_STOP_GRACE (local: seconds the other ranks get to end after one fails before they are killed; 60).
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is exported to every rank.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}
[ $# -ge 2 ] || usage
mode=$1 arg=$2
shift 2
trainer=${TRAINER:-./train_gpt2cu}
export NCCL_NVLS_ENABLE=0

run() {
    if [ "${DRY_RUN:-0}" = 1 ]; then
        printf 'NCCL_NVLS_ENABLE=%s' "$NCCL_NVLS_ENABLE"
        printf ' %q' "$@"
        printf '\n'
    else
        echo "run_multi_gpu: $*" >&2
        "$@"
    fi
}

case "$mode" in
    mpirun)
        root=()
        [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
        # --bind-to none: each rank feeds its GPU from several threads (data loading, checkpoint writes).
        run mpirun "${root[@]}" -np "$arg" --bind-to none -x NCCL_NVLS_ENABLE "$trainer" "$@"
        ;;
    mpiexec)
        run mpiexec -n "$arg" -genv NCCL_NVLS_ENABLE "$NCCL_NVLS_ENABLE" "$trainer" "$@"
        ;;
    local)
        # A typo here would otherwise start no rank at all and exit 0 (or fail on an unbound variable).
        [[ "$arg" =~ ^[1-9][0-9]*$ ]] || { echo "run_multi_gpu: local NPROC: '$arg' is not a positive integer" >&2; usage; }
        [[ "${RANK_STOP_GRACE:-60}" =~ ^[0-9]+$ ]] ||
            { echo "run_multi_gpu: RANK_STOP_GRACE='$RANK_STOP_GRACE' is not a number of seconds" >&2; exit 2; }
        rdv=$(mktemp -d /tmp/llmc_rendezvous_XXXXXX)
        if [ "${DRY_RUN:-0}" = 1 ]; then
            for ((r = 0; r < arg; r++)); do
                run "$trainer" --rank "$r" --world-size "$arg" --local-rank "$r" --rendezvous "$rdv" "$@"
            done
            rmdir "$rdv"
            exit 0
        fi
        declare -A rank_of=()
        # A stop signal sent to the script alone (kill PID, a service manager's stop, a scheduler's warning
        # signal to the batch script) is passed on to every rank, which checkpoints and exits 7 as on its
        # own signal. A rank that also got it from its process group (Ctrl-C) takes the two as one (they
        # come within the trainer's 0.5 s); a second signal later ends the ranks at once, as it ends one
        # trainer.
        signalled=""
        pass_on() {
            signalled=$1
            echo "run_multi_gpu: SIG$1: passing it on to rank(s) ${rank_of[*]}" >&2
            kill -s "$1" "${!rank_of[@]}" 2>/dev/null || true
        }
        trap 'pass_on TERM' TERM
        trap 'pass_on INT' INT
        trap 'pass_on USR1' USR1
        for ((r = 0; r < arg; r++)); do
            if [ "$r" = 0 ]; then
                "$trainer" --rank 0 --world-size "$arg" --local-rank 0 --rendezvous "$rdv" "$@" &
            else
                # Only rank 0 prints; the others' output is kept in case they fail.
                "$trainer" --rank "$r" --world-size "$arg" --local-rank "$r" --rendezvous "$rdv" "$@" \
                    >"$rdv/rank$r.log" 2>&1 &
            fi
            rank_of[$!]=$r
        done
        # The script exits with the trainer's code (README, "Exit codes"), so that a job script can tell a
        # stop to requeue (7) from a failure. Exit 7 is every rank's: they agree to stop after the same
        # step and pass a barrier once the checkpoint is published, so the others are left to end on their
        # own (a signal now would cut their exit short). The first rank to fail otherwise stops the others:
        # they would wait for it in a collective until their hang timeout (NCCL does not notice a dead
        # peer on one node). A SIGTERM alone does not end them there (a rank that gets one finishes its
        # step, which waits for the failed rank), but it lets a rank that is not stuck end on its own,
        # e.g. finish writing a checkpoint; those still running after RANK_STOP_GRACE seconds are killed.
        status=0 grace=""
        while [ ${#rank_of[@]} -gt 0 ]; do
            done_pid="" rc=0
            wait -n -p done_pid "${!rank_of[@]}" ${grace:+"$grace"} 2>/dev/null || rc=$?
            if [ -z "${done_pid:-}" ]; then
                if [ -n "$signalled" ]; then signalled="" && continue; fi  # a signal cut the wait short
                break  # bash has already reaped the rest
            fi
            if [ "$done_pid" = "$grace" ]; then  # (not yet reaped, their pids cannot have been reused)
                grace=""
                echo "run_multi_gpu: rank(s) ${rank_of[*]} still running ${RANK_STOP_GRACE:-60} s after the failure; killing them" >&2
                kill -KILL "${!rank_of[@]}" 2>/dev/null || true
                continue
            fi
            r=${rank_of[$done_pid]}
            unset "rank_of[$done_pid]"
            if [ $rc -eq 7 ] && [ $status = 0 ]; then
                status=7
            elif [ $rc -ne 0 ] && [ $rc -ne 7 ] && { [ $status = 0 ] || [ $status = 7 ]; }; then
                status=$rc
                echo "run_multi_gpu: rank $r failed (exit $rc); stopping the other ranks" >&2
                if [ "$r" != 0 ]; then tail -n 20 "$rdv/rank$r.log" >&2; fi
                if [ ${#rank_of[@]} -gt 0 ]; then
                    kill "${!rank_of[@]}" 2>/dev/null || true
                    sleep "${RANK_STOP_GRACE:-60}" &
                    grace=$!
                fi
            fi
        done
        if [ -n "$grace" ]; then kill "$grace" 2>/dev/null || true; wait "$grace" 2>/dev/null || true; fi
        while ! wait; do :; done  # the ranks stopped above, so that none outlives the script (a signal
                                  # cuts a wait short)
        if [ $status = 0 ] || [ $status = 7 ]; then rm -rf "$rdv"; else echo "run_multi_gpu: the ranks' logs are in $rdv" >&2; fi
        exit $status
        ;;
    slurm-file)
        mkdir -p "$arg"
        run srun --kill-on-bad-exit=1 --export=ALL "$trainer" --rendezvous "file:$arg" "$@"
        ;;
    slurm-tcp)
        : "${SLURM_JOB_NODELIST:?slurm-tcp runs inside a Slurm allocation (sbatch or salloc)}"
        # Rank 0 runs on the first node of the allocation (srun's default block distribution).
        host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        run srun --kill-on-bad-exit=1 --export=ALL "$trainer" --rendezvous "tcp://$host:$arg" "$@"
        ;;
    *)
        usage
        ;;
esac
