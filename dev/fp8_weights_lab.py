#!/usr/bin/env python3
"""Do the weights' FP8 copies, rounded to nearest, hold a run back late, where stochastic rounding would
not? On the CPU: the same small training run with its matmul weights read through E4M3 copies (per-tensor
scale kMax / amax, as llmc/fp8.cuh casts them) rounded as each scheme says, everything else in fp32, over
several seeds, and each run's final weights scored in an fp32 forward on the text they trained on.

    python3 dev/fp8_weights_lab.py [--tokens 8192] [--steps 600] [--model d2] [-B 8] [-T 64] [--lr 2e-3]
                                   [--schemes fp32,e4m3,e4m3-sr,e4m3-act,e4m3-all] [--seeds 1,2,3] [--shard PATH]

Why: on the GPU, d12's FP8 run (`--fp8 all,qkv.grad.delayed`) ends with a training loss ~0.04 above
bf16's, and its final weights are that much worse in a bf16 forward too (docs/performance.md, "Worse
weights, not a noisier forward"). Late in a run AdamW's steps (lr decayed) are ~100x smaller than an E4M3
step of a weight (3 mantissa bits), so a copy rounded to nearest stays where it is for many steps while
the master weight moves; rounded stochastically, the copy is the weight on average.

What it found, and what the GPU said (docs/lab-notes.md, "Which FP8 matmuls cost the loss"): the copies'
rounding alone costs about the GPU's gap in two seeds of three, and stochastic rounding does not win it back.
The GPU agreed: the trainer built with stochastically rounded weight copies (branch fp8-weights-sr, not
merged) trained d12 to the same weights' loss as round to nearest (3.5193 against 3.5190 on the training
shards), and the blocks' forward in FP8 (qkv, fc, fcproj) is most of the gap.

Schemes: fp32 (no copies); e4m3 (round to nearest even, saturating, subnormals kept); e4m3-sr (stochastic
rounding, fresh random bits every step). The copies replace qkv's, fc's and fcproj's weights and the
classifier's wte in the forward (the matmuls `--fp8 all` runs with FP8 weights; attproj's forward stays
bf16 there and fp32 here; the embedding reads wte as it is), and the gradients flow to the fp32 weights as
if the copies were the weights (the GPU's dW reads activations and output gradients only). e4m3-act rounds
the same matmuls' inputs instead (the LayerNorm outputs, the GELU output, the final LayerNorm's output;
each tensor at its own per-tensor scale, to nearest; the weights fp32), as FP8's forward does, and their
weight gradients read the rounded inputs, as the GPU's FP8 dW reads the kept E4M3 ones; e4m3-all rounds
both, the weights and the inputs (`--fp8 all`'s forward operands). The model is
dev/gpt2_torch.py's GPT-2 over the distinct tokens of the first --tokens of the shard, renumbered, read in
order epoch after epoch (a corpus small enough to memorise, as the quick-start corpus is for d12), AdamW
(betas 0.9/0.95, weight decay 0.1 on the matrices), warmup over the first tenth of the steps and cosine
decay to a tenth of the peak, as the README's d12 settings. A seed sets the initialisation and the
stochastic rounding's random stream; the data order is the same for all.

Prints the train loss per window of steps, each scheme's mean over the seeds and its difference from
fp32's, each seed's last-window difference, and the final weights' loss on the whole slice in an fp32
forward (the weights themselves, without the copies' rounding) and through the scheme's copies.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpt2_torch  # noqa: E402
from fp8_dlogits_lab import load_slice, new_small_model  # noqa: E402

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
QUANTIZED = ("qkvw", "fcw", "fcprojw", "lm_head")


def e4m3(y):
    """y rounded to E4M3: to nearest even on the bit pattern in the normal range (3 of fp32's 23 mantissa
    bits kept), to multiples of 2^-9 below 2^-6, saturating at +-448."""
    bits = y.contiguous().view(torch.int32)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).view(torch.float32)
    sub = torch.round(y * 512.0) / 512.0  # torch.round rounds half to even
    return torch.where(y.abs() < E4M3_MIN_NORMAL, sub, normal).clamp(-E4M3_MAX, E4M3_MAX)


def e4m3_stochastic(y, gen):
    """y rounded to one of its two E4M3 neighbours, the upper with probability (y - lower) / (upper -
    lower): random bits added below the kept mantissa, then cut (the rule of fp8_quantize_sr on the branch
    fp8-weights-sr)."""
    bits = y.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 20, y.shape, generator=gen, dtype=torch.int32)
    normal = ((bits + noise) & ~0xFFFFF).view(torch.float32)
    u = torch.rand(y.shape, generator=gen)
    sub = torch.sign(y) * torch.floor(y.abs() * 512.0 + u) / 512.0
    return torch.where(y.abs() < E4M3_MIN_NORMAL, sub, normal).clamp(-E4M3_MAX, E4M3_MAX)


SCHEMES = ("fp32", "e4m3", "e4m3-sr", "e4m3-act", "e4m3-all")


def rounded(t, stochastic, gen):
    """t's E4M3 copy at the per-tensor scale kMax / amax, in the forward; the gradient goes to t itself
    (straight through)."""
    with torch.no_grad():
        amax = t.abs().max()
        scale = E4M3_MAX / amax if amax > 0 else torch.tensor(1.0)
        y = t * scale
        q = (e4m3_stochastic(y, gen) if stochastic else e4m3(y)) / scale
    return t + (q - t).detach()


def copies(scheme, gen):
    """gpt2_torch.forward's (weight, act) hooks for a scheme: which matmul operands are read through E4M3
    copies (None: as they are)."""
    if scheme not in SCHEMES:
        raise SystemExit(f"unknown scheme {scheme}; one of {', '.join(SCHEMES)}")
    if scheme == "fp32":
        return None, None

    def weight(name, w):
        return rounded(w, scheme == "e4m3-sr", gen) if name in QUANTIZED else w

    def act(name, x):
        return rounded(x, False, gen) if name in QUANTIZED else x

    return (None if scheme == "e4m3-act" else weight), (act if scheme in ("e4m3-act", "e4m3-all") else None)


def lr_at(step, a):
    warmup = max(1, a.steps // 10)
    if step < warmup:
        return a.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, a.steps - warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def batch(tokens, step, a):
    per_step = a.B * a.T
    at = (step % ((len(tokens) - 1) // per_step)) * per_step
    chunk = torch.from_numpy(tokens[at:at + per_step + 1].astype(np.int64))
    return chunk[:-1].view(a.B, a.T), chunk[1:].view(a.B, a.T)


def slice_loss(P, c, tokens, a, hooks):
    """The mean loss over every batch of the slice, without gradients."""
    with torch.no_grad():
        n = (len(tokens) - 1) // (a.B * a.T)
        return float(np.mean([gpt2_torch.forward(P, c, *batch(tokens, s, a), *hooks)[1].item()
                              for s in range(n)]))


def train(scheme, seed, tokens, V, a):
    c, P0 = new_small_model(a.model, V, a.T, seed=seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    hooks = copies(scheme, gen)
    P = {k: v.clone().requires_grad_(True) for k, v in P0.items()}
    decayed = [P[k] for k in gpt2_torch.NAMES if k in gpt2_torch.DECAYED]
    rest = [P[k] for k in gpt2_torch.NAMES if k not in gpt2_torch.DECAYED]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a)
        x, y = batch(tokens, step, a)
        _, loss = gpt2_torch.forward(P, c, x, y, *hooks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        opt.step()
        losses.append(loss.item())
    fp32_forward = slice_loss(P, c, tokens, a, (None, None))
    own_forward = slice_loss(P, c, tokens, a, copies(scheme, torch.Generator().manual_seed(5)))
    print(f"  {scheme} seed {seed}: last {a.window} steps {np.mean(losses[-a.window:]):.4f}, final weights on the "
          f"slice {fp32_forward:.4f} (fp32 forward), {own_forward:.4f} (its copies)", flush=True)
    return np.array(losses), fp32_forward, own_forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--model", default="d2")
    ap.add_argument("-B", type=int, default=8)
    ap.add_argument("-T", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--shard", default="data/quickstart_train_000000.bin")
    ap.add_argument("--schemes", default="fp32,e4m3,e4m3-sr")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--window", type=int, default=100)
    a = ap.parse_args()
    schemes = a.schemes.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    tokens, V = load_slice(a.shard, a.tokens, a.B, a.T)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"{a.model}, {len(tokens) - 1} tokens of {V} distinct ({(len(tokens) - 1) // (a.B * a.T)} steps an "
          f"epoch), B={a.B} T={a.T}, {a.steps} steps, peak lr {a.lr}, seeds {seeds}")
    runs = {s: [train(s, seed, tokens, V, a) for seed in seeds] for s in schemes}
    ref = runs.get("fp32")
    w = a.window
    print(f"\ntrain loss, mean over each {w} steps and the seeds" + (" (difference from fp32's)" if ref else ""))
    print("steps      " + " ".join(f"{s:>22s}" for s in runs))
    for start in range(0, a.steps, w):
        cells = []
        for s, rs in runs.items():
            m = np.mean([r[0][start:start + w].mean() for r in rs])
            d = np.mean([r[0][start:start + w].mean() for r in ref]) if ref else None
            cells.append(f"{m:8.4f}" + (f" ({m - d:+.4f})" if ref else ""))
        print(f"{start + 1:4d}-{min(start + w, a.steps):<5d} " + " ".join(f"{x:>22s}" for x in cells))
    print("\nper seed: last window's train loss - fp32's; final weights on the slice, fp32 forward - fp32 run's")
    for s, rs in runs.items():
        if not ref or s == "fp32":
            continue
        last = [r[0][-w:].mean() - f[0][-w:].mean() for r, f in zip(rs, ref)]
        final = [r[1] - f[1] for r, f in zip(rs, ref)]
        print(f"  {s:>8s}: train " + " ".join(f"{x:+.4f}" for x in last) + f" (mean {np.mean(last):+.4f});"
              f" weights " + " ".join(f"{x:+.4f}" for x in final) + f" (mean {np.mean(final):+.4f})")


if __name__ == "__main__":
    main()
