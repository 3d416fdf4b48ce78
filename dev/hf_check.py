#!/usr/bin/env python3
"""Hugging Face interoperability on a GPU machine: our trainers against transformers, PASS/FAIL lines.

Needs the built trainers (./train_gpt2cu, ./train_gpt2), the prepared data/ (quick-start shards), and
PyTorch with CUDA and transformers in python3. Sections (all by default, or --only a,b,c):
 (a) train_gpt2cu trains a d12 for --steps steps and exports it (--save-model llmc,hf): the folder loads
     in GPT2LMHeadModel.from_pretrained, and transformers' fp32 loss on the validation windows matches
     the trainer's last validation loss within --tol (the trainer computes in bf16); the trainer re-reads
     its own folder (-e DIR/hf -x 0) with the same validation loss as its model.bin, to the bit; and,
     when the export holds tokenizer files, AutoTokenizer encodes like tiktoken's GPT-2.
 (b) GPT2LMHeadModel is trained in PyTorch for --torch-steps steps on our training shards, for the d12
     shape and a smaller one (L=4, C=256, NH=4, n_positions=512, saved in 20 MB shards), and saved with
     save_pretrained; train_gpt2cu imports each (-e DIR -x 0) with a validation loss within --tol of
     transformers' fp32 loss; the CPU trainer (fp32) too, and within 1e-4 of transformers in float64 on its
     own windows.
 (c) greedy continuation of a prompt (the first 8 tokens of the validation shard) by the d12 of (b):
     the CPU trainer's --gen tokens equal transformers' greedy generate (both fp32); the GPU trainer's
     equal them or first differ at a near tie, reported with transformers' top-2 logit gap there.

Validation windows are computed as llmc/dataloader.h's DataLoader makes them without shuffling: the val
shards in name order, sample k of a shard = tokens [k*T, k*T + T + 1), samples concatenated across
shards, batch i = samples [i*B, i*B + B), min(-m, samples // B) batches; the loss is the mean over
batches of each batch's mean token loss.

Trainer flags used: -e -x 0 -o -j -v 1 -m -b -t -g --temperature 0 --prompt-ids (both trainers),
--save-model, -i -d -l -u -s (train_gpt2cu). Each run's log.jsonl lines {"step":S,"val_loss":X} and
{"step":S,"sample":[ids]} are read; a val loss printed as "val loss X" on stdout is the fallback.

Usage: python3 dev/hf_check.py [--work DIR] [--only a,b,c] [--steps 300] [--torch-steps 300]
Prints PASS/FAIL/SKIP lines and a summary; exit status 0 when nothing failed. Logs of every run are kept
in --work (default build/hf_check).
"""
import argparse
import contextlib
import glob
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np

results = []


def report(status, section, what, detail=""):
    results.append(status)
    line = f"{status:<4} ({section}) {what}{(' | ' + detail) if detail else ''}"
    print(line, flush=True)


def note(msg):
    print(f"     {msg}", flush=True)


# ---- data, exactly as the DataLoader reads it -----------------------------------------------------------

def read_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != 20240520 or header[1] not in (1, 2):
        sys.exit(f"{path}: not a token shard (magic {header[0]}, version {header[1]})")
    dtype = "<u2" if header[1] == 1 else "<u4"
    n = int(header[2]) | (int(header[3]) << 32 if header[1] == 2 else 0)
    tokens = np.fromfile(path, dtype=dtype, offset=1024)
    if tokens.size != n:
        sys.exit(f"{path}: header says {n} tokens, file holds {tokens.size}")
    return tokens


def val_windows(pattern, B, T, max_batches):
    """(inputs, targets) int64 arrays of shape (batches, B, T): the DataLoader's unshuffled batches."""
    samples = []
    for path in sorted(glob.glob(pattern)):
        tok = read_shard(path)
        for k in range((tok.size - 1) // T):
            samples.append(tok[k * T:k * T + T + 1])
    batches = len(samples) // B
    if max_batches != -1:
        batches = min(batches, max_batches)
    if batches < 1:
        sys.exit(f"{pattern}: {len(samples)} samples of T+1={T + 1} tokens, fewer than one batch of B={B}")
    s = np.stack(samples[:batches * B]).astype(np.int64).reshape(batches, B, T + 1)
    return s[..., :-1], s[..., 1:]


# ---- trainers ---------------------------------------------------------------------------------------------

def run(cmd, log, timeout):
    """Runs cmd with output to log; returns (ok, output text)."""
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(log).read()
    note(f"{os.path.basename(cmd[0])} exited {rc} after {time.time() - t0:.1f} s (log {log})")
    if rc != 0:
        note("last lines:\n" + "\n".join("       " + l for l in text.splitlines()[-25:]))
    return rc == 0, text


def read_log(out_dir, stdout):
    """(last val loss, last sample ids) from a run's log.jsonl, falling back to stdout for the loss."""
    val, sample = None, None
    path = os.path.join(out_dir, "log.jsonl")
    if os.path.exists(path):
        best = -1
        for line in open(path):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "val_loss" in rec and rec["val_loss"] is not None and rec.get("step", 0) >= best:
                best, val = rec.get("step", 0), float(rec["val_loss"])
            if "sample" in rec:
                sample = [int(t) for t in rec["sample"]]
    if val is None:
        found = re.findall(r"val loss:? *([0-9.]+(?:e-?[0-9]+)?)\s*$", stdout, flags=re.M)
        if found:
            val = float(found[-1])
    return val, sample


def trainer_eval(args, binary, model, out_dir, B, T, val_batches, extra=(), gen=None, prompt=None):
    """Runs a trainer with -e model -x 0: validation (and a greedy sample); returns (val, sample)."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [binary, "-e", model, "-x", "0", "-o", out_dir, "-j", args.val, "-v", "1", "-m", str(val_batches),
           "-b", str(B), "-t", str(T)] + list(extra)
    if gen:
        cmd += ["-g", str(gen), "--temperature", "0", "--prompt-ids", ",".join(str(t) for t in prompt)]
    ok, text = run(cmd, os.path.join(out_dir, "run.log"), args.timeout)
    return read_log(out_dir, text) if ok else (None, None)


# ---- transformers side ------------------------------------------------------------------------------------

class HF:
    def __init__(self, device):
        import torch
        import transformers
        self.torch, self.transformers, self.device = torch, transformers, device
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        self.major = int(transformers.__version__.split(".")[0])

    def release(self):
        """Hands cached GPU memory back, so the trainers run next have it."""
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    def load(self, path):
        """GPT2LMHeadModel in fp32 with the plain attention (the reference computation), and the names of
        the checkpoint's tensors transformers did not use or did not find (None where it cannot say)."""
        kw = {"dtype" if self.major >= 5 else "torch_dtype": self.torch.float32, "attn_implementation": "eager"}
        cls = self.transformers.GPT2LMHeadModel
        try:
            m, info = cls.from_pretrained(path, output_loading_info=True, **kw)
            # The tied head and the attention-mask buffers are not weights of the checkpoint.
            ignore = lambda k: k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias"))
            unused = [k for k in list(info.get("missing_keys", [])) + list(info.get("unexpected_keys", []))
                      if not ignore(k)]
        except TypeError:
            m, unused = cls.from_pretrained(path, **kw), None
        return m.float().to(self.device).eval(), unused

    def loss(self, model, inputs, targets):
        """Mean over batches of each batch's mean token loss, in fp32 (fp64 for a float64 model)."""
        torch = self.torch
        losses = []
        with torch.no_grad():
            for x, y in zip(inputs, targets):
                logits = model(torch.from_numpy(x).to(self.device)).logits
                logits = logits.double() if logits.dtype == torch.float64 else logits.float()
                losses.append(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), torch.from_numpy(y).to(self.device).reshape(-1)).item())
        return float(np.mean(losses))

    def greedy(self, model, prompt, n):
        """n greedy tokens after prompt, one forward per token, with the top-2 logit gap of each step; and
        what generate(do_sample=False) gives."""
        torch = self.torch
        ids = torch.tensor([prompt], device=self.device)
        out, gaps = [], []
        with torch.no_grad():
            for _ in range(n):
                logits = model(ids).logits[0, -1].float()
                top = torch.topk(logits, 2)
                out.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
            # No end-of-text stop, so that it makes n tokens as the trainers do.
            g = model.generate(torch.tensor([prompt], device=self.device), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return out, gaps, [int(t) for t in g[0, len(prompt):].tolist()]


def train_torch_model(hf, shape, train_pattern, steps, B, T, seed, out_dir, max_shard_size=None):
    """A GPT2LMHeadModel of shape (L, NH, C, n_positions) trained on the shards in file order (windows of
    B*T+1 tokens) with AdamW and bf16 autocast, saved with save_pretrained; returns the last train loss."""
    torch, transformers = hf.torch, hf.transformers
    L, NH, C, maxT = shape
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=L, n_head=NH, n_embd=C, n_positions=maxT, vocab_size=50257,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(hf.device).train()
    tokens = np.concatenate([read_shard(p) for p in sorted(glob.glob(train_pattern))]).astype(np.int64)
    per_step = B * T
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    t0, loss = time.time(), float("nan")
    for step in range(steps):
        lr = 1e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        start = (step * per_step) % (tokens.size - per_step - 1)
        buf = torch.from_numpy(tokens[start:start + per_step + 1]).to(hf.device)
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        on_gpu = hf.device == "cuda"
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext():
            logits = model(x).logits
        loss_t = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            loss = loss_t.item()
            note(f"torch {L}x{C}: step {step + 1}/{steps} loss {loss:.4f} ({time.time() - t0:.1f} s)")
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    files = sorted(os.listdir(out_dir))
    note(f"saved {out_dir}: {', '.join(files)}")
    return loss


# ---- the sections -----------------------------------------------------------------------------------------

def section_a(args, hf):
    out = os.path.join(args.work, "a_train")
    B, T = args.batch, args.seq
    cmd = [args.trainer, "-e", args.a_model, "-i", args.train, "-j", args.val, "-b", str(B), "-t", str(T),
           "-d", str(B * T), "-x", str(args.steps), "-l", "1e-3", "-u", "30", "-v", str(args.steps),
           "-m", str(args.val_batches), "-s", "0", "-o", out, "--save-model", "llmc,hf"]
    ok, text = run(cmd, os.path.join(args.work, "a_train.log"), args.timeout)
    if not ok:
        return report("FAIL", "a", f"train_gpt2cu {args.a_model} {args.steps} steps with --save-model llmc,hf")
    ours, _ = read_log(out, text)
    hf_dir = os.path.join(out, "hf")
    if ours is None or not os.path.isdir(hf_dir):
        return report("FAIL", "a", "the training run left a validation loss and an hf/ folder",
                      f"val loss {ours}, {hf_dir} exists: {os.path.isdir(hf_dir)}")
    try:
        model, unused = hf.load(hf_dir)
    except Exception as e:  # any failure to load is the finding
        return report("FAIL", "a", f"GPT2LMHeadModel.from_pretrained({hf_dir})", repr(e))
    detail = ("this transformers does not report unused weights" if unused is None else
              f"missing or unexpected: {unused}" if unused else "")
    report("FAIL" if unused else "PASS", "a",
           f"GPT2LMHeadModel.from_pretrained loads the exported folder ({hf_dir}), every weight used and found",
           detail)
    inputs, targets = val_windows(args.val, B, T, args.val_batches)
    theirs = hf.loss(model, inputs, targets)
    diff = abs(theirs - ours)
    report("PASS" if diff <= args.tol else "FAIL", "a",
           f"val loss: train_gpt2cu {ours:.6f} (bf16) vs transformers {theirs:.6f} (fp32) on {len(inputs)} "
           f"batches of {B}x{T}", f"|diff| {diff:.2e}, tolerance {args.tol:g}")
    del model
    hf.release()

    again = {}
    for name, path in (("model.bin", os.path.join(out, "model.bin")), ("hf", hf_dir)):
        again[name], _ = trainer_eval(args, args.trainer, path, os.path.join(args.work, f"a_reload_{name}"), B, T,
                                      args.val_batches, extra=["-s", "0", "--save-model", "none"])
    same = again["hf"] is not None and again["hf"] == again["model.bin"]
    report("PASS" if same else "FAIL", "a", "train_gpt2cu -e OUT/hf -x 0 gives the val loss of -e OUT/model.bin",
           f"{again['hf']} vs {again['model.bin']}")

    if os.path.exists(os.path.join(hf_dir, "vocab.json")):
        text = "Hello world, this is GPT-2's tokenizer: 12345 tokens\n\n  with  spaces and ünïcode."
        try:
            from transformers import AutoTokenizer
            a = AutoTokenizer.from_pretrained(hf_dir).encode(text)
        except Exception as e:
            a = None
            report("FAIL", "a", "AutoTokenizer.from_pretrained on the export", repr(e))
        if a is not None:
            try:
                b = tiktoken_gpt2(os.path.join(hf_dir, "vocab.json")).encode(text)
                report("PASS" if a == b else "FAIL", "a", "AutoTokenizer on the export encodes like tiktoken gpt2",
                       "" if a == b else f"{a} vs {b}")
            except Exception as e:
                report("FAIL", "a", "tiktoken's GPT-2 encoding built from the export's vocab.json", repr(e))
    else:
        report("SKIP", "a", "tokenizer check: the export holds no vocab.json (no tokenizer directory given)")


def tiktoken_gpt2(vocab_json):
    """tiktoken's "gpt2" encoding built from a local encoder.json (vocab.json), without a download:
    GPT-2's ids are its BPE ranks, the token strings map back to bytes with GPT-2's byte-to-unicode table."""
    import tiktoken
    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pattern
    except ImportError:
        pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    byte_of, n = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            byte_of[chr(256 + n)] = b
            n += 1
    vocab = json.load(open(vocab_json, encoding="utf-8"))
    ranks = {bytes(byte_of[ch] for ch in tok): i for tok, i in vocab.items() if tok != "<|endoftext|>"}
    return tiktoken.Encoding("gpt2_local", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": vocab["<|endoftext|>"]})


def section_b(args, hf):
    made = {}
    for i, spec in enumerate(args.b_shapes.split(";")):
        shape = tuple(int(v) for v in spec.split(","))
        name = "d12" if shape == (12, 12, 768, 1024) else f"L{shape[0]}-C{shape[2]}"
        T, shard = min(shape[3], args.seq), (args.shard_size if i > 0 else None)
        d = os.path.join(args.work, f"b_torch_{name}")
        try:
            train_torch_model(hf, shape, args.train, args.torch_steps, args.batch, T, 1234, d, shard)
        except Exception as e:
            report("FAIL", "b", f"PyTorch training and save_pretrained of {name}", repr(e))
            continue
        made[name] = d
        model, _ = hf.load(d)
        for who, tag, binary, extra, B, T_eval, batches, tol in (
                ("train_gpt2cu", "gpu", args.trainer, ["-s", "0", "--save-model", "none"], args.batch, T,
                 args.val_batches, args.tol),
                ("train_gpt2 (CPU, fp32)", "cpu", args.cpu_trainer, [], 4, 64, 2, 1e-4)):
            if not os.path.exists(binary):
                report("SKIP", "b", f"{who}: {binary} not built")
                continue
            inputs, targets = val_windows(args.val, B, T_eval, batches)
            theirs = hf.loss(model, inputs, targets)
            ours, _ = trainer_eval(args, binary, d, os.path.join(args.work, f"b_{tag}_{name}"), B, T_eval, batches,
                                   extra=extra)
            if ours is None:
                report("FAIL", "b", f"{who} -e {d} -x 0 reports a validation loss")
                continue
            diff = abs(ours - theirs)
            report("PASS" if diff <= args.tol else "FAIL", "b",
                   f"{name}: {who} val loss {ours:.6f} vs transformers {theirs:.6f} ({len(inputs)} batches of "
                   f"{B}x{T_eval})", f"|diff| {diff:.2e}, tolerance {args.tol:g}")
            if tag == "cpu":
                # fp32 against fp32: both sides carry rounding of ~1e-6 relative in logits of magnitude ~100,
                # so the fp32 trainer is held to a tighter bound against transformers in float64.
                exact = hf.loss(model.double(), inputs, targets)
                model.float()
                diff64 = abs(ours - exact)
                report("PASS" if diff64 <= tol else "FAIL", "b",
                       f"{name}: {who} val loss {ours:.7f} vs transformers in float64 {exact:.7f}",
                       f"|diff| {diff64:.2e}, tolerance {tol:g}; transformers fp32 is {abs(theirs - exact):.2e} off")
        del model
        hf.release()
    return made


def section_c(args, hf, folder):
    prompt = [int(t) for t in read_shard(sorted(glob.glob(args.val))[0])[:8]]
    model, _ = hf.load(folder)
    ref, gaps, generated = hf.greedy(model, prompt, args.gen)
    del model
    note(f"prompt {prompt}; transformers greedy {ref}")
    report("PASS" if generated == ref else "FAIL", "c", "transformers' generate(do_sample=False) equals the "
           "argmax of its forward, token by token", "" if generated == ref else f"generate gave {generated}")
    for who, tag, binary, extra, must_match in (
            ("train_gpt2 (CPU, fp32)", "cpu", args.cpu_trainer, [], True),
            ("train_gpt2cu (bf16)", "gpu", args.trainer, ["--save-model", "none"], False)):
        if not os.path.exists(binary):
            report("SKIP", "c", f"{who}: {binary} not built")
            continue
        _, ours = trainer_eval(args, binary, folder, os.path.join(args.work, f"c_{tag}"), 1, 64, 1, extra=extra,
                               gen=args.gen, prompt=prompt)
        if ours is None:
            report("FAIL", "c", f"{who}: a sample in log.jsonl")
            continue
        if ours == ref:
            report("PASS", "c", f"{who}: {len(ours)} greedy tokens equal transformers'")
            continue
        first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        gap = gaps[first] if first < len(gaps) else float("nan")
        # bf16 may pick the runner-up where fp32's top two are closer than bf16's error on a logit.
        near_tie = not must_match and gap <= args.tie_gap
        report("PASS" if near_tie else "FAIL", "c",
               f"{who}: tokens {ours} vs transformers {ref}",
               f"first differ at {first}, where transformers' top-2 logit gap is {gap:.4f}"
               f"{' (a near tie)' if near_tie else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--trainer", default="./train_gpt2cu")
    ap.add_argument("--cpu-trainer", default="./train_gpt2")
    ap.add_argument("--train", default="data/quickstart_train_*.bin")
    ap.add_argument("--val", default="data/quickstart_val_*.bin")
    ap.add_argument("--work", default="build/hf_check", help="run directories and logs")
    ap.add_argument("--only", default="a,b,c", help="sections to run, e.g. a,c")
    ap.add_argument("--steps", type=int, default=300, help="(a) train_gpt2cu steps")
    ap.add_argument("--a-model", default="d12", help="(a) the model train_gpt2cu trains (-e)")
    ap.add_argument("--b-shapes", default="12,12,768,1024;4,4,256,512",
                    help="(b) models trained in PyTorch, L,NH,C,n_positions each; the later ones saved in shards; "
                         "(c) uses the first")
    ap.add_argument("--shard-size", default="20MB", help="(b) save_pretrained's max_shard_size after the first")
    ap.add_argument("--seq", type=int, default=1024, help="T of training and of the GPU validation windows")
    ap.add_argument("--torch-steps", type=int, default=300, help="(b) PyTorch steps per model")
    ap.add_argument("--batch", type=int, default=16, help="B of training and of the GPU validation windows")
    ap.add_argument("--val-batches", type=int, default=10, help="-m: validation batches compared")
    ap.add_argument("--gen", type=int, default=20, help="(c) greedy tokens")
    ap.add_argument("--tol", type=float, default=1e-3, help="bf16 trainer vs fp32 transformers val loss")
    ap.add_argument("--tie-gap", type=float, default=0.2, help="(c) top-2 logit gap under which bf16 may differ")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per trainer run")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    # A letter that names no section would run nothing and end "0 failed" with exit 0: refuse it.
    only = {s.strip() for s in args.only.split(",")}
    unknown = sorted(only - {"a", "b", "c"})
    if unknown:
        ap.error(f"--only: no section {', '.join(repr(s) for s in unknown)}; give some of a,b,c (e.g. a,c)")
    os.makedirs(args.work, exist_ok=True)
    if not glob.glob(args.val) or not glob.glob(args.train):
        sys.exit(f"no shards match {args.train} / {args.val}: prepare data/ first (make data)")
    t0 = time.time()
    try:
        hf = HF(args.device)
    except ImportError as e:
        sys.exit(f"cannot import PyTorch and transformers: {e}")
    print(f"transformers {hf.transformers.__version__}, torch {hf.torch.__version__}, device {args.device}")
    if "a" in only:
        section_a(args, hf)
    made = section_b(args, hf) if ("b" in only or "c" in only) else {}
    if "c" in only:
        if made:
            section_c(args, hf, next(iter(made.values())))
        else:
            report("FAIL", "c", "needs the first folder of (b), which was not made")
    counts = {s: results.count(s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"hf_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.time() - t0:.0f} s")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
