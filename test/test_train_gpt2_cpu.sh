#!/usr/bin/env bash
# The CPU trainer (train_gpt2) end to end on synthetic shards: a tiny model learns a noisy Markov chain
# (the validation loss must fall by a third), reads both shard versions (uint16 and uint32 tokens),
# writes a model file that loads back to the same validation loss, samples greedily along the learned
# chain, and fails cleanly on bad input and bad flags (exit 2, the flag named).
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2
dir=$(mktemp -d /tmp/train_gpt2_cpu_XXXXXX)
trap 'rm -rf "$dir"' EXIT

python3 - "$dir" <<'PY'
import random, struct, sys
d = sys.argv[1]
def shard(path, tokens, version):
    header = [20240520, version, len(tokens)] + [0] * 253
    fmt = "<%d%s" % (len(tokens), "H" if version == 1 else "I")
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header) + struct.pack(fmt, *tokens))
def chain(n, seed):
    rng, t, out = random.Random(seed), 0, []
    for _ in range(n):
        t = (7 * t + 3) % 97 if rng.random() < 0.9 else rng.randrange(97)
        out.append(t)
    return out
shard(d + "/syn_train_000000.bin", chain(20000, 1), 1)
shard(d + "/syn_train_000001.bin", chain(20000, 2), 2)
shard(d + "/syn_val_000000.bin", chain(5000, 3), 1)
shard(d + "/bad_val_000000.bin", chain(2000, 4) + [97], 1)
PY

common=(--train "$dir/syn_train_*.bin" --val "$dir/syn_val_*.bin" --batch 4 --seq 16 --val-batches 16)
OMP_NUM_THREADS=2 ./train_gpt2 "${common[@]}" --layers 2 --channels 32 --heads 2 --vocab 97 --max-seq-len 32 \
    --steps 150 --lr 3e-3 --val-every 50 --out "$dir/model.bin" | tee "$dir/log"
read -r first last < <(sed -n 's/^val loss: \([0-9.]*\) -> \([0-9.]*\)$/\1 \2/p' "$dir/log")
echo "val loss $first -> $last"
python3 -c "import sys; f, l = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if l < f * 2 / 3 else 1)" "$first" "$last" \
    || { echo "FAIL: the validation loss did not fall by a third"; exit 1; }

./train_gpt2 "${common[@]}" --model "$dir/model.bin" --steps 0 | tee "$dir/log2"
reloaded=$(sed -n 's/^step     0 | val loss \([0-9.]*\)$/\1/p' "$dir/log2")
[ "$reloaded" = "$last" ] || { echo "FAIL: the written model gives val loss $reloaded, expected $last"; exit 1; }

# Sampling: greedy from the trained model must follow the chain it learned (t -> 7t + 3 mod 97 nine times
# in ten); without a tokenizer file the tokens are printed as ids, after a note.
./train_gpt2 "${common[@]}" --model "$dir/model.bin" --steps 0 --gen-tokens 12 --temperature 0 \
    --tokenizer "$dir/none.bin" | tee "$dir/log3"
grep -q "note: tokenizer '$dir/none.bin' not found" "$dir/log3" || { echo "FAIL: no note about the tokenizer"; exit 1; }
ids=$(sed -n '/^---------- sample/{n;p;}' "$dir/log3")
python3 - "$ids" <<'PY' || { echo "FAIL: the greedy sample does not follow the learned chain: $ids"; exit 1; }
import sys
ids = [int(x) for x in sys.argv[1].split()]
assert len(ids) == 12, ids
prev = [96] + ids[:-1]  # the start token: the end-of-text id, clamped to the vocabulary
follow = sum(1 for a, b in zip(prev, ids) if b == (7 * a + 3) % 97)
print("greedy sample follows the chain in %d of 12 steps" % follow)
sys.exit(0 if follow >= 9 else 1)
PY

source test/script_lib.sh
expect_bin=(./train_gpt2)
tiny=(--layers 1 --channels 8 --heads 2 --vocab 97 --max-seq-len 32 --batch 2 --seq 8 --steps 1)
expect_exit 3 "no token shards match" --train "$dir/none_*.bin" --val none "${tiny[@]}"
expect_exit 4 "outside the model's vocabulary" --train "$dir/bad_val_*.bin" --val none "${tiny[@]}" --steps 300
expect_exit 2 "needs all of --layers" --train "$dir/syn_train_*.bin" --layers 2
expect_exit 2 "unknown flag '--bogus'" --bogus 1
expect_exit 2 "flag --batch: '0' is not an integer from 1 to 65536" --batch 0
expect_exit 2 "flag --lr: 'fast' is not a number" --lr fast
expect_exit 2 "flag --seq needs a value" --seq
expect_exit 2 "--out-version expects 3 (fp32) or 5 (bf16), got 4" --out-version 4
expect_exit 2 "unexpected argument 'stray'" stray
expect_exit 0 "usage: train_gpt2 \[flags\]" --help
expect_exit 2 "longer than the model's max_seq_len" --train "$dir/syn_train_*.bin" --val none "${tiny[@]}" --seq 33
expect_exit 2 "--gen-tokens 32: at most the model's max_seq_len - 1 = 31" --train "$dir/syn_train_*.bin" --val none \
    "${tiny[@]}" --gen-tokens 32
echo "ok"
