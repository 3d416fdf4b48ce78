#!/usr/bin/env bash
# Multiple-choice scoring (cpu/mc_eval_cpu.h through build/eval_mc and the CPU reference model) against
# PyTorch (Debian's python3-torch, CPU) scoring as llm.c's dev/data/hellaswag.py does, on a tiny model and
# random items written in llm.c's eval .bin layout by the script itself. See
# test/oracles/mc_eval_torch_ref.py for what is compared. Exit 0 pass, 1 fail, 77 skip (no PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import torch and numpy (apt-get install python3-torch python3-numpy)"
    exit 77
fi
make -s build/eval_mc
workdir=$(mktemp -d /tmp/mc_eval_vs_torch_XXXXXX)
trap 'rm -rf "$workdir"' EXIT
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} /usr/bin/python3 test/oracles/mc_eval_torch_ref.py --eval-mc build/eval_mc --workdir "$workdir"
