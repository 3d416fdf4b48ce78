#!/usr/bin/env bash
# The main job for a fresh machine: build, prepare the quick-start corpus if it is missing, then train a
# small GPT-2 on it and show the validation loss falling and a sample of generated text.
#   With an NVIDIA GPU: train_gpt2cu, d6 (30M parameters), B=32 x T=512, a few minutes on one GPU;
#     validation loss every 100 steps, a text sample every 500 steps and at the end; the log and the
#     final model go to out/quickstart/ (log.jsonl, model.bin).
#   Without one: the CPU trainer train_gpt2 on a tiny model (2 layers, 64 channels) for a few minutes,
#     with the validation loss every 50 steps and a text sample at the end; model in
#     out/quickstart_cpu/model.bin.
# Knobs (environment): QUICKSTART_STEPS (GPU: 1500, CPU: 200), QUICKSTART_MODEL (GPU: d6).
set -euo pipefail
cd "$(dirname "$0")/.."
make -j"$(nproc)"
if [ ! -f data/gpt2_tokenizer.bin ] || ! ls data/quickstart_train_*.bin >/dev/null 2>&1 ||
    ! ls data/quickstart_val_*.bin >/dev/null 2>&1; then
    echo "quickstart: preparing the corpus (make data)"
    make data
fi

if nvidia-smi -L >/dev/null 2>&1; then
    echo "quickstart: GPU found ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)): training with train_gpt2cu"
    ./train_gpt2cu -e "${QUICKSTART_MODEL:-d6}" -i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' \
        -b 32 -t 512 -d 16384 -l 1.5e-3 -u 100 -k cosine -q 0.1 -c 0.1 -x "${QUICKSTART_STEPS:-1500}" \
        -v 100 -m 20 -s 500 -g 128 --temperature 0.8 --top-k 40 --log-every 20 -o out/quickstart
else
    echo "quickstart: no NVIDIA GPU found: training a tiny model on the CPU with train_gpt2 instead"
    mkdir -p out/quickstart_cpu
    ./train_gpt2 --train 'data/quickstart_train_*.bin' --val 'data/quickstart_val_*.bin' \
        --layers 2 --channels 64 --heads 2 --batch 8 --seq 64 --lr 3e-3 \
        --steps "${QUICKSTART_STEPS:-200}" --val-every 50 --val-batches 8 --out out/quickstart_cpu/model.bin \
        --gen-tokens 64 --temperature 0.8 --top-k 40
fi
