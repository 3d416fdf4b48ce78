#!/usr/bin/env bash
# The two trainers read the same batches for the same flags (the shared DataLoader, shuffled by --seed)
# and start from the same weights for the same seed: with the learning rate at 0 each step's loss is
# the model's loss on that step's batch, so train_gpt2cu's (bf16) and train_gpt2's (fp32) per-step
# losses must agree to bf16 accuracy (1%). A model trained a little on the CPU first makes the losses of
# different batches differ by much more than that accuracy, so a different batch order would show: a
# CPU run with another --seed must not agree. Also the first loss of a fresh d2 (same initialisation),
# and the validation loss of the same model.
# Needs a GPU and the quick-start corpus (data/quickstart_*.bin, real text whose batches differ).
# Exit 0 pass, 1 fail, 77 skip.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then echo "skipped: no NVIDIA GPU"; exit 77; fi
if ! ls data/quickstart_train_*.bin >/dev/null 2>&1 || ! ls data/quickstart_val_*.bin >/dev/null 2>&1; then
    echo "skipped: the quick-start corpus is not prepared (make data)"; exit 77
fi
make -s train_gpt2 train_gpt2cu
dir=$(mktemp -d /tmp/train_cpu_vs_gpu_XXXXXX)
trap 'rm -rf "$dir"' EXIT

data=(-i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' -b 4 -t 64)
# A d2 trained for 60 steps on the CPU: its losses now depend on the text of each batch.
./train_gpt2 "${data[@]}" -e d2 -x 60 -l 3e-3 -v 0 -g 0 --seed 5 -o "$dir/base" >/dev/null
frozen=("${data[@]}" -e "$dir/base/model.bin" -l 0 -c 0 -x 12 -v 12 -m 8 -s 0 --seed 11)
./train_gpt2cu "${frozen[@]}" -o "$dir/gpu" --save-model 0 >"$dir/log_gpu"
./train_gpt2 "${frozen[@]}" -o "$dir/cpu" --save-model none >"$dir/log_cpu"
./train_gpt2 "${frozen[@]}" -o "$dir/cpu_other" --save-model none --seed 12 >/dev/null
# A fresh d2 from the same seed: the same initial weights, so the same first loss.
./train_gpt2cu "${data[@]}" -e d2 -x 1 -v 0 -s 0 --seed 3 -o "$dir/gpu_init" --save-model 0 >/dev/null
./train_gpt2 "${data[@]}" -e d2 -x 1 -v 0 --seed 3 -o "$dir/cpu_init" --save-model none >/dev/null

python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def recs(run): return [json.loads(l) for l in open("%s/%s/log.jsonl" % (d, run))]
def losses(run): return [r["loss"] for r in recs(run) if "loss" in r]
def val(run): return [r["val_loss"] for r in recs(run) if "val_loss" in r]
gpu, cpu, other = losses("gpu"), losses("cpu"), losses("cpu_other")
ok = True
for name, l in (("gpu", gpu), ("cpu", cpu), ("cpu_other", other)):
    if len(l) != 12: print("FAIL: %s logged %d steps, expected 12" % (name, len(l))); sys.exit(1)
# bf16 weights and activations: the GPU model's losses lie within 1% of the fp32 reference's (the model
# tests measure 0.15-0.6% on d2).
tol = 0.01 * max(cpu)
spread = max(cpu) - min(cpu)
print("per-step losses (lr 0), CPU: %s" % " ".join("%.4f" % x for x in cpu))
print("                         GPU: %s" % " ".join("%.4f" % x for x in gpu))
print("      CPU with another seed: %s" % " ".join("%.4f" % x for x in other))
worst = max(abs(a - b) for a, b in zip(cpu, gpu))
print("largest CPU-GPU difference %.4f (bound %.3f); spread of the batch losses %.3f" % (worst, tol, spread))
if spread < 5 * tol: print("FAIL: the batches' losses differ too little (%.3f) to tell batches apart" % spread); ok = False
if worst > tol: print("FAIL: the trainers' per-step losses differ: not the same batches, or not the same model"); ok = False
if max(abs(a - b) for a, b in zip(cpu, other)) <= tol:
    print("FAIL: another --seed gives the same losses: the comparison cannot see the batch order"); ok = False
vg, vc = val("gpu"), val("cpu")
print("validation loss: CPU %s, GPU %s" % (vc, vg))
if len(vg) != 2 or len(vc) != 2 or max(abs(a - b) for a, b in zip(vc, vg)) > tol:
    print("FAIL: validation losses differ"); ok = False
gi, ci = losses("gpu_init")[0], losses("cpu_init")[0]
print("first loss of a fresh d2 (seed 3): CPU %.5f, GPU %.5f" % (ci, gi))
if abs(gi - ci) > tol: print("FAIL: fresh models from the same seed give different first losses"); ok = False
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
