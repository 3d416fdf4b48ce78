#!/usr/bin/env bash
# Hugging Face folders and llm.c files through the GPU trainer (train_gpt2cu), on synthetic shards and d2:
#   - --save-model llmc,llmc-bf16,hf,hf-bf16 writes model.bin (llm.c v3), model_bf16.bin (v5), hf/ and
#     hf_bf16/ (config.json + model.safetensors);
#   - the trainer re-reads each export (-e DIR -x 0) with the validation loss of the llm.c file of the same
#     precision, to the bit; build/convert_model turns hf/ back into model.bin byte for byte;
#   - fine-tuning from an imported folder checkpoints and resumes like any other run: a 20-step run from
#     hf/ and a run resumed from its step-10 checkpoint (-y 1) have bitwise identical losses and norms
#     for steps 11..20 and byte-identical final model.bin files.
# Exit 0 pass, 1 fail, 77 skip (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then echo "skipped: no NVIDIA GPU"; exit 77; fi
make -s train_gpt2cu build/convert_model
dir=$(mktemp -d /tmp/hf_trainer_XXXXXX)
trap 'rm -rf "$dir"' EXIT
trainer() { timeout -k 10 180 ./train_gpt2cu "$@"; }
python3 test/make_synthetic_shards.py "$dir" syn_train=4000,4000 syn_val=3000
data=(-i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -m 4 -s 0)
val_loss() {  # the last validation loss in a run's log.jsonl, as written (9 significant digits)
    python3 -c 'import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if "val_loss" in r][-1]["val_loss"])' "$1"
}
fail() { echo "FAIL: $*"; exit 1; }

trainer -e d2 "${data[@]}" -x 20 -l 3e-3 -v 10 --save-model llmc,llmc-bf16,hf,hf-bf16 -o "$dir/base" >"$dir/base.out" 2>&1 ||
    { cat "$dir/base.out"; fail "the d2 run that exports"; }
for f in model.bin model_bf16.bin hf/config.json hf/model.safetensors hf_bf16/config.json hf_bf16/model.safetensors; do
    [ -f "$dir/base/$f" ] || fail "--save-model did not write $f"
done
version() { python3 -c 'import struct,sys; print(struct.unpack("<2i", open(sys.argv[1],"rb").read(8))[1])' "$1"; }
[ "$(version "$dir/base/model.bin")" = 3 ] || fail "model.bin is not version 3"
[ "$(version "$dir/base/model_bf16.bin")" = 5 ] || fail "model_bf16.bin is not version 5"
echo "exports written: ok"

for pair in "model.bin hf" "model_bf16.bin hf_bf16"; do
    set -- $pair
    trainer -e "$dir/base/$1" "${data[@]}" -x 0 -o "$dir/read_$1" >"$dir/read_$1.out" 2>&1 || { cat "$dir/read_$1.out"; fail "-e $1 -x 0"; }
    trainer -e "$dir/base/$2" "${data[@]}" -x 0 -o "$dir/read_$2" >"$dir/read_$2.out" 2>&1 || { cat "$dir/read_$2.out"; fail "-e $2/ -x 0"; }
    a=$(val_loss "$dir/read_$1/log.jsonl") b=$(val_loss "$dir/read_$2/log.jsonl")
    [ "$a" = "$b" ] || fail "validation loss from $2/ ($b) differs from $1's ($a)"
    echo "-e $2/ gives $1's validation loss $a: ok"
done
build/convert_model -i "$dir/base/hf" -o "$dir/back.bin" -f llmc --quiet >/dev/null
cmp -s "$dir/back.bin" "$dir/base/model.bin" || fail "convert_model hf/ -> llmc differs from model.bin"
echo "convert_model hf/ -> model.bin byte for byte: ok"

# Fine-tuning from the imported folder: straight 20 steps, and resumed from a step-10 checkpoint.
tune=(-e "$dir/base/hf" "${data[@]}" -x 20 -l 1e-3 -u 2 -v 10 --seed 7)
trainer "${tune[@]}" -o "$dir/straight" >"$dir/straight.out" 2>&1 || { cat "$dir/straight.out"; fail "fine-tune (straight)"; }
trainer "${tune[@]}" -n 10 -o "$dir/ck" >"$dir/ck.out" 2>&1 || { cat "$dir/ck.out"; fail "fine-tune with checkpoints"; }
mkdir -p "$dir/resumed" && cp -r "$dir/ck/ckpt_00000010" "$dir/resumed/"
trainer "${tune[@]}" -y 1 -o "$dir/resumed" >"$dir/resumed.out" 2>&1 || { cat "$dir/resumed.out"; fail "resume of the fine-tune"; }
grep -q "resume: restored .*ckpt_00000010: step 10" "$dir/resumed.out" || { cat "$dir/resumed.out"; fail "no restore line"; }
python3 - "$dir/straight/log.jsonl" "$dir/resumed/log.jsonl" <<'PY' || exit 1
import json, sys
def steps(path):
    return {r["step"]: (r["loss"], r["norm"]) for r in map(json.loads, open(path)) if "loss" in r}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
want = list(range(11, 21))
bad = [s for s in want if s not in b or a.get(s) != b[s]]
if bad:
    print("FAIL: resumed fine-tune differs from the straight run at steps %s (%r vs %r)" % (bad, a.get(bad[0]), b.get(bad[0])))
    sys.exit(1)
print("fine-tune from hf/ resumed at step 10: steps 11..20 bitwise identical: ok")
PY
cmp -s "$dir/straight/model.bin" "$dir/resumed/model.bin" || fail "final model.bin after resume differs from the straight run's"
echo "final model.bin after resume byte-identical: ok"
