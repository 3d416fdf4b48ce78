#!/usr/bin/python3
"""Hugging Face folders between PyTorch/numpy and our converter, checked from the Python side.

A tiny random GPT-2 is built in PyTorch in transformers' layout (Conv1D weights stored (in, out), tanh
GELU, tied lm_head), without transformers: the state dict has GPT2LMHeadModel's names and the forward
below is GPT-2's. Then:
  1. it is written by hand (json + numpy, not our code) as a Hugging Face folder: F32, prefixed names,
     lm_head and the boolean attention-mask buffers older transformers saved; and as a second folder
     with unprefixed names, F16 and BF16 tensors, in two shards with model.safetensors.index.json;
  2. build/convert_model converts each to an llm.c model file, which is read here with numpy and
     compared tensor by tensor with the PyTorch tensors (transposed where Conv1D; F16/BF16 exactly as
     PyTorch converts them), padded vocabulary rows zero;
  3. build/convert_model converts the llm.c file back to folders (hf, hf-bf16), parsed here with json and
     numpy: header length a multiple of 8, metadata {"format": "pt"}, names, dtypes, shapes, and values
     equal to the source (bf16: PyTorch's round to nearest even), config.json's keys;
  4. build/gpt2_cpu_dump runs the CPU reference model (cpu/gpt2_cpu.h) on the imported model: its loss
     and logits on a few tokens agree with this file's PyTorch forward within 1e-5 in fp32 and 1e-12 in
     fp64;
  5. build/convert_model refuses bad input with the README's exit code and a message naming the file and
     key or tensor: a missing input, a link loop, an unknown format, NaN or infinite weights (nothing
     written), a number beyond double's range in config.json, a key twice in a safetensors entry.
Prints one line per check. Exit status 0 when all pass, 1 otherwise.

Usage: /usr/bin/python3 test/oracles/model_io_torch.py --convert build/convert_model --dump build/gpt2_cpu_dump
           [--workdir DIR]
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

CFG = dict(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=67)
VP = 128  # 67 padded to a multiple of 128
B, T = 3, 11
OUR_ORDER = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
             "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]
# our tensor -> (Hugging Face name inside a block or at top level, Conv1D?)
HF_OF = {"ln1w": ("ln_1.weight", False), "ln1b": ("ln_1.bias", False),
         "qkvw": ("attn.c_attn.weight", True), "qkvb": ("attn.c_attn.bias", False),
         "attprojw": ("attn.c_proj.weight", True), "attprojb": ("attn.c_proj.bias", False),
         "ln2w": ("ln_2.weight", False), "ln2b": ("ln_2.bias", False),
         "fcw": ("mlp.c_fc.weight", True), "fcb": ("mlp.c_fc.bias", False),
         "fcprojw": ("mlp.c_proj.weight", True), "fcprojb": ("mlp.c_proj.bias", False)}

failures = []


def check(what, ok, detail=""):
    """detail: a measurement shown always, or (a list or dict) what differs, shown when not empty."""
    if not isinstance(detail, str):
        detail = str(detail) if detail else ""
    print(f"{'ok  ' if ok else 'FAIL'} {what}{(': ' + detail) if detail else ''}")
    if not ok:
        failures.append(what)


def make_state_dict(seed):
    """GPT2LMHeadModel's state dict for CFG, random values (LayerNorm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    L, C, V, maxT = CFG["n_layer"], CFG["n_embd"], CFG["vocab_size"], CFG["n_positions"]
    rnd = lambda *shape, s=0.1: s * torch.randn(*shape, generator=g)
    sd = {"transformer.wte.weight": rnd(V, C), "transformer.wpe.weight": rnd(maxT, C)}
    for l in range(L):
        h = f"transformer.h.{l}."
        sd[h + "ln_1.weight"] = 1 + rnd(C, s=0.2)
        sd[h + "ln_1.bias"] = rnd(C)
        sd[h + "attn.c_attn.weight"] = rnd(C, 3 * C)
        sd[h + "attn.c_attn.bias"] = rnd(3 * C)
        sd[h + "attn.c_proj.weight"] = rnd(C, C)
        sd[h + "attn.c_proj.bias"] = rnd(C)
        sd[h + "ln_2.weight"] = 1 + rnd(C, s=0.2)
        sd[h + "ln_2.bias"] = rnd(C)
        sd[h + "mlp.c_fc.weight"] = rnd(C, 4 * C)
        sd[h + "mlp.c_fc.bias"] = rnd(4 * C)
        sd[h + "mlp.c_proj.weight"] = rnd(4 * C, C)
        sd[h + "mlp.c_proj.bias"] = rnd(C)
    sd["transformer.ln_f.weight"] = 1 + rnd(C, s=0.2)
    sd["transformer.ln_f.bias"] = rnd(C)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def forward(sd, idx):
    """GPT-2 as transformers computes it: Conv1D is x @ W + b with W stored (in, out)."""
    L, NH, C = CFG["n_layer"], CFG["n_head"], CFG["n_embd"]
    Bn, Tn = idx.shape
    HS = C // NH
    p = lambda name: sd["transformer." + name]
    conv1d = lambda x, name: x @ p(name + ".weight") + p(name + ".bias")
    x = p("wte.weight")[idx] + p("wpe.weight")[:Tn]
    mask = torch.tril(torch.ones(Tn, Tn, dtype=torch.bool))
    for l in range(L):
        h = F.layer_norm(x, (C,), p(f"h.{l}.ln_1.weight"), p(f"h.{l}.ln_1.bias"), 1e-5)
        q, k, v = conv1d(h, f"h.{l}.attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(Bn, Tn, NH, HS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HS)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(Bn, Tn, C)
        x = x + conv1d(y, f"h.{l}.attn.c_proj")
        h = F.layer_norm(x, (C,), p(f"h.{l}.ln_2.weight"), p(f"h.{l}.ln_2.bias"), 1e-5)
        x = x + conv1d(gelu_new(conv1d(h, f"h.{l}.mlp.c_fc")), f"h.{l}.mlp.c_proj")
    x = F.layer_norm(x, (C,), p("ln_f.weight"), p("ln_f.bias"), 1e-5)
    return x @ sd["lm_head.weight"].T


# ---- safetensors by hand ------------------------------------------------------------------------------

def raw_of(t, dtype):
    """(safetensors dtype, little-endian bytes) of a torch tensor stored as dtype."""
    if dtype == "F32":
        return t.detach().to(torch.float32).numpy().astype("<f4").tobytes()
    if dtype == "F16":
        return t.detach().to(torch.float16).numpy().astype("<f2").tobytes()
    if dtype == "BF16":
        return t.detach().to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    if dtype == "BOOL":
        return t.numpy().astype(np.bool_).tobytes()
    raise ValueError(dtype)


def write_safetensors(path, entries):
    """entries: list of (name, dtype, shape, bytes), laid out in that order."""
    header, blobs, offset = {}, [], 0
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    """(header dict, {name: float32 array}) parsed with json and numpy only."""
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base, out = 8 + n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        raw = data[base + begin:base + end]
        if e["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif e["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {e['dtype']}")
        out[name] = a.reshape(e["shape"])
    return header, out, n


def transformers_like_config(**extra):
    c = dict(CFG, architectures=["GPT2LMHeadModel"], model_type="gpt2", n_ctx=CFG["n_positions"], n_inner=None,
             activation_function="gelu_new", layer_norm_epsilon=1e-05, attn_pdrop=0.1, embd_pdrop=0.1,
             resid_pdrop=0.1, initializer_range=0.02, scale_attn_weights=True, use_cache=True,
             bos_token_id=50256, eos_token_id=50256, summary_type="cls_index", torch_dtype="float32",
             transformers_version="4.30.0")
    c.update(extra)
    return c


def write_folder(d, entries_by_file, config, index=None):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for fname, entries in entries_by_file.items():
        write_safetensors(os.path.join(d, fname), entries)
    if index is not None:
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)


# ---- llm.c model files by hand -------------------------------------------------------------------------

def read_llmc(path):
    data = open(path, "rb").read()
    h = np.frombuffer(data[:1024], dtype="<i4")
    body = data[1024:]
    if h[1] == 3:
        flat = np.frombuffer(body, dtype="<f4")
    else:
        flat = (np.frombuffer(body, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    L, C, maxT = CFG["n_layer"], CFG["n_embd"], CFG["n_positions"]
    shapes = {"wte": (VP, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C), "qkvw": (L, 3 * C, C),
              "qkvb": (L, 3 * C), "attprojw": (L, C, C), "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C),
              "fcw": (L, 4 * C, C), "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
              "lnfw": (C,), "lnfb": (C,)}
    out, pos = {}, 0
    for name in OUR_ORDER:
        n = int(np.prod(shapes[name]))
        out[name] = flat[pos:pos + n].reshape(shapes[name])
        pos += n
    return h[:8].tolist(), out, pos == flat.size


def expected_ours(sd):
    """Our tensors from a GPT2LMHeadModel state dict (fp32 numpy), written out independently of our code."""
    L, V, C = CFG["n_layer"], CFG["vocab_size"], CFG["n_embd"]
    g = lambda name: sd["transformer." + name].detach().to(torch.float32).numpy()
    wte = np.zeros((VP, C), dtype=np.float32)
    wte[:V] = g("wte.weight")
    out = {"wte": wte, "wpe": g("wpe.weight"), "lnfw": g("ln_f.weight"), "lnfb": g("ln_f.bias")}
    for ours, (hf, conv) in HF_OF.items():
        out[ours] = np.stack([g(f"h.{l}.{hf}").T if conv else g(f"h.{l}.{hf}") for l in range(L)])
    return out


def rounded(sd, dtype_of):
    """The state dict as the reader sees it when tensor `name` is stored as dtype_of(name)."""
    conv = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    return {n: t.to(conv[dtype_of(n)]).to(torch.float32) for n, t in sd.items()}


def compare_llmc(path, sd, what):
    h, ours, exact_size = read_llmc(path)
    check(f"{what}: header magic, version 3, maxT V L NH C Vp",
          h == [20240326, 3, CFG["n_positions"], CFG["vocab_size"], CFG["n_layer"], CFG["n_head"], CFG["n_embd"], VP],
          str(h))
    check(f"{what}: file size is the header plus every parameter", exact_size)
    exp = expected_ours(sd)
    bad = [n for n in OUR_ORDER if not np.array_equal(ours[n], exp[n])]
    check(f"{what}: all 16 tensors equal PyTorch's (Conv1D transposed, vocabulary padded with zero rows)",
          not bad, bad)


def run(cmd, expect_rc=0, expect_text=None):
    r = subprocess.run(cmd, capture_output=True, text=True)
    ok = r.returncode == expect_rc and (expect_text is None or expect_text in r.stdout + r.stderr)
    if not ok:
        print(f"command {' '.join(cmd)} exited {r.returncode} (expected {expect_rc}"
              f"{', with ' + repr(expect_text) if expect_text else ''}):\n{r.stdout}{r.stderr}")
    return ok, r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--convert", required=True, help="path to build/convert_model")
    ap.add_argument("--dump", required=True, help="path to build/gpt2_cpu_dump")
    ap.add_argument("--workdir", help="where to put the files (default: a temporary directory)")
    args = ap.parse_args()
    wd = args.workdir or tempfile.mkdtemp(prefix="model_io_torch_")
    os.makedirs(wd, exist_ok=True)
    f = lambda *p: os.path.join(wd, *p)
    conv = lambda *a, **k: run([args.convert, "-q"] + list(a), **k)

    sd = make_state_dict(seed=5)
    L, maxT = CFG["n_layer"], CFG["n_positions"]

    # 1. Folder A: one F32 file as an older transformers saved it: prefixed names, lm_head, mask buffers.
    mask = torch.tril(torch.ones(maxT, maxT, dtype=torch.bool)).view(1, 1, maxT, maxT)
    entries = [(n, "F32", tuple(t.shape), raw_of(t, "F32")) for n, t in sd.items()]
    for l in range(L):
        entries.append((f"transformer.h.{l}.attn.bias", "BOOL", tuple(mask.shape), raw_of(mask, "BOOL")))
        entries.append((f"transformer.h.{l}.attn.masked_bias", "F32", (), raw_of(torch.tensor(-1e4), "F32")))
    write_folder(f("A"), {"model.safetensors": entries}, transformers_like_config())

    # Folder B: unprefixed names, F16 and BF16, two shards and an index; no lm_head.
    dtype_of = lambda n: "F16" if ("mlp" in n or "wte" in n) else ("BF16" if "attn" in n else "F32")
    names = [n for n in sd if n != "lm_head.weight"]
    short = lambda n: n[len("transformer."):]
    files = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    write_folder(f("B"), {fn: [(short(n), dtype_of(n), tuple(sd[n].shape), raw_of(sd[n], dtype_of(n))) for n in ns]
                          for fn, ns in files.items()},
                 transformers_like_config(torch_dtype="float16"),
                 index={"metadata": {"total_size": 0},
                        "weight_map": {short(n): fn for fn, ns in files.items() for n in ns}})

    # 2. Folders -> llm.c files, read back here.
    ok, _ = conv("-i", f("A"), "-o", f("A.bin"))
    check("convert_model: folder A (F32, buffers, lm_head) -> llm.c file", ok)
    if ok:
        compare_llmc(f("A.bin"), sd, "A.bin")
    ok, _ = conv("-i", f("B"), "-o", f("B.bin"), "-f", "llmc")
    check("convert_model: folder B (F16/BF16, sharded, unprefixed) -> llm.c file", ok)
    if ok:
        compare_llmc(f("B.bin"), rounded(sd, lambda n: dtype_of(n) if n != "lm_head.weight" else "F32"), "B.bin")

    # 3. llm.c file -> folders, parsed here.
    for fmt, dtype in (("hf", "F32"), ("hf-bf16", "BF16")):
        out = f("C_" + fmt)
        ok, _ = conv("-i", f("A.bin"), "-o", out, "-f", fmt)
        check(f"convert_model: A.bin -> {fmt} folder", ok)
        if not ok:
            continue
        header, tensors, n = read_safetensors(os.path.join(out, "model.safetensors"))
        check(f"{fmt}: header length {n} is a multiple of 8", n % 8 == 0)
        check(f"{fmt}: __metadata__ is {{\"format\": \"pt\"}}", header.get("__metadata__") == {"format": "pt"})
        src = {k: v for k, v in sd.items() if k != "lm_head.weight"}
        check(f"{fmt}: the tensor names are GPT2LMHeadModel's, no lm_head (tied)", set(tensors) == set(src),
              sorted(set(tensors) ^ set(src)))
        check(f"{fmt}: every dtype is {dtype}",
              all(e["dtype"] == dtype for k, e in header.items() if k != "__metadata__"))
        spans = sorted(e["data_offsets"] for k, e in header.items() if k != "__metadata__")
        check(f"{fmt}: the data section is covered exactly, no gaps or overlaps",
              spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and
              8 + n + spans[-1][1] == os.path.getsize(os.path.join(out, "model.safetensors")))
        want = {k: (v.to(torch.bfloat16).to(torch.float32) if dtype == "BF16" else v).numpy() for k, v in src.items()}
        bad = [k for k in src if k in tensors and not (tensors[k].shape == want[k].shape and
                                                         np.array_equal(tensors[k], want[k]))]
        check(f"{fmt}: every tensor equals the source{' rounded by PyTorch to bf16' if dtype == 'BF16' else ''}",
              not bad, bad)
        config = json.load(open(os.path.join(out, "config.json")))
        want_config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": L,
                       "n_head": CFG["n_head"], "n_embd": CFG["n_embd"], "n_positions": maxT, "n_ctx": maxT,
                       "vocab_size": CFG["vocab_size"], "activation_function": "gelu_new",
                       "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
                       "torch_dtype": "float32" if dtype == "F32" else "bfloat16"}
        wrong = {k: config.get(k) for k, v in want_config.items() if config.get(k) != v}
        check(f"{fmt}: config.json holds GPT-2's keys with the unpadded vocabulary", not wrong, wrong)

    # 4. The CPU reference model on the imported folder against PyTorch.
    g = torch.Generator().manual_seed(77)
    batches = [(torch.randint(0, CFG["vocab_size"], (B, T), generator=g),
                torch.randint(0, CFG["vocab_size"], (B, T), generator=g)) for _ in range(2)]
    with open(f("tokens.bin"), "wb") as fh:
        fh.write(np.array([B, T, len(batches)], dtype=np.int32).tobytes())
        for inputs, targets in batches:
            fh.write(inputs.to(torch.int32).numpy().tobytes())
            fh.write(targets.to(torch.int32).numpy().tobytes())
    for precision, dtype, tol in (("fp32", torch.float32, 1e-5), ("fp64", torch.float64, 1e-12)):
        out = f(f"dump_{precision}.bin")
        cmd = [args.dump, "--model", f("A.bin"), "--tokens", f("tokens.bin"), "--out", out, "--steps", "1"]
        ok, _ = run(cmd + (["--fp64"] if precision == "fp64" else []))
        check(f"gpt2_cpu_dump runs the imported model ({precision})", ok)
        if not ok:
            continue
        d = np.fromfile(out, dtype=np.float64)
        loss, logits = d[0], d[1:1 + B * T * VP].reshape(B, T, VP)
        sdt = {k: v.to(dtype) for k, v in sd.items()}
        ref_logits = forward(sdt, batches[0][0])
        ref_loss = F.cross_entropy(ref_logits.reshape(-1, CFG["vocab_size"]), batches[0][1].reshape(-1)).item()
        ref = ref_logits.detach().double().numpy()
        rel = np.abs(logits[..., :CFG["vocab_size"]] - ref).max() / np.abs(ref).max()
        check(f"{precision}: our loss {loss:.9f} vs PyTorch {ref_loss:.9f} within {tol:g}",
              abs(loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), f"difference {abs(loss - ref_loss):.3e}")
        check(f"{precision}: logits agree within {tol:g} (relative)", rel <= tol, f"{rel:.3e}")
        check(f"{precision}: padded logits are zero", np.all(logits[..., CFG['vocab_size']:] == 0))

    # 5. Command-line errors: exit codes and the file or tensor named.
    ok, _ = conv("-i", f("nothing"), "-o", f("x.bin"), expect_rc=3, expect_text="does not exist")
    check("missing input: exit 3, 'does not exist'", ok)
    ok, _ = conv("-i", f("A.bin"), "-o", f("x"), "-f", "gguf", expect_rc=2, expect_text="'gguf'")
    check("unknown format: exit 2", ok)
    bad = [(n, "F32", (7,) if n.endswith("ln_f.bias") else tuple(t.shape), raw_of(t, "F32")) for n, t in sd.items()]
    write_folder(f("bad"), {"model.safetensors": bad}, transformers_like_config())
    ok, _ = conv("-i", f("bad"), "-o", f("x.bin"), expect_rc=4, expect_text="transformer.ln_f.bias")
    check("shape that does not match its offsets: exit 4 naming the tensor", ok)
    write_folder(f("relu"), {"model.safetensors": entries}, transformers_like_config(activation_function="relu"))
    ok, _ = conv("-i", f("relu"), "-o", f("x.bin"), expect_rc=4, expect_text="activation_function")
    check("activation_function relu: exit 4 naming the key", ok)
    # Bad input the JSON library or the weights would let through: refused, and nothing written.
    nan_sd = dict(sd, **{"transformer.h.1.mlp.c_fc.weight": sd["transformer.h.1.mlp.c_fc.weight"].clone()})
    nan_sd["transformer.h.1.mlp.c_fc.weight"][3, 5] = float("nan")
    write_folder(f("nan"), {"model.safetensors": [(n, "F32", tuple(t.shape), raw_of(t, "F32"))
                                                  for n, t in nan_sd.items()]}, transformers_like_config())
    ok, _ = conv("-i", f("nan"), "-o", f("nan.bin"), expect_rc=4,
                 expect_text="1 parameter is not finite (NaN or infinity): 1 in tensor "
                             "'transformer.h.1.mlp.c_fc.weight'")
    check("NaN weight in a folder: exit 4 naming the tensor and the count, no file written",
          ok and not os.path.exists(f("nan.bin")))
    raw = bytearray(open(f("A.bin"), "rb").read())
    raw[1024 + 4 * 7:1024 + 4 * 8] = struct.pack("<f", float("inf"))
    open(f("inf.bin"), "wb").write(raw)
    ok, _ = conv("-i", f("inf.bin"), "-o", f("inf_hf"), expect_rc=4,
                 expect_text="1 in tensor wte, the first at offset 1052")
    check("infinite weight in an llm.c file: exit 4 naming the tensor and offset, no folder written",
          ok and not os.path.exists(f("inf_hf")))
    write_folder(f("overflow"), {"model.safetensors": entries}, transformers_like_config())
    with open(f("overflow", "config.json"), "w") as fh:
        fh.write(json.dumps(transformers_like_config()).replace('"initializer_range": 0.02',
                                                               '"initializer_range": 1e999'))
    ok, _ = conv("-i", f("overflow"), "-o", f("x.bin"), expect_rc=4,
                 expect_text="config.json': key 'initializer_range': number overflow")
    check("config.json number overflow: exit 4 naming the file and key", ok)
    write_folder(f("dup"), {"model.safetensors": entries}, transformers_like_config())
    st = open(f("dup", "model.safetensors"), "rb").read()
    n = struct.unpack("<Q", st[:8])[0]
    header = st[8:8 + n].replace(b'"dtype": "F32"', b'"dtype": "I32", "dtype": "F32"', 1)
    with open(f("dup", "model.safetensors"), "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header + st[8 + n:])
    ok, _ = conv("-i", f("dup"), "-o", f("x.bin"), expect_rc=4, expect_text="key 'dtype' appears twice")
    check("safetensors entry with dtype twice: exit 4", ok)
    os.symlink("loop", f("loop"))
    ok, _ = conv("-i", f("loop"), "-o", f("x.bin"), expect_rc=3, expect_text="Too many levels of symbolic links")
    check("symbolic link loop as input: exit 3 with the system's reason", ok)
    ok, r = run([args.convert, "--help"])
    check("--help prints the flags", ok and "--tokenizer-dir" in r.stdout)

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
