#!/usr/bin/env bash
# The GPU trainer (train_gpt2cu) end to end. Without a GPU: its command-line errors (exit code 2, or 3
# for a missing model file, each with its message), which are checked before CUDA is touched, and the
# inputs it refuses before then too: a Hugging Face folder whose config.json holds 1e999 (exit 4, the file
# named), and a run that needs more host memory than `ulimit -v` leaves (exit 1, both figures; an earlier
# log.jsonl in -o byte for byte as it was); then exit 77. With a GPU, first the refusals that come after
# CUDA starts, each leaving the earlier log.jsonl as it was: an llm.c model file with a NaN weight (exit 4,
# the tensor named) and a batch that does not fit in GPU memory (-b 4096 -t 1024, exit 5); then, on
# synthetic shards (a noisy Markov chain over 97 GPT-2 token ids) and d2:
#   - 40 steps: 40 step lines with loss, lr, norm, ms, tok/s, MFU and ETA; log.jsonl with 40 step
#     records (loss, lr, norm, ms, tok_per_s, mfu) and 5 validation records; the validation loss falls
#     by a fifth and the train loss falls; samples are printed; model.bin is an llm.c version 3 file of
#     the right size, and loading it gives back (nearly) the final validation loss;
#   - determinism: the same run twice gives identical losses and norms in log.jsonl;
#   - the data on the GPU and streamed from the host give identical losses;
#   - --rounding-seed: equal to --seed it is the default run bit for bit; another value keeps step 1 and
#     changes the steps after the first update;
#   - gradient accumulation (-d 2*B*T) runs two micro-steps per step, and two micro-steps of B=4 give the
#     first step's loss and gradient norm of one micro-step of B=8 on the same sequences;
#   - -r 1 (recompute the GELU output in backward) allocates fewer activation bytes, gives the same
#     first loss bitwise (the forward is unchanged) and losses within 1% of -r 0 over 10 steps.
# Exit 0 pass, 1 fail, 77 skip (no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2cu train_gpt2
dir=$(mktemp -d /tmp/train_gpt2cu_XXXXXX)
trap 'rm -rf "$dir"' EXIT

source test/script_lib.sh
expect_bin=(./train_gpt2cu)
expect_exit 0 "usage: train_gpt2cu" --help
expect_exit 2 "unknown flag '--no-such-flag'" --no-such-flag 1
expect_exit 2 "needs a value" -e d2 -b
expect_exit 2 "is not an integer" -b four
expect_exit 2 "not a multiple of B\*T" -e d2 -b 4 -t 64 -d 1000
expect_exit 2 "longer than the model's maximum sequence length" -e d2 -t 2048
expect_exit 2 "flag -y: '2' is not an integer from 0 to 1" -y 2
expect_exit 2 "needs an output directory (-o)" -n 5 -o ""
expect_exit 2 "unknown learning rate schedule" -k exponential
expect_exit 2 "unknown model descriptor" -e d5
expect_exit 3 "'$dir/missing.bin': No such file or directory" -e "$dir/missing.bin"
expect_exit 2 "flag -r: '2' is not an integer from 0 to 1" -r 2
expect_exit 2 "flag -nk: '-1' is not an integer at least 0" -nk -1
expect_exit 2 "must be below 1" --beta2 1
expect_exit 2 "flag --rounding-seed: '-2' is not an integer at least -1" --rounding-seed -2
expect_exit 0 "(default: 4, at least 1)" --help
echo "command-line errors: ok"

# The plan (--dry-run: flags, model, data and plan checked and printed, no GPU needed).
python3 test/make_synthetic_shards.py "$dir" syn_train=60000,60000 syn_val=8000
plan=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 --dry-run 1)
expect_exit 0 "512 tokens per step, 2 micro-step(s) per step" "${plan[@]}" -d 512
expect_exit 0 "256 tokens per step, 1 micro-step(s) per step" "${plan[@]}"
expect_exit 2 "is not a multiple of B\*T = 4\*64 = 256 tokens" "${plan[@]}" -d 500
expect_exit 2 "longer than the model's maximum sequence length 1024" "${plan[@]}" -t 1025
expect_exit 0 "micro-batch 4 x 64" "${plan[@]}" -y 1 -o "$dir/plan_out"
expect_exit 2 "-y 1 (resume) needs an output directory" "${plan[@]}" -y 1 -o ""
expect_exit 0 "keep the newest 3 and every 100-th step" "${plan[@]}" -n 10 -nk 3 -nm 100 -o "$dir/plan_out"
expect_exit 2 "no shard file matches" "${plan[@]}" -i "$dir/nothing_*.bin"
expect_exit 0 "| rounding-seed  *| 7 \*" "${plan[@]}" --rounding-seed 7
# -g 0 means no sample, as in train_gpt2; a prompt that leaves no room is refused only when sampling.
expect_exit 0 "| gen-tokens  *| 0 \*" "${plan[@]}" -g 0
expect_exit 0 "prompt: 65 token(s)" "${plan[@]}" -s 0 --prompt-ids "$(seq -s, 1 65)"
expect_exit 2 "the prompt has 65 tokens; samples need it shorter than -t/--seq-len 64" "${plan[@]}" --prompt-ids "$(seq -s, 1 65)"
[ ! -e "$dir/plan_out" ] || { echo "FAIL: --dry-run created the output directory"; exit 1; }
# A fresh run (no -y 1) among an earlier run's checkpoints is refused before it touches anything; -y 1
# is the way to continue it. (A directory named like an unfinished checkpoint does not count.)
mkdir -p "$dir/earlier/ckpt_00000040" "$dir/earlier/ckpt_00000050.tmp"
expect_exit 2 "holds 1 checkpoint(s) of an earlier run (the newest: $dir/earlier/ckpt_00000040): resume it with -y 1" \
    "${plan[@]}" -o "$dir/earlier"
expect_exit 2 "holds 1 checkpoint(s) of an earlier run" "${plan[@]}" -o "$dir/earlier" -y 0 -n 10
expect_exit 0 "micro-batch 4 x 64" "${plan[@]}" -o "$dir/earlier" -y 1
# -x 0 (evaluate or sample) writes no checkpoints, so it may run there; and it writes a model only when
# --save-model says so (the settings table shows what it will write).
expect_exit 0 "| save-model  *| none " "${plan[@]}" -o "$dir/earlier" -x 0
expect_exit 0 "| save-model  *| llmc \*" "${plan[@]}" -o "$dir/earlier" -x 0 --save-model llmc
expect_exit 0 "| save-model  *| llmc " "${plan[@]}" -o "$dir/plan_out" -x 5
rm -rf "$dir/earlier/ckpt_00000040"
expect_exit 0 "micro-batch 4 x 64" "${plan[@]}" -o "$dir/earlier"
echo "plans: ok"

# Inputs refused before CUDA starts. expect_log_kept DIR: DIR/log.jsonl is still the earlier run's.
earlier_log() { mkdir -p "$1" && echo '{"step":1,"loss":4.5}' >"$1/log.jsonl"; }
expect_log_kept() {
    [ "$(cat "$1/log.jsonl")" = '{"step":1,"loss":4.5}' ] ||
        { echo "FAIL: a run that never started changed $1/log.jsonl to '$(cat "$1/log.jsonl")'"; exit 1; }
}
./train_gpt2 -e d2 -x 0 -j "" --save-model llmc,hf -o "$dir/d2" >/dev/null
cp -r "$dir/d2/hf" "$dir/hf_overflow"
python3 - "$dir/hf_overflow/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["initializer_range"] = "OVERFLOW"
open(sys.argv[1], "w").write(json.dumps(c).replace('"OVERFLOW"', "1e999"))
PY
expect_exit 4 "$dir/hf_overflow/config.json" "${plan[@]}" -e "$dir/hf_overflow"
earlier_log "$dir/memory"
expect_bin=(bash -c 'ulimit -v 4000000 && exec ./train_gpt2cu "$@"' train_gpt2cu)
expect_exit 1 "^error: the run needs .* of host memory (the fp32 parameters .*), and .* is available (.*); use a smaller model" \
    -e d48 -i "$dir/syn_train_*.bin" -j "" -b 1 -t 64 -o "$dir/memory"
expect_log_kept "$dir/memory"
expect_bin=(./train_gpt2cu)
echo "refused before CUDA: a config.json number out of range, too little host memory (the log kept): ok"

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skipped: no NVIDIA GPU (the command-line checks above passed)"
    exit 77
fi

# Refused after CUDA starts, before the run does: the earlier log.jsonl stays.
python3 - "$dir/d2/model.bin" "$dir/nan.bin" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
b[1024 + 4 * 5:1024 + 4 * 6] = struct.pack("<f", float("nan"))  # the 6th value of wte, the first tensor
open(sys.argv[2], "wb").write(b)
PY
earlier_log "$dir/nan_run"
expect_exit 4 "'$dir/nan.bin': .*not finite.* in tensor wte" \
    -e "$dir/nan.bin" -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -x 2 -o "$dir/nan_run"
expect_log_kept "$dir/nan_run"
python3 test/make_synthetic_shards.py "$dir" syn_big=4200000 >/dev/null
earlier_log "$dir/oom"
expect_exit 5 "out of memory" -e d2 -i "$dir/syn_big_*.bin" -j "" -b 4096 -t 1024 -x 1 -o "$dir/oom"
expect_log_kept "$dir/oom"
rm "$dir"/syn_big_*.bin
echo "refused after CUDA starts: a NaN weight (the tensor named), a batch too big for the GPU (the log kept): ok"

tok=()
[ -f data/gpt2_tokenizer.bin ] && tok=(--tokenizer data/gpt2_tokenizer.bin)
common=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -l 3e-3 -u 5 -c 0.1 --seed 3 "${tok[@]}")

# A 40-step run with everything on.
./train_gpt2cu "${common[@]}" -x 40 -v 10 -m 4 -s 20 -g 16 -o "$dir/run1" | tee "$dir/log1"
steps=$(grep -cE '^step +[0-9]+/40 \| loss [0-9.]+ \| lr [0-9.e+-]+ \| norm [0-9.]+ \| [0-9.]+ ms \| [0-9]+ tok/s \| MFU ([0-9.]+%|n/a) \| ETA ' "$dir/log1" || true)
[ "$steps" -eq 40 ] || { echo "FAIL: expected 40 step lines, found $steps"; exit 1; }
grep -q -- '---------- sample at step 20' "$dir/log1" || { echo "FAIL: no sample at step 20"; exit 1; }
grep -q -- '---------- sample at step 40' "$dir/log1" || { echo "FAIL: no sample at step 40"; exit 1; }
grep -q 'parameters (bf16)' "$dir/log1" || { echo "FAIL: no memory table"; exit 1; }
grep -q '| batch-size  *| 4 \*' "$dir/log1" || { echo "FAIL: no settings table"; exit 1; }

python3 - "$dir" <<'PY'
import json, os, struct, sys
d = sys.argv[1]
recs = [json.loads(l) for l in open(d + "/run1/log.jsonl")]
train = [r for r in recs if "loss" in r]
val = [r for r in recs if "val_loss" in r]
def fail(msg):
    print("FAIL:", msg); sys.exit(1)
if [r["step"] for r in train] != list(range(1, 41)): fail("log.jsonl step records: %s" % [r["step"] for r in train])
for r in train:
    for k in ("loss", "lr", "norm", "ms", "tok_per_s", "mfu"):
        if k not in r: fail("step record without %s: %s" % (k, r))
    if r["mfu"] is not None and r["mfu"] < 0: fail("negative MFU: %s" % r)
if [r["step"] for r in val] != [0, 10, 20, 30, 40]: fail("val records at steps %s" % [r["step"] for r in val])
first, last = val[0]["val_loss"], val[-1]["val_loss"]
print("val loss %.4f -> %.4f" % (first, last))
if not last < 0.8 * first: fail("the validation loss did not fall by a fifth")
a = sum(r["loss"] for r in train[:5]) / 5
b = sum(r["loss"] for r in train[-5:]) / 5
print("train loss, first 5 steps %.4f, last 5 steps %.4f" % (a, b))
if not b < a: fail("the train loss did not fall")
# The parameter count of d2 (C=128, L=2), tensor by tensor as in llmc/gpt2_config.h.
C, L, Vp, maxT = 128, 2, 50304, 1024
n = Vp * C + maxT * C + L * (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C) + 2 * C
path = d + "/run1/model.bin"
h = struct.unpack("<8i", open(path, "rb").read(32))
if h[:2] != (20240326, 3): fail("model.bin header %s" % (h,))
if os.path.getsize(path) != 1024 + 4 * n: fail("model.bin is %d bytes, expected %d" % (os.path.getsize(path), 1024 + 4 * n))
open(d + "/last_val", "w").write(repr(last))
PY

# The written model loads back: its validation loss is the last one, up to bf16 rounding of the weights
# (training rounds stochastically, loading rounds to nearest).
./train_gpt2cu -e "$dir/run1/model.bin" -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -x 0 -v 1 -m 4 \
    -s 0 -o "" | tee "$dir/log_reload"
python3 - "$dir" <<'PY'
import re, sys
d = sys.argv[1]
last = float(open(d + "/last_val").read())
m = re.search(r"^step +0/0 \| val loss ([0-9.]+)$", open(d + "/log_reload").read(), re.M)
if not m: print("FAIL: no val loss from the reloaded model"); sys.exit(1)
got = float(m.group(1))
print("reloaded val loss %.6f, end of training %.6f" % (got, last))
if abs(got - last) > 0.02 * last: print("FAIL: the reloaded model's validation loss differs by more than 2%"); sys.exit(1)
PY

# Determinism, and the two data paths: same seed => identical losses and norms.
short=("${common[@]}" -x 10 -v 5 -m 2 -s 0 --save-model 0)
./train_gpt2cu "${short[@]}" -o "$dir/run2" >/dev/null
./train_gpt2cu "${short[@]}" -o "$dir/run3" >/dev/null
./train_gpt2cu "${short[@]}" -o "$dir/run4" --data-on-gpu-mib 0 >"$dir/log4"
grep -q "train data: streamed" "$dir/log4" || { echo "FAIL: --data-on-gpu-mib 0 did not stream"; cat "$dir/log4"; exit 1; }
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def numbers(run):
    out = []
    for l in open("%s/%s/log.jsonl" % (d, run)):
        r = json.loads(l)
        out.append((r["step"], r.get("loss"), r.get("norm"), r.get("val_loss")))
    return out
a, b, c = numbers("run2"), numbers("run3"), numbers("run4")
if a != b: print("FAIL: two runs with the same seed differ:\n%s\n%s" % (a, b)); sys.exit(1)
if a != c: print("FAIL: data on the GPU and streamed give different losses:\n%s\n%s" % (a, c)); sys.exit(1)
print("determinism: 10 steps bitwise identical (twice resident, once streamed)")
PY

# --rounding-seed: the seed of the stochastic rounding alone. Its default is --seed (3 here: run2's bits);
# another value gives run2's first step (no update yet) and other losses after it (another rounding).
./train_gpt2cu "${short[@]}" -o "$dir/run5" --rounding-seed 3 >/dev/null
./train_gpt2cu "${short[@]}" -o "$dir/run6" --rounding-seed 9 >/dev/null
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def losses(run):
    return [(r["step"], r["loss"], r["norm"]) for r in map(json.loads, open("%s/%s/log.jsonl" % (d, run))) if "loss" in r]
a, same, other = losses("run2"), losses("run5"), losses("run6")
if same != a: print("FAIL: --rounding-seed equal to --seed changed the run"); sys.exit(1)
if other[0] != a[0]: print("FAIL: --rounding-seed changed step 1 (before any rounding): %s %s" % (other[0], a[0])); sys.exit(1)
if other[1:] == a[1:]: print("FAIL: --rounding-seed 9 changed nothing after step 1"); sys.exit(1)
print("rounding seed: its default is --seed; another changes only what follows the first update")
PY

# Recompute: one GELU buffer instead of L, the same forward, nearly the same gradients.
./train_gpt2cu "${short[@]}" -o "$dir/run_r1" -r 1 >"$dir/log_r1"
./train_gpt2cu "${short[@]}" -o "$dir/run_r0" -r 0 >"$dir/log_r0"
python3 - "$dir" <<'PY'
import json, re, sys
d = sys.argv[1]
def fail(msg):
    print("FAIL:", msg); sys.exit(1)
def activations(log):
    m = re.search(r"^\| activations +\| ([0-9.]+) (KiB|MiB|GiB)", open(log).read(), re.M)
    if not m: fail("no activations row in %s" % log)
    return float(m.group(1)) * {"KiB": 1, "MiB": 1024, "GiB": 1024 ** 2}[m.group(2)]
a0, a1 = activations(d + "/log_r0"), activations(d + "/log_r1")
if not a1 < a0: fail("-r 1 allocates %s KiB of activations, -r 0 %s" % (a1, a0))
def losses(run):
    return [json.loads(l)["loss"] for l in open("%s/%s/log.jsonl" % (d, run)) if "loss" in json.loads(l)]
l0, l1 = losses("run_r0"), losses("run_r1")
if len(l0) != 10 or len(l1) != 10: fail("expected 10 steps: %s %s" % (l0, l1))
if l0[0] != l1[0]: fail("-r 1 changed the first loss: %r vs %r" % (l1[0], l0[0]))
worst = max(abs(x - y) / y for x, y in zip(l1, l0))
if worst > 0.01: fail("-r 1 losses differ from -r 0 by %.3g relative: %s %s" % (worst, l1, l0))
print("recompute: activations %.0f -> %.0f KiB, first loss identical, 10 losses within %.2g relative" % (a0, a1, worst))
PY

# Gradient accumulation: two micro-steps per optimizer step.
./train_gpt2cu "${common[@]}" -x 3 -d 512 -v 0 -s 0 -o "" | tee "$dir/log5"
grep -q "512 tokens per step, 2 micro-step(s) per step" "$dir/log5" || { echo "FAIL: no gradient accumulation"; exit 1; }
[ "$(grep -cE '^step +[0-9]+/3 \| loss' "$dir/log5")" -eq 3 ] || { echo "FAIL: accumulation run did not log 3 steps"; exit 1; }
# The step's gradient is the mean over all its micro-batches: B=4 with -d 512 (two micro-steps) and B=8 in one
# micro-step read the same 8 sequences first, so the first step's loss and gradient norm agree (the bf16
# gradient sums in another order: within 1%); a micro-batch weighted 1 instead of 1/2 doubles the norm.
acc=(-e d2 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -t 64 -l 3e-3 -u 5 -c 0.1 --seed 3 "${tok[@]}" -x 1
     -v 0 -s 0 -o "")
./train_gpt2cu "${acc[@]}" -b 8 >"$dir/log_b8"
./train_gpt2cu "${acc[@]}" -b 4 -d 512 >"$dir/log_b4x2"
python3 - "$dir/log_b8" "$dir/log_b4x2" <<'PY'
import re, sys
def first(path):
    for line in open(path):
        m = re.match(r"step +1/1 \| loss ([0-9.]+) \| lr [^|]+\| norm ([0-9.]+) \|", line)
        if m:
            return float(m.group(1)), float(m.group(2))
    sys.exit("FAIL: no step line in " + path)
(l8, n8), (l4, n4) = first(sys.argv[1]), first(sys.argv[2])
if abs(l4 - l8) > 1e-3 * l8:
    sys.exit("FAIL: two accumulated micro-steps give loss %r, one micro-step of the same data %r" % (l4, l8))
if abs(n4 / n8 - 1) > 0.01:
    sys.exit("FAIL: two accumulated micro-steps give gradient norm %r, one micro-step of the same data %r" % (n4, n8))
print("accumulation: loss %r vs %r, gradient norm %r vs %r in one micro-step" % (l4, l8, n4, n8))
PY
echo "ok"
