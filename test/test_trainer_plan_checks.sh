#!/usr/bin/env bash
# The trainers' checks of a command line against the model and the data, before any work, on synthetic
# shards (no GPU needed: train_gpt2cu is run with --dry-run 1, train_gpt2 trains a tiny model):
#   - a command line refused (exit 2) leaves an earlier run's log.jsonl in -o as it was;
#   - -d asking for more micro-steps than a step can count (2^31 - 1) is refused by both trainers (exit 2),
#     not wrapped around or cut short behind the printed plan;
#   - -x 0 (evaluate or sample a model) needs no training data in either trainer.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2 train_gpt2cu
dir=$(mktemp -d /tmp/trainer_plan_checks_XXXXXX)
trap 'rm -rf "$dir"' EXIT
python3 test/make_synthetic_shards.py "$dir" syn_train=20000 syn_val=4000
source test/script_lib.sh

tiny=(--layers 2 --channels 32 --heads 2 --max-seq-len 32 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin"
      --tokenizer "$dir/none.bin")
gpu=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 --dry-run 1 -o "")

# An earlier run's log survives a mistyped command in the same directory.
mkdir "$dir/run"
echo '{"step":1,"loss":4.5}' >"$dir/run/log.jsonl"
expect_bin=(./train_gpt2)
expect_exit 2 "longer than the model's maximum sequence length 32" "${tiny[@]}" -t 64 -o "$dir/run"
expect_exit 2 "no shard file matches" "${tiny[@]}" -t 16 -i "$dir/none_*.bin" -o "$dir/run"
[ "$(cat "$dir/run/log.jsonl")" = '{"step":1,"loss":4.5}' ] ||
    { echo "FAIL: a refused command line changed $dir/run/log.jsonl to '$(cat "$dir/run/log.jsonl")'"; exit 1; }
echo "a refused command line leaves log.jsonl as it was: ok"

# -d / (B*T) beyond 2^31 - 1 micro-steps: a usage error in both trainers.
expect_exit 2 "-d/--total-batch 1099511627776 needs 1099511627776 micro-steps of B\*T = 1\*1 = 1 tokens" \
    "${tiny[@]}" -b 1 -t 1 -d 1099511627776 -x 1 -o ""
expect_bin=(./train_gpt2cu)
expect_exit 2 "-d/--total-batch 1099511627776 needs 4294967296 micro-steps of B\*T = 4\*64 = 256 tokens" \
    "${gpu[@]}" -d 1099511627776
expect_exit 2 "needs 2147483648 micro-steps" "${gpu[@]}" -d 549755813888
expect_exit 0 "2147483647 micro-step(s) per step" "${gpu[@]}" -d 549755813632
echo "-d beyond 2^31 - 1 micro-steps is refused: ok"

# -x 0 trains nothing, so it reads no training shards: none named, or none there.
expect_bin=(./train_gpt2cu)
expect_exit 0 "no training (-x 0)" "${gpu[@]}" -x 0 -i ""
expect_exit 0 "train data: none; val data: 1 shard(s), 15 batches per evaluation" "${gpu[@]}" -x 0 -i "$dir/none_*.bin"
expect_exit 2 "no shard file matches" "${gpu[@]}" -x 1 -i "$dir/none_*.bin"
expect_bin=(./train_gpt2)
expect_exit 0 "no training (-x 0)" "${tiny[@]}" -t 16 -x 0 -i "" -m 2 -o ""
expect_exit 0 "no training (-x 0)" "${tiny[@]}" -t 16 -x 0 -i "$dir/none_*.bin" -m 2 -o ""
echo "-x 0 without training data: ok"
echo "ok"
