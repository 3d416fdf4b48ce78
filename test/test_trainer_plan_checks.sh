#!/usr/bin/env bash
# The trainers' checks of a command line against the model and the data, before any work, on synthetic
# shards (no GPU needed: train_gpt2cu is run with --dry-run 1, train_gpt2 trains a tiny model):
#   - a command line refused (exit 2) leaves an earlier run's log.jsonl in -o as it was;
#   - a run that needs more host memory than it has (-b 4096 -t 1024, `ulimit -v`, a memory cgroup) is refused by
#     train_gpt2 before it allocates (exit 1, the need and what is available, which limit), and the earlier
#     log.jsonl stays byte for byte;
#   - -o "" with --save-model naming a format is a contradiction (exit 2, both flags named), in both
#     trainers; -o "" alone, or with --save-model none, writes nothing as before;
#   - -e naming what is not a model says why in the system's words, in both trainers: a missing path, a
#     link loop, a FIFO, a directory without config.json;
#   - -d asking for more micro-steps than a step can count (2^31 - 1) is refused by both trainers (exit 2),
#     not wrapped around or cut short behind the printed plan;
#   - -x 0 (evaluate or sample a model) needs no training data in either trainer;
#   - --eval-max-items 0 is a usage error (exit 2), not an evaluation file that "holds no items" (exit 4);
#   - with a GPU: train_gpt2cu samples from a model on a 97-token vocabulary beside a tokenizer of GPT-2's
#     50257 tokens (the first token must be one the model has) and beside one of 3 tokens (sampled ids it
#     cannot decode print as numbers, the run goes on), as train_gpt2 does.
# Exit 0 pass, 1 fail, 77 skip (no GPU; the checks before the GPU part passed).
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

# Too little host memory: refused before anything is allocated, naming both figures; the earlier log stays.
cp "$dir/run/log.jsonl" "$dir/log.before"
expect_bin=(bash -c 'ulimit -v 400000 && exec ./train_gpt2 "$@"' train_gpt2)
expect_exit 1 "is available (the address-space limit, ulimit -v 400000, less the .* this process maps already); lower -b or -t" \
    -e d2 -i "$dir/syn_train_*.bin" -j "" -b 1 -t 1024 -o "$dir/run"
[ "$(grep -c '^error: the run needs .* of host memory' "$dir/out")" = 1 ] ||
    { echo "FAIL: expected one error line naming the host memory needed:"; cat "$dir/out"; exit 1; }
log_kept() {
    cmp -s "$dir/run/log.jsonl" "$dir/log.before" ||
        { echo "FAIL: a run refused for memory changed $dir/run/log.jsonl to '$(cat "$dir/run/log.jsonl")'"; exit 1; }
}
log_kept
expect_bin=(./train_gpt2)
expect_exit 1 "TiB of host memory (the model and AdamW's state .*, activations for -b 4096 -t 1024 .*); lower -b or -t" \
    -e d2 -i "$dir/syn_train_*.bin" -j "" -b 4096 -t 1024 -o "$dir/run"
log_kept
# A memory cgroup (how Slurm, Kubernetes and Docker bound a job), where this machine lets us make one: its
# limit less what it holds is what the run may take; without the check the kernel kills the run mid-way,
# with no error line.
cg=/sys/fs/cgroup/memory/llmc_plan_checks_$$
if mkdir "$cg" 2>/dev/null && echo $((300 << 20)) >"$cg/memory.limit_in_bytes" 2>/dev/null; then
    trap 'rm -rf "$dir"; rmdir "$cg" 2>/dev/null' EXIT
    expect_bin=(bash -c 'echo $$ >"$0/cgroup.procs" && exec ./train_gpt2 "$@"' "$cg")
    expect_exit 1 "GiB of host memory (.*), and .* is available (the memory cgroup's limit, $cg/memory.limit_in_bytes, less what the cgroup holds); lower -b or -t" \
        -e d2 -i "$dir/syn_train_*.bin" -j "" -b 16 -t 1024 -o "$dir/run"
    log_kept
    echo "a run over its memory cgroup's limit: refused before it allocates, the log kept: ok"
else
    rmdir "$cg" 2>/dev/null || true
    echo "note: no memory cgroup can be made here (cgroup v1 memory controller, writable): that case not checked"
fi
echo "too little host memory: refused with the figures, the earlier log.jsonl byte for byte: ok"

# -o "" writes nothing; a model asked for there is a contradiction, refused in both trainers.
expect_bin=(./train_gpt2)
expect_exit 2 "--save-model llmc,hf needs an output directory, but -o/--output-dir is \"\"" \
    "${tiny[@]}" -t 16 -x 1 -o "" --save-model llmc,hf
expect_exit 0 "val loss" "${tiny[@]}" -t 16 -x 1 -m 1 -o "" --save-model none
expect_bin=(./train_gpt2cu)
expect_exit 2 "--save-model hf needs an output directory, but -o/--output-dir is \"\"" "${gpu[@]}" --save-model hf
expect_exit 2 "--save-model llmc needs an output directory" "${gpu[@]}" -x 0 --save-model llmc
expect_exit 0 "micro-batch 4 x 64" "${gpu[@]}" --save-model none
echo "-o \"\" with --save-model: refused: ok"

# -e that names no model file: the system's reason, not "does not exist" for everything.
mkfifo "$dir/fifo"
ln -s loop_b "$dir/loop_a"
ln -s loop_a "$dir/loop_b"
mkdir "$dir/folder"
for trainer in ./train_gpt2 ./train_gpt2cu; do
    expect_bin=("$trainer")
    expect_exit 3 "'$dir/missing.bin': No such file or directory" -e "$dir/missing.bin" -o ""
    expect_exit 3 "'$dir/loop_a': Too many levels of symbolic links" -e "$dir/loop_a" -o ""
    expect_exit 3 "'$dir/fifo': is a FIFO, not a regular file" -e "$dir/fifo" -o ""
    expect_exit 3 "'$dir/folder' is a directory without config.json" -e "$dir/folder" -o ""
done
echo "-e naming a missing path, a link loop, a FIFO, a directory: the system's reason: ok"
expect_bin=(./train_gpt2)

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

# --eval-max-items 0 is a mistake on the command line, whatever the file holds.
python3 - "$dir/mc.bin" <<'PY2'
import struct, sys
# One example in llm.c's eval format: delimiter, size in bytes, index, label, K, context, K endings.
ctx, ends = [5, 6, 7], [[8, 9], [10, 11], [12, 13], [14, 15]]
body = [0, 1, len(ends), len(ctx)] + ctx + [x for e in ends for x in [len(e)] + e]
example = [65535, 2 * (len(body) + 2)] + body
open(sys.argv[1], "wb").write(struct.pack("<256i", *([20240522, 1, 1, 2 * len(example)] + [0] * 252)) +
                              struct.pack("<%dH" % len(example), *example))
PY2
expect_bin=(./train_gpt2)
expect_exit 2 "--eval-max-items 0: must be -1 (all) or at least 1" "${tiny[@]}" -t 16 -x 0 --eval "$dir/mc.bin" \
    --eval-max-items 0 -o ""
expect_bin=(./train_gpt2cu)
expect_exit 2 "--eval-max-items 0: must be -1 (all) or at least 1" "${gpu[@]}" --eval "$dir/mc.bin" --eval-max-items 0
echo "--eval-max-items 0 is refused as a usage error: ok"

# Samples from a model whose vocabulary is not the tokenizer's.
python3 - "$dir" <<'PY2'
import struct, sys
def tokenizer(path, tokens, eot):
    with open(path, "wb") as f:
        f.write(struct.pack("<256I", *([20240328, 2, len(tokens), eot] + [0] * 252)))
        for t in tokens: f.write(bytes([len(t)]) + t)
tokenizer(sys.argv[1] + "/tok_gpt2_size.bin", [b"t%d" % i for i in range(50257)], 50256)
tokenizer(sys.argv[1] + "/tok_3.bin", [b"a", b"b", b"c"], 2)
PY2
./train_gpt2 --layers 1 --channels 64 --heads 1 --vocab 97 --max-seq-len 64 -x 0 -j "" --save-model llmc \
    -o "$dir/v97" >/dev/null
sample=(-e "$dir/v97/model.bin" -x 0 -j "" -b 1 -t 64 -s 1 -g 16 -o "")
expect_bin=(./train_gpt2)
expect_exit 0 "sample at step 0" "${sample[@]}" --tokenizer "$dir/tok_gpt2_size.bin"
expect_exit 0 "sample at step 0" "${sample[@]}" --tokenizer "$dir/tok_3.bin"
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no NVIDIA GPU for train_gpt2cu's samples (the checks above passed)"
    exit 77
fi
expect_bin=(./train_gpt2cu)
expect_exit 0 "sample at step 0" "${sample[@]}" --tokenizer "$dir/tok_gpt2_size.bin"
expect_exit 0 "sample at step 0" "${sample[@]}" --tokenizer "$dir/tok_3.bin"
echo "samples from a 97-token model beside other tokenizers: ok"
echo "ok"
