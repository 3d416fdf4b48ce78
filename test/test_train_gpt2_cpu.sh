#!/usr/bin/env bash
# The CPU trainer (train_gpt2) end to end on synthetic shards it writes itself (a noisy Markov chain
# over 97 ids, in both shard versions: uint16 and uint32 tokens), with a tiny model (L=2, C=32, V=97):
#   - numbers pinned as literals (so a change to the model, the initialisation, the data order, the
#     schedule or the optimizer fails here): the first train losses, the gradient norm, the learning
#     rate of warmup and cosine decay, the validation loss at steps 0, 50 and 150, and the tokens of a
#     greedy sample; the validation loss must also fall by a third;
#   - the same log.jsonl numbers with OMP_NUM_THREADS=1 and 2;
#   - the written model loads back (-e FILE -x 0) to the same validation loss, and a greedy sample from
#     --prompt-ids follows the chain the model learned; its exports (llm.c files and Hugging Face folders,
#     fp32 and bf16, the same bytes from the trainer and from build/convert_model) load back to that loss
#     (bf16: within 2e-3), and a reader written here from the formats' specifications finds the trained
#     weights in each; -x 0 writes no model unless asked; a Hugging Face
#     export beside a tokenizer for another vocabulary is written without tokenizer files, with a note;
#     -x 0 into the trained folder appends to its log.jsonl (after an evaluation_of line), never replaces it;
#   - -d (gradient accumulation over two batches) gives the losses and norm of one batch twice as big;
#   - errors: bad data (exit 4), bad flags (exit 2, the flag named), and an error printed after the
#     stdout lines that came before it when both go to one pipe.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2 build/convert_model
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
shard(d + "/syn_train_000001.bin", chain(20001, 2), 2)
shard(d + "/syn_val_000000.bin", chain(5000, 3), 1)
shard(d + "/bad_train_000000.bin", chain(2000, 4) + [97], 1)
PY

tiny=(--layers 2 --channels 32 --heads 2 --vocab 97 --max-seq-len 32)
common=(-i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 16 -m 16 --seed 7 --tokenizer "$dir/none.bin")
run=("${common[@]}" "${tiny[@]}" -x 150 -l 3e-3 -u 10 -k cosine -q 0.1 -v 50 -s 150 -g 12 --temperature 0
     --log-every 50)
OMP_NUM_THREADS=2 ./train_gpt2 "${run[@]}" --save-model llmc,hf -o "$dir/a" | tee "$dir/log_a"
OMP_NUM_THREADS=1 ./train_gpt2 "${run[@]}" -o "$dir/b" >"$dir/log_b"
grep -q "note: tokenizer '$dir/none.bin' not found" "$dir/log_a" || { echo "FAIL: no note about the tokenizer"; exit 1; }

python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def fail(msg):
    print("FAIL:", msg); sys.exit(1)
def records(run):
    return [json.loads(l) for l in open("%s/%s/log.jsonl" % (d, run))]
a, b = records("a"), records("b")
numbers = lambda recs: [{k: v for k, v in r.items() if k not in ("ms", "tok_per_s")} for r in recs]
if numbers(a) != numbers(b): fail("log.jsonl differs between OMP_NUM_THREADS=2 and 1")
print("OMP_NUM_THREADS=1 and 2: identical losses, norms, learning rates, validation losses and sample")

train = {r["step"]: r for r in a if "loss" in r}
val = {r["step"]: r["val_loss"] for r in a if "val_loss" in r}
samples = {r["step"]: r["sample"] for r in a if "sample" in r}
if sorted(train) != list(range(1, 151)): fail("train records at steps %s" % sorted(train))
if sorted(val) != [0, 50, 100, 150]: fail("val records at steps %s" % sorted(val))
if sorted(samples) != [150]: fail("sample records at steps %s" % sorted(samples))

def near(what, got, want, tol):
    if abs(got - want) > tol: fail("%s is %.9g, expected %.9g (tolerance %g)" % (what, got, want, tol))
# Literal values from this model, data and seed (gpt2_cpu.h in fp32 gives them bitwise with any thread
# count). Later steps get a looser bound, for a compiler that contracts multiply-adds differently.
EXPECTED_LOSS = {1: (4.55288558, 1e-5), 2: (4.58568125, 1e-5), 3: (4.58536808, 1e-5), 50: (2.91661376, 1e-4),
                 150: (1.45450066, 1e-4)}
EXPECTED_NORM1 = 1.66129318
EXPECTED_VAL = {0: (4.58335059, 1e-5), 50: (2.96767974, 1e-4), 150: (1.66158581, 1e-4)}
EXPECTED_SAMPLE = [93, 72, 22, 60, 35, 54, 90, 51, 69, 1, 10, 73]
for step, (want, tol) in EXPECTED_LOSS.items(): near("train loss at step %d" % step, train[step]["loss"], want, tol)
near("gradient norm at step 1", train[1]["norm"], EXPECTED_NORM1, 1e-5)
for step, (want, tol) in EXPECTED_VAL.items(): near("val loss at step %d" % step, val[step], want, tol)
if samples[150] != EXPECTED_SAMPLE: fail("greedy sample %s, expected %s" % (samples[150], EXPECTED_SAMPLE))
# Warmup 10 steps to 3e-3, then cosine to 3e-4 at step 150 (schedule.h counts steps from 0).
import math
def lr(s):
    if s < 10: return 3e-3 * (s + 1) / 10
    return 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * (s - 10) / 140))
for step in (1, 5, 10, 11, 80, 150): near("lr at step %d" % step, train[step]["lr"], lr(step - 1), 1e-6 * lr(step - 1))
if not val[150] < val[0] * 2 / 3: fail("the validation loss did not fall by a third: %g -> %g" % (val[0], val[150]))
print("pinned losses, norm, learning rates, validation losses and greedy sample: ok")
PY
grep -q '^---------- sample at step 150' "$dir/log_a" || { echo "FAIL: no sample printed at step 150"; exit 1; }
[ -f "$dir/a/model.bin" ] || { echo "FAIL: no model.bin"; exit 1; }
grep -q '^val loss: 4.583351 -> 1.661586$' "$dir/log_a" || { echo "FAIL: no summary line 'val loss: 4.583351 -> 1.661586'"; exit 1; }
last=1.661586

# The written model: the same validation loss, a greedy sample along the chain from a prompt, and no
# model.bin written by -x 0 unless --save-model asks.
./train_gpt2 "${common[@]}" -e "$dir/a/model.bin" -x 0 -g 12 --temperature 0 --prompt-ids 5,38 -o "$dir/c" \
    | tee "$dir/log_c"
reloaded=$(sed -n 's/^step     0\/0 | val loss \([0-9.]*\)$/\1/p' "$dir/log_c")
[ "$reloaded" = "$last" ] || { echo "FAIL: the written model gives val loss $reloaded, expected $last"; exit 1; }
[ ! -e "$dir/c/model.bin" ] || { echo "FAIL: -x 0 wrote a model without --save-model"; exit 1; }
python3 - "$dir" <<'PY' || exit 1
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/c/log.jsonl")]
ids = [r["sample"] for r in recs if "sample" in r][0]
prev = [38] + ids[:-1]
follow = sum(1 for a, b in zip(prev, ids) if b == (7 * a + 3) % 97)
print("greedy sample after the prompt 5,38 follows the chain in %d of %d steps: %s" % (follow, len(ids), ids))
if ids != [75, 43, 13, 94, 79, 71, 15, 11, 80, 78, 64, 63] or follow < 10:
    print("FAIL: the greedy sample does not continue the prompt along the learned chain"); sys.exit(1)
PY

# Export and import. Each export of the trained model loads back (-e, -x 0) to the trained model's
# validation loss: the fp32 ones (model.bin, hf/) to all 9 digits log.jsonl gives, with the same greedy
# sample; the bf16 ones (model_bf16.bin, hf_bf16/) to each other's exactly, and within 2e-3 of fp32's
# (rounding to bf16 moves it by 2e-4 here). Written again from hf/, by the trainer and by
# build/convert_model, every format comes out byte for byte the same.
val_of() { python3 -c 'import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if "val_loss" in r][-1]["val_loss"])' "$1/log.jsonl"; }
trained=$(val_of "$dir/a")
[ "$(val_of "$dir/c")" = "$trained" ] || { echo "FAIL: model.bin loads back to val loss $(val_of "$dir/c"), trained $trained"; exit 1; }
./train_gpt2 "${common[@]}" -e "$dir/a/hf" -x 0 -g 12 --temperature 0 --prompt-ids 5,38 -o "$dir/c_hf" >/dev/null
cmp -s "$dir/c/log.jsonl" "$dir/c_hf/log.jsonl" ||
    { echo "FAIL: the Hugging Face export evaluates and samples unlike model.bin:"; cat "$dir/c/log.jsonl" "$dir/c_hf/log.jsonl"; exit 1; }
./train_gpt2 "${common[@]}" -e "$dir/a/hf" -x 0 -v 0 --save-model llmc,llmc-bf16,hf-bf16 -o "$dir/d" >/dev/null
convert() { build/convert_model -q -i "$dir/$1" -o "$dir/$2" -f "$3"; }
convert a/model.bin conv/hf hf
convert a/hf conv/model.bin llmc
convert a/hf conv/model_bf16.bin llmc-bf16
convert d/model_bf16.bin conv/hf_bf16 hf-bf16
for pair in a/model.bin:d/model.bin a/model.bin:conv/model.bin a/hf/model.safetensors:conv/hf/model.safetensors \
        a/hf/config.json:conv/hf/config.json d/model_bf16.bin:conv/model_bf16.bin \
        d/hf_bf16/model.safetensors:conv/hf_bf16/model.safetensors d/hf_bf16/config.json:conv/hf_bf16/config.json; do
    cmp -s "$dir/${pair%%:*}" "$dir/${pair#*:}" || { echo "FAIL: ${pair#*:} differs from ${pair%%:*}"; exit 1; }
done
for m in model_bf16.bin hf_bf16; do ./train_gpt2 "${common[@]}" -e "$dir/d/$m" -x 0 -o "$dir/r_$m" >/dev/null; done
python3 - "$trained" "$(val_of "$dir/r_model_bf16.bin")" "$(val_of "$dir/r_hf_bf16")" <<'PY' || exit 1
import sys
fp32, bin16, hf16 = map(float, sys.argv[1:])
if bin16 != hf16 or abs(bin16 - fp32) > 2e-3:
    print("FAIL: val loss %.9g from model_bf16.bin, %.9g from hf_bf16/, expected one value within 2e-3 of fp32's %.9g"
          % (bin16, hf16, fp32)); sys.exit(1)
print("exports load back: fp32 val loss %.9g exactly, bf16 %.9g from both formats" % (fp32, bin16))
PY
# What the files hold, by a reader written here from the formats' specifications (llm.c's header and
# tensor order; safetensors; transformers' GPT-2 names, with Conv1D weights stored (in, out)), so that a
# bug our writer and reader share (two tensors swapped, a transpose left out on both sides) fails too:
# every file holds the trained weights, the bf16 ones rounded to nearest even.
python3 - "$dir" <<'PY' || exit 1
import json, struct, sys
from array import array
d = sys.argv[1]
L, NH, C, V, Vp, T = 2, 2, 32, 97, 128, 32
def fail(msg):
    print("FAIL:", msg); sys.exit(1)
def bf16(values):  # fp32 -> bf16 bits, rounded to nearest even (no NaN here)
    return array("H", [((u + 0x7fff + ((u >> 16) & 1)) >> 16) & 0xffff for u in array("I", values.tobytes())])
# llm.c's model file: 256 int32 (magic 20240326, version 3 = fp32 or 5 = bf16, maxT, V, L, NH, C, Vp, then
# zeros) and these tensors back to back, weights (out, in), wte with Vp rows.
layout = [("wte", Vp * C), ("wpe", T * C), ("ln1w", L * C), ("ln1b", L * C), ("qkvw", L * 3 * C * C), ("qkvb", L * 3 * C),
          ("attprojw", L * C * C), ("attprojb", L * C), ("ln2w", L * C), ("ln2b", L * C), ("fcw", L * 4 * C * C),
          ("fcb", L * 4 * C), ("fcprojw", L * 4 * C * C), ("fcprojb", L * C), ("lnfw", C), ("lnfb", C)]
def llmc_file(name, version):
    b = open("%s/%s" % (d, name), "rb").read()
    header = struct.unpack("<256i", b[:1024])
    if header[:8] != (20240326, version, T, V, L, NH, C, Vp) or any(header[8:]):
        fail("%s: header %s, expected %s" % (name, header[:8], (20240326, version, T, V, L, NH, C, Vp)))
    data = array("f" if version == 3 else "H", b[1024:])
    if len(data) != sum(n for _, n in layout): fail("%s: %d parameters" % (name, len(data)))
    tensors, at = {}, 0
    for key, n in layout:
        tensors[key], at = data[at:at + n], at + n
    return tensors
p = llmc_file("a/model.bin", 3)
if any(p["wte"][V * C:]): fail("model.bin: the padded rows of wte are not zero")
if any(llmc_file("d/model_bf16.bin", 5)[k] != bf16(p[k]) for k, _ in layout): fail("model_bf16.bin is not model.bin in bf16")
# transformers' GPT-2 state dict (as save_pretrained writes it: "transformer." names, no tied lm_head).
def transposed(a, rows, cols):  # (rows, cols) -> (cols, rows)
    return array("f", [a[r * cols + c] for c in range(cols) for r in range(rows)])
want = {"wte.weight": ([V, C], p["wte"][:V * C]), "wpe.weight": ([T, C], p["wpe"]), "ln_f.weight": ([C], p["lnfw"]),
        "ln_f.bias": ([C], p["lnfb"])}
for l in range(L):
    part = lambda key, n: p[key][l * n:(l + 1) * n]
    for hf, key, n in (("ln_1.weight", "ln1w", C), ("ln_1.bias", "ln1b", C), ("attn.c_attn.bias", "qkvb", 3 * C),
                       ("attn.c_proj.bias", "attprojb", C), ("ln_2.weight", "ln2w", C), ("ln_2.bias", "ln2b", C),
                       ("mlp.c_fc.bias", "fcb", 4 * C), ("mlp.c_proj.bias", "fcprojb", C)):
        want["h.%d.%s" % (l, hf)] = ([n], part(key, n))
    for hf, key, rows, cols in (("attn.c_attn.weight", "qkvw", 3 * C, C), ("attn.c_proj.weight", "attprojw", C, C),
                                ("mlp.c_fc.weight", "fcw", 4 * C, C), ("mlp.c_proj.weight", "fcprojw", C, 4 * C)):
        want["h.%d.%s" % (l, hf)] = ([cols, rows], transposed(part(key, rows * cols), rows, cols))
def hf_folder(name, dtype, torch_dtype, stored):
    config = json.load(open("%s/%s/config.json" % (d, name)))
    for key, value in (("model_type", "gpt2"), ("n_layer", L), ("n_head", NH), ("n_embd", C), ("n_positions", T),
                       ("vocab_size", V), ("activation_function", "gelu_new"), ("layer_norm_epsilon", 1e-5),
                       ("tie_word_embeddings", True), ("torch_dtype", torch_dtype)):
        if config.get(key) != value: fail("%s/config.json: %s is %r, expected %r" % (name, key, config.get(key), value))
    b = open("%s/%s/model.safetensors" % (d, name), "rb").read()
    n = struct.unpack("<Q", b[:8])[0]  # the JSON header's length, then the header, then the data
    header = json.loads(b[8:8 + n])
    header.pop("__metadata__", None)
    names = set("transformer." + k for k in want)
    if set(header) != names: fail("%s: tensors %s missing, %s not expected" % (name, names - set(header), set(header) - names))
    for key, (shape, values) in want.items():
        t = header["transformer." + key]
        begin, end = t["data_offsets"]
        got = array("f" if dtype == "F32" else "H", b[8 + n + begin:8 + n + end])
        if t["dtype"] != dtype or t["shape"] != shape or got != stored(values):
            fail("%s: tensor %s (%s %s) does not hold the trained model's (%s %s)" % (name, key, t["dtype"], t["shape"],
                                                                                     dtype, shape))
hf_folder("a/hf", "F32", "float32", lambda values: values)
hf_folder("d/hf_bf16", "BF16", "bfloat16", bf16)
print("model.bin, model_bf16.bin, hf/ and hf_bf16/ hold the trained weights, read by the formats' specifications: ok")
PY
# -x 0 into the training run's own folder keeps that run's log: its records are appended after an
# evaluation_of line.
cp "$dir/a/log.jsonl" "$dir/a_log_before"
./train_gpt2 "${common[@]}" -e "$dir/a/model.bin" -x 0 -g 4 --prompt-ids 5,38 -o "$dir/a" >"$dir/ax0.out" 2>&1
n=$(wc -c <"$dir/a_log_before")
cmp -s "$dir/a_log_before" <(head -c "$n" "$dir/a/log.jsonl") &&
    [ "$(tail -n +$(($(wc -l <"$dir/a_log_before") + 1)) "$dir/a/log.jsonl" | head -n 1)" = "{\"evaluation_of\":\"$dir/a/model.bin\"}" ] &&
    grep -q '"step":0,"sample"' "$dir/a/log.jsonl" && grep -q "holds an earlier run's records" "$dir/ax0.out" ||
    { echo "FAIL: -x 0 into a trained folder must keep its log and append after an evaluation_of line"; cat "$dir/ax0.out"; tail -3 "$dir/a/log.jsonl"; exit 1; }
# A Hugging Face export of this 97-token model next to a --vocab-dir of GPT-2's 50257-token tokenizer
# (made here: the sizes are what counts): the folder without tokenizer files, and a note saying why.
mkdir -p "$dir/gpt2tok"
python3 -c 'import json, sys; json.dump({"t%d" % i: i for i in range(50257)}, open(sys.argv[1], "w"))' "$dir/gpt2tok/encoder.json"
echo "#version: 0.2" >"$dir/gpt2tok/vocab.bpe"
./train_gpt2 "${common[@]}" -e "$dir/a/model.bin" -x 0 -v 0 --save-model hf --vocab-dir "$dir/gpt2tok" -o "$dir/h" >"$dir/h.out" 2>&1 ||
    { echo "FAIL: the Hugging Face export of a 97-token model with GPT-2's tokenizer at hand"; cat "$dir/h.out"; exit 1; }
grep -q "encoder.json' has 50257 tokens, the model's vocabulary 97: the Hugging Face export gets no tokenizer files" "$dir/h.out" &&
    [ -f "$dir/h/hf/model.safetensors" ] && [ ! -e "$dir/h/hf/vocab.json" ] ||
    { echo "FAIL: the export must go through without tokenizer files, with a note"; cat "$dir/h.out"; ls "$dir/h/hf"; exit 1; }

# Gradient accumulation: two batches of 4 per step see the samples one batch of 8 sees, so the first
# loss and norm agree to rounding, and the runs stay together. A large epsilon makes AdamW's update
# depend on the gradient's scale (it is otherwise nearly blind to it), so a wrong 1/2 shows.
short=("${common[@]}" "${tiny[@]}" -x 5 -v 0 -l 3e-3 --eps 0.01 -o)
./train_gpt2 "${short[@]}" "$dir/e" -b 8 >/dev/null
./train_gpt2 "${short[@]}" "$dir/f" -b 4 -d 128 >"$dir/log_f"
grep -q "2 micro-step(s) per step" "$dir/log_f" || { echo "FAIL: -d 128 with B*T = 64 does not run two micro-steps"; exit 1; }
python3 - "$dir" <<'PY' || exit 1
import json, sys
d = sys.argv[1]
e, f = ([json.loads(l) for l in open("%s/%s/log.jsonl" % (d, r))] for r in ("e", "f"))
for x, y in zip(e, f):
    for k, tol in (("loss", 1e-5), ("norm", 1e-4 * x["norm"])):
        if abs(x[k] - y[k]) > tol:
            print("FAIL: step %d: %s %.9g with B=8, %.9g with B=4 -d 128" % (x["step"], k, x[k], y[k])); sys.exit(1)
print("-d 128 (two batches of 4) matches one batch of 8 over 5 steps")
PY

# The error comes after the lines printed before it, also when stdout and stderr share a pipe (where
# stdout is fully buffered): here a note on -g, then a data error.
./train_gpt2 -i "$dir/none_*.bin" -j "" "${tiny[@]}" -b 2 -t 8 -g 40 -o "" 2>&1 | cat >"$dir/log_order" || true
python3 - "$dir/log_order" <<'PY' || exit 1
import sys
lines = open(sys.argv[1]).read().splitlines()
note = [i for i, l in enumerate(lines) if l.startswith("note: -g/--gen-tokens 40")]
err = [i for i, l in enumerate(lines) if l.startswith("error: no shard file matches")]
if len(note) != 1 or len(err) != 1 or err[0] < note[0]:
    print("FAIL: expected the note, then the error:"); print("\n".join(lines)); sys.exit(1)
print("the error follows the note printed before it in a shared pipe: ok")
PY

source test/script_lib.sh
expect_bin=(./train_gpt2)
flags=(-i "$dir/syn_train_*.bin" -j "" "${tiny[@]}" -b 2 -t 8 -x 1 -o "")
expect_exit 4 "not below the vocabulary size 97" -i "$dir/bad_train_*.bin" -j "" "${tiny[@]}" -b 2 -t 8 -x 300 -o ""
expect_exit 2 "no shard file matches '$dir/none_\*.bin'" "${flags[@]}" -i "$dir/none_*.bin"
expect_exit 2 "needs all of --layers" --layers 2 -o ""
expect_exit 2 "not both" "${flags[@]}" -e d2
expect_exit 2 "unknown flag '--bogus'" --bogus 1
expect_exit 2 "flag --batch-size: '0' is not an integer from 1 to 65536" --batch-size 0
expect_exit 2 "flag -l: 'fast' is not a number" -l fast
expect_exit 2 "flag -t needs a value" -t
expect_exit 2 "flag --final-lr-fraction: '2' is not a number from 0 to 1" --final-lr-fraction 2
expect_exit 2 "-m/--val-max-steps 0" -m 0
expect_exit 2 "unknown learning rate schedule 'step'" -k step
expect_exit 2 "unknown model format 'gguf'" "${flags[@]}" --save-model gguf
expect_exit 2 "unexpected argument 'stray'" stray
expect_exit 0 "usage: train_gpt2 \[flags\]" --help
expect_exit 0 "-q, --final-lr-fraction <float> .* from 0 to 1" --help
expect_exit 2 "longer than the model's maximum sequence length 32" "${flags[@]}" -t 33
expect_exit 2 "not a multiple of B\*T = 2\*8 = 16" "${flags[@]}" -d 24
expect_exit 2 "--prompt-ids: token 97 is outside the model's vocabulary \[0, 97)" "${flags[@]}" -g 4 --prompt-ids 1,97
expect_exit 2 "'x' is not a token id" "${flags[@]}" -g 4 --prompt-ids 1,x
expect_exit 3 "-e/--model '$dir/missing.bin': No such file or directory" -e "$dir/missing.bin" -o ""
expect_exit 2 "unknown model descriptor 'd5'" -e d5 -o ""
echo "ok"
