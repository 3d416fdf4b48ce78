#!/usr/bin/env python3
"""How the classifier's dlogits may be put into E5M2, on the CPU: the same small training run with
the dlogits rounded as each scheme would round them, everything else in fp32, so that only that
rounding differs. It asks the question the GPU's FP8 classifier backward (llmc/gpt2.cuh, --fp8
lm_head.grad) raises, without a GPU: where does E5M2's coarseness hurt training?

    python3 dev/fp8_dlogits_lab.py [--tokens 16384] [--steps 800] [--model d2] [-B 8] [-T 64] [--lr 1e-3]
                                   [--schemes fp32,e5m2,softmax-e5m2,target-exact] [--sr-seed 7]
                                   [--plot out.png]

Schemes (dlogits = (softmax - onehot) * dloss, dloss = 1 / (B T); E5M2 at the static scale 57344 / dloss,
round to nearest even, saturating, subnormals kept, as __nv_cvt_float_to_fp8 does):
  fp32          no rounding (the reference);
  bf16          every dlogit rounded to bf16, as the bf16 trainer stores them (the control: how far a
                small rounding alone moves this run);
  e5m2          every dlogit in E5M2 (what 171c761 ships);
  softmax-e5m2  softmax * dloss in E5M2 and the one-hot term (-dloss) exact (7131c91, reverted);
  target-exact  the target's whole dlogit (p - 1) * dloss exact, every other column in E5M2;
  e5m2-stochastic  every dlogit in E5M2 by stochastic rounding (unbiased: a near-uniform softmax's values
                sit at the same place between two E5M2 neighbours, so rounding to nearest moves them all
                the same way);
  e5m2-stochastic-target-exact  the two together.
The model is dev/gpt2_torch.py's GPT-2 (d2 by default: 2 layers, 128 channels) over the distinct tokens
of the data, renumbered (a few thousand, so that a CPU runs it in minutes), the data the first --tokens
tokens of data/quickstart_train_000000.bin, read in order epoch after epoch (a small corpus, so that the
run memorises it and the targets' probabilities approach 1, the regime where 7131c91 failed), AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 on the matrices), the same seed for
every scheme. Prints each scheme's train loss averaged over windows of steps and its difference from
fp32's; --plot draws the per-step differences.
"""
import argparse
import sys

import numpy as np
import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
import gpt2_torch  # noqa: E402

E5M2_MAX = 57344.0


def e5m2(x):
    """x rounded to E5M2 (round to nearest even, saturating to +-57344, subnormals down to 2^-16): in the
    normal range by rounding fp32's 23 mantissa bits to 2 on the bit pattern, below 2^-14 to multiples
    of 2^-16."""
    bits = x.contiguous().view(torch.int32)
    lsb = (bits >> 21) & 1
    normal = ((bits + 0xFFFFF + lsb) & ~0x1FFFFF).view(torch.float32)
    sub = torch.round(x * 65536.0) / 65536.0  # torch.round rounds half to even
    return torch.where(x.abs() < 2.0 ** -14, sub, normal).clamp(-E5M2_MAX, E5M2_MAX)


def e5m2_stochastic(x, gen):
    """x rounded to one of its two E5M2 neighbours with probabilities that make the rounding unbiased
    (stochastic rounding), saturating; subnormals likewise on multiples of 2^-16."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 21, x.shape, generator=gen, dtype=torch.int32)
    normal = ((bits + noise) & ~0x1FFFFF).view(torch.float32)
    u = torch.rand(x.shape, generator=gen)
    sub = torch.sign(x) * torch.floor(x.abs() * 65536.0 + u) / 65536.0
    return torch.where(x.abs() < 2.0 ** -14, sub, normal).clamp(-E5M2_MAX, E5M2_MAX)


SR_GEN = torch.Generator().manual_seed(7)


def rounded_dlogits(g, targets, V, scheme):
    """The gradient of the mean loss with respect to the logits (N, Vp), as the scheme stores it."""
    if scheme == "fp32":
        return g
    dloss = 1.0 / g.shape[0]
    scale = E5M2_MAX / dloss
    rows = torch.arange(g.shape[0])
    if scheme == "e5m2":
        return e5m2(g * scale) / scale
    if scheme == "bf16":
        return g.to(torch.bfloat16).float()
    if scheme == "softmax-e5m2":
        softmax = g.clone()
        softmax[rows, targets] += dloss
        out = e5m2(softmax * scale) / scale
        out[rows, targets] -= dloss
        return out
    if scheme == "target-exact":
        out = e5m2(g * scale) / scale
        out[rows, targets] = g[rows, targets]
        return out
    if scheme == "e5m2-stochastic":
        return e5m2_stochastic(g * scale, SR_GEN) / scale
    if scheme == "e5m2-stochastic-target-exact":
        out = e5m2_stochastic(g * scale, SR_GEN) / scale
        out[rows, targets] = g[rows, targets]
        return out
    raise SystemExit(f"unknown scheme {scheme}")


def load_slice(shard, n_tokens, B, T):
    """The first n_tokens + 1 tokens of a token shard, their distinct values renumbered densely (a
    vocabulary of a few thousand instead of GPT-2's 50257, so that a CPU runs the model in minutes; what
    these labs measure, how rounding behaves as the targets' probabilities grow, does not depend on the
    vocabulary's size), and that vocabulary's size."""
    with open(shard, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype=np.int32)
        if header[0] != 20240520 or header[1] not in (1, 2):
            raise SystemExit(f"{shard}: not a token shard (magic {header[0]}, version {header[1]})")
        dtype = np.uint16 if header[1] == 1 else np.uint32
        tokens = np.frombuffer(f.read(), dtype=dtype)[:n_tokens + 1]
    if len(tokens) < B * T + 1:
        raise SystemExit(f"{shard}: {len(tokens)} tokens, fewer than one batch of {B} x {T}")
    vocab, tokens = np.unique(tokens, return_inverse=True)
    return tokens, len(vocab)


def new_small_model(model, V, T, seed):
    """The configuration of a model descriptor (d2 ..) over V tokens, and its parameters at GPT-2's
    initialisation (as gpt2_torch.new_model) from the given seed."""
    L, C, NH = gpt2_torch.DESCRIPTORS[model]
    c = dict(maxT=max(T, 64), V=V, L=L, NH=NH, C=C, Vp=(V + 127) // 128 * 128)
    g = torch.Generator().manual_seed(seed)
    P0 = {}
    for name, shape in gpt2_torch.shapes(c).items():
        if name in ("ln1w", "ln2w", "lnfw"):
            P0[name] = torch.ones(shape)
        elif name not in gpt2_torch.DECAYED:
            P0[name] = torch.zeros(shape)
        else:
            std = 0.02 / (2 * L) ** 0.5 if name in ("attprojw", "fcprojw") else 0.02
            P0[name] = torch.randn(shape, generator=g) * std
    P0["wte"][V:] = 0
    return c, P0


def train(scheme, c, P0, tokens, a):
    torch.manual_seed(0)
    P = {k: v.clone().requires_grad_(True) for k, v in P0.items()}
    decayed = [P[k] for k in gpt2_torch.NAMES if k in gpt2_torch.DECAYED]
    rest = [P[k] for k in gpt2_torch.NAMES if k not in gpt2_torch.DECAYED]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    per_step = a.B * a.T
    batches = (len(tokens) - 1) // per_step
    losses = []
    for step in range(a.steps):
        at = (step % batches) * per_step
        chunk = torch.from_numpy(tokens[at:at + per_step + 1].astype(np.int64))
        x, y = chunk[:-1].view(a.B, a.T), chunk[1:].view(a.B, a.T)
        logits, loss = gpt2_torch.forward(P, c, x, y)
        flat_targets = y.reshape(-1)
        logits.register_hook(lambda g: rounded_dlogits(g.reshape(-1, g.shape[-1]), flat_targets, c["V"],
                                                       scheme).view_as(g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"  {scheme}: step {step + 1}/{a.steps}, loss {np.mean(losses[-100:]):.4f}", flush=True)
    return np.array(losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--model", default="d2")
    ap.add_argument("-B", type=int, default=8)
    ap.add_argument("-T", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--shard", default="data/quickstart_train_000000.bin")
    ap.add_argument("--schemes", default="fp32,e5m2,softmax-e5m2,target-exact")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--sr-seed", type=int, default=7, help="the stochastic roundings' random stream")
    ap.add_argument("--plot")
    a = ap.parse_args()
    SR_GEN.manual_seed(a.sr_seed)
    tokens, V = load_slice(a.shard, a.tokens, a.B, a.T)
    torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))
    c, P0 = new_small_model(a.model, V, a.T, seed=1)
    print(f"{a.model}, {len(tokens) - 1} tokens of {V} distinct ({(len(tokens) - 1) // (a.B * a.T)} steps an epoch), "
          f"B={a.B} T={a.T}, {a.steps} steps, lr {a.lr}")
    runs = {s: train(s, c, P0, tokens, a) for s in a.schemes.split(",")}
    ref = runs.get("fp32")
    w = a.window
    print(f"\ntrain loss, mean over each {w} steps" + (" (difference from fp32's)" if ref is not None else ""))
    print("steps      " + " ".join(f"{s:>22s}" for s in runs))
    for start in range(0, a.steps, w):
        cells = []
        for s, l in runs.items():
            m = l[start:start + w].mean()
            cells.append(f"{m:8.4f}" + (f" ({m - ref[start:start + w].mean():+.4f})" if ref is not None else ""))
        print(f"{start + 1:4d}-{min(start + w, a.steps):<5d} " + " ".join(f"{x:>22s}" for x in cells))
    if a.plot and ref is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        k = np.ones(20) / 20
        for s, l in runs.items():
            if s != "fp32":
                ax.plot(np.arange(20, a.steps + 1), np.convolve(l - ref, k, mode="valid"), label=s)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss - fp32's (20-step mean)")
        ax.set_title(f"dlogits in E5M2, {a.model} on {len(tokens) - 1} tokens, CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
