#!/usr/bin/env bash
# The main job for a fresh machine: build the one trainer it needs, prepare the quick-start corpus if it
# is missing, then train a small GPT-2 on it and show the validation loss falling and samples of text.
#   With an NVIDIA GPU: train_gpt2cu, d6 (30M parameters), B=32 x T=512, a few minutes on one GPU;
#     validation loss every 100 steps, held-out multiple-choice accuracy every 250 steps (4 choices:
#     25% is chance), a text sample every 500 steps and at the end; the log, the final model and a plot
#     go to out/quickstart/ (log.jsonl, model.bin, loss.png).
#   Without one: the CPU trainer train_gpt2 on a tiny model (4 layers, 64 channels, 3.5M parameters, most
#     of them the token embedding) for 250 steps of 8 x 64 tokens with warmup and cosine decay: about two
#     minutes on two cores; validation loss every 100 steps, a text sample halfway and at the end, the
#     multiple-choice accuracy on 100 items at the end; the log, the model and a plot go to
#     out/quickstart_cpu/.
#   QUICKSTART_FROM=DIR_OR_FILE fine-tunes a released model instead of training from scratch: a Hugging
#     Face GPT-2 folder (e.g. `huggingface-cli download gpt2 --local-dir gpt2` on a machine with internet)
#     or an llm.c model file, at learning rate 1e-4 with a text sample halfway and at the end (on the
#     GPU also the accuracy before, halfway and at the end; the trainers sample only after a step):
#     GPU B=16 x T=1024 for 300 steps, CPU B=4 x T=64 for 40 steps (GPT-2 124M: ~6 s a step on two
#     cores); the output goes to out/finetune/ or out/finetune_cpu/.
# On a GPU a run stopped by Ctrl-C (the trainer checkpoints and exits) continues where it stopped when the
# script is run again (-y 1); once a run has finished, the checkpoint it was resumed from is removed, so
# the next one starts afresh.
# Knobs (environment): QUICKSTART_STEPS (GPU: 1500, CPU: 250; fine-tuning: 300, 40), QUICKSTART_MODEL
# (GPU: d6), QUICKSTART_FROM.
set -euo pipefail
cd "$(dirname "$0")/.."

if nvidia-smi -L >/dev/null 2>&1; then gpu=1; else gpu=0; fi
if [ $gpu -eq 1 ]; then trainer=train_gpt2cu; else trainer=train_gpt2; fi
echo "quickstart: building $trainer"
make -j"$(nproc)" "$trainer"
if [ ! -f data/gpt2_tokenizer.bin ] || [ ! -f data/quickstart_mc.bin ] || ! ls data/quickstart_train_*.bin >/dev/null 2>&1 ||
    ! ls data/quickstart_val_*.bin >/dev/null 2>&1; then
    echo "quickstart: preparing the corpus (make data)"
    make -j"$(nproc)" data
fi

from=${QUICKSTART_FROM:-}
if [ -n "$from" ] && [ ! -e "$from" ]; then
    echo "quickstart: QUICKSTART_FROM=$from does not exist (a Hugging Face GPT-2 folder or an llm.c model file)" >&2
    exit 2
fi
if [ -n "$from" ] && [ $gpu -eq 1 ]; then
    echo "quickstart: fine-tuning $from on the GPU with train_gpt2cu"
    ./train_gpt2cu -e "$from" -i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' -b 16 -t 1024 \
        -l 1e-4 -u 20 -k cosine -q 0.1 -c 0.0 -x "${QUICKSTART_STEPS:-300}" -v 50 -m 20 -s 150 -g 128 \
        --temperature 0.8 --top-k 40 --log-every 10 -y 1 -o out/finetune --eval data/quickstart_mc.bin --eval-every 150
    out=out/finetune
    rm -rf out/finetune/ckpt_*
elif [ -n "$from" ]; then
    echo "quickstart: fine-tuning $from on the CPU with train_gpt2 (no NVIDIA GPU found)"
    steps=${QUICKSTART_STEPS:-40}
    ./train_gpt2 -e "$from" -i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' -b 4 -t 64 \
        -l 1e-4 -u 0 -c 0.0 -x "$steps" -v 20 -m 5 -s 20 -g 64 --temperature 0.8 --top-k 40 \
        --log-every 1 -o out/finetune_cpu
    out=out/finetune_cpu
elif [ $gpu -eq 1 ]; then
    echo "quickstart: GPU found ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)): training with train_gpt2cu"
    ./train_gpt2cu -e "${QUICKSTART_MODEL:-d6}" -i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' \
        -b 32 -t 512 -d 16384 -l 1.5e-3 -u 100 -k cosine -q 0.1 -c 0.1 -x "${QUICKSTART_STEPS:-1500}" \
        -v 100 -m 20 -s 500 -g 128 --temperature 0.8 --top-k 40 --log-every 20 -y 1 -o out/quickstart \
        --eval data/quickstart_mc.bin --eval-every 250
    out=out/quickstart
    rm -rf out/quickstart/ckpt_*  # finished: what it was resumed from is of no more use
else
    echo "quickstart: no NVIDIA GPU found: training a tiny model on the CPU with train_gpt2 instead"
    steps=${QUICKSTART_STEPS:-250}
    half=$(( steps / 2 > 0 ? steps / 2 : 1 ))
    ./train_gpt2 -i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' --layers 4 --channels 64 --heads 4 \
        -b 8 -t 64 -l 3e-3 -u 20 -k cosine -q 0.1 -c 0.1 -x "$steps" -v 100 -m 20 -s "$half" -g 64 \
        --temperature 0.8 --top-k 40 --log-every 10 -o out/quickstart_cpu \
        --eval data/quickstart_mc.bin --eval-every 0 --eval-max-items 100
    out=out/quickstart_cpu
fi
# Debian's python3 (where apt installs matplotlib), not another python3 that may come first on the PATH.
py=/usr/bin/python3
[ -x "$py" ] || py=python3
if "$py" -c "import matplotlib" 2>/dev/null; then
    "$py" scripts/plot.py "$out" -o "$out/loss.png" >/dev/null
    echo "quickstart: the loss, learning rate, gradient norm, speed and accuracy are plotted in $out/loss.png"
else
    echo "quickstart: no plot (python3 cannot import matplotlib: apt-get install python3-matplotlib)"
fi
