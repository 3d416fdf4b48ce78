#!/usr/bin/env bash
# A Slurm job that survives preemption and time limits: Slurm sends SIGUSR1 two minutes before the end
# (--signal), train_gpt2cu finishes its step, writes a checkpoint and exits with code 7; the job then
# requeues itself, and the next start resumes from the newest valid checkpoint (-y 1). A run that
# finishes exits 0 and is not requeued; any other exit code (6: diverged, 2: bad flags, ...) stops.
# Submit with:  mkdir -p out && sbatch scripts/slurm_train.sh   (edit the #SBATCH lines and the flags for your
# cluster; Slurm does not create the folder of --output, and a job whose log cannot be opened fails unseen)
#SBATCH --job-name=gpt2-124M
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=out/slurm_%j.log
set -uo pipefail
OUT=${OUT:-out/gpt2_124M}
rc=0
srun ./train_gpt2cu -e d12 -i 'data/fineweb_train_*.bin' -j 'data/fineweb_val_*.bin' \
    -b 64 -t 1024 -d 524288 -l 6e-4 -u 700 -q 0.0 -c 0.1 -x 18865 -v 250 -s 5000 \
    -n 1000 -nk 3 -y 1 -o "$OUT" || rc=$?
if [ "$rc" -eq 7 ]; then
    echo "slurm_train: stopped early with a checkpoint (exit 7); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
