"""GPT-2 in PyTorch, in llm.c's parameter layout: the one definition that the PyTorch reference trainer
(dev/train_gpt2_torch.py) and the check of the CPU reference model (test/oracles/gpt2_torch_ref.py) both
use, so that the model they compare against ours is the same model.

A configuration c is a dict with maxT, V, Vp, L, NH, C (llmc/gpt2_config.h's names); parameters P are a
dict of tensors named and shaped as llmc/gpt2_config.h's param_tensors().

Provides: NAMES (the 16 tensors in file order), DECAYED (those AdamW decays), DESCRIPTORS (d2 .. d48),
shapes(c), model_header(c, version), write_model(path, c, P, version) and load_model(path) (llm.c model
files, version 3 = fp32 and 5 = bf16), new_model(descriptor, seed) (GPT-2 initialisation, not bitwise
ours) and forward(P, c, idx, targets) -> (logits, loss): pre-LayerNorm blocks with epsilon 1e-5, causal
attention (PyTorch's fused kernel where it exists, else written out, as in Debian's torch 1.13), tanh
GELU, the classifier tied to wte, and a loss over the first V of the Vp logits, computed in at least fp32.

Not provided: data, optimizer or training loop (each script has its own).
"""
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
         "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]
DECAYED = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
DESCRIPTORS = {"d2": (2, 128, 2), "d6": (6, 384, 6), "d12": (12, 768, 12), "d24": (24, 1024, 16),
               "d36": (36, 1280, 20), "d48": (48, 1600, 25)}
MODEL_MAGIC = 20240326
LN_EPS = 1e-5


def shapes(c):
    L, C, Vp, maxT = c["L"], c["C"], c["Vp"], c["maxT"]
    return {"wte": (Vp, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C),
            "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C), "attprojw": (L, C, C), "attprojb": (L, C),
            "ln2w": (L, C), "ln2b": (L, C), "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
            "fcprojw": (L, C, 4 * C), "fcprojb": (L, C), "lnfw": (C,), "lnfb": (C,)}


def model_header(c, version):
    h = np.zeros(256, dtype=np.int32)
    h[:8] = [MODEL_MAGIC, version, c["maxT"], c["V"], c["L"], c["NH"], c["C"], c["Vp"]]
    return h.tobytes()


def write_model(path, c, P, version):
    """An llm.c model file: version 3 stores fp32, version 5 bf16 (PyTorch's rounding, to nearest even)."""
    with open(path, "wb") as f:
        f.write(model_header(c, version))
        for name in NAMES:
            t = P[name].detach().to(torch.float32).contiguous()
            if version == 3:
                f.write(t.numpy().tobytes())
            else:
                f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())


def load_model(path):
    with open(path, "rb") as f:
        raw = f.read()
    h = struct.unpack("<256i", raw[:1024])
    if h[0] != MODEL_MAGIC or h[1] not in (3, 5):
        sys.exit(f"{path}: not an llm.c model file of version 3 or 5 (magic {h[0]}, version {h[1]})")
    c = dict(maxT=h[2], V=h[3], L=h[4], NH=h[5], C=h[6], Vp=h[7] or h[3])
    dtype = np.float32 if h[1] == 3 else np.uint16
    data = np.frombuffer(raw, dtype=dtype, offset=1024)
    if h[1] == 5:  # bf16 bits are the top half of fp32
        data = (data.astype(np.uint32) << 16).view(np.float32)
    P, pos = {}, 0
    for name, shape in shapes(c).items():
        n = int(np.prod(shape))
        P[name] = torch.from_numpy(data[pos:pos + n].copy()).view(shape)
        pos += n
    if pos != data.size:
        sys.exit(f"{path}: {data.size} parameters, the header's shape needs {pos}")
    return c, P


def new_model(descriptor, seed):
    """GPT-2's initialisation (llmc/gpt2_config.h's distribution, drawn from PyTorch's generator)."""
    L, C, NH = DESCRIPTORS[descriptor]
    c = dict(maxT=1024, V=50257, L=L, NH=NH, C=C, Vp=50304)
    g = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape in shapes(c).items():
        if name in ("ln1w", "ln2w", "lnfw"):
            P[name] = torch.ones(shape)
        elif name not in DECAYED:
            P[name] = torch.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * L) if name in ("attprojw", "fcprojw") else 0.02
            P[name] = torch.randn(shape, generator=g) * std
    P["wte"][c["V"]:] = 0
    return c, P


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(HS) + causal mask) v over (B, NH, T, HS) tensors."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.size(-2)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device))
    att = (q @ k.transpose(-2, -1)) * (1.0 / q.size(-1) ** 0.5)
    return att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


def forward(P, c, idx, targets):
    """Logits (B, T, Vp) and the mean cross-entropy of the targets over the first V logits."""
    L, NH, C, V = c["L"], c["NH"], c["C"], c["V"]
    B, T = idx.shape
    x = F.embedding(idx, P["wte"]) + P["wpe"][:T]
    for l in range(L):
        h = F.layer_norm(x, (C,), P["ln1w"][l], P["ln1b"][l], LN_EPS)
        q, k, v = F.linear(h, P["qkvw"][l], P["qkvb"][l]).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, P["attprojw"][l], P["attprojb"][l])
        h = F.layer_norm(x, (C,), P["ln2w"][l], P["ln2b"][l], LN_EPS)
        h = F.gelu(F.linear(h, P["fcw"][l], P["fcb"][l]), approximate="tanh")
        x = x + F.linear(h, P["fcprojw"][l], P["fcprojb"][l])
    x = F.layer_norm(x, (C,), P["lnfw"], P["lnfb"], LN_EPS)
    logits = F.linear(x, P["wte"])
    real = logits[..., :V]
    if real.dtype in (torch.float16, torch.bfloat16):  # under autocast: the loss in fp32
        real = real.float()
    return logits, F.cross_entropy(real.reshape(-1, V), targets.reshape(-1))
