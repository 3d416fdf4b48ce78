#!/usr/bin/env bash
# The CPU reference GPT-2 against PyTorch (Debian's python3-torch, CPU) on a tiny model written to a
# model file by PyTorch: logits, loss, every gradient and the losses of 10 AdamW steps, in fp32 and
# fp64, and the model file writer/reader both ways. See test/oracles/gpt2_torch_ref.py for what is compared.
# Exit 0 pass, 1 fail, 77 skip (no PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import torch and numpy (apt-get install python3-torch python3-numpy)"
    exit 77
fi
make -s build/gpt2_cpu_dump
workdir=$(mktemp -d /tmp/gpt2_vs_torch_XXXXXX)
trap 'rm -rf "$workdir"' EXIT
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} /usr/bin/python3 test/oracles/gpt2_torch_ref.py --dump build/gpt2_cpu_dump --workdir "$workdir"
