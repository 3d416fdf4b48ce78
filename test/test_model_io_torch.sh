#!/usr/bin/env bash
# Hugging Face folders made by PyTorch and numpy (not our code) imported by build/convert_model, the
# llm.c files and folders it writes parsed back with numpy, and the CPU reference model's loss on an
# imported folder against PyTorch's, and build/convert_model's refusals of bad input (exit code and
# message). See test/oracles/model_io_torch.py for what is compared.
# Exit 0 pass, 1 fail, 77 skip (no PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import torch and numpy (apt-get install python3-torch python3-numpy)"
    exit 77
fi
make -s build/convert_model build/gpt2_cpu_dump
workdir=$(mktemp -d /tmp/model_io_torch_XXXXXX)
trap 'rm -rf "$workdir"' EXIT
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} /usr/bin/python3 test/oracles/model_io_torch.py --convert build/convert_model \
    --dump build/gpt2_cpu_dump --workdir "$workdir"
