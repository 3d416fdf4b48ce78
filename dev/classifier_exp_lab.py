#!/usr/bin/env python3
"""The classifier's input gradient d(lnf) three ways, on the CPU, against an fp64 reference: how much
precision a classifier without a dlogits pass would keep (docs/lab-notes.md, the bf16 classifier).

  today     dlogits = bf16(dloss (softmax - onehot)), then d(lnf) = dlogits @ wte (fp32 sums)
  exp       Y = bf16(e^(x - c)) with the target column in it, s = sum of e^(x - c) (fp32), then
            d(lnf) = (dloss / s) (Y @ wte) - dloss wte[target]; c is fixed before the logits are known,
            so it is not the row max: here c = max - u, u uniform in [0, --offset) per row (with
            --offset 0, c is the max, and a target that is the max has Y_t = 1 exactly); with
            --c-target, c = x_t, the target's own logit (Y_t = 1 exactly, and Y <= 1 / p_t)
  exp-notgt the same with Y's target column stored as 0 and its coefficient dloss (p_t - 1) formed in
            fp32 from the sum of the other columns (the tail): dloss (p_t - 1) = -dloss tail / s, and
            d(lnf) = (dloss / s) (Y @ wte) - dloss (tail / s) wte[target]

  today-bf16 today's d(lnf) rounded to bf16, as the trainer stores it
  built     as the trainer's exp forward does it (llmc/classifier_sm90.cuh, --classifier-exp 1): c = x_t,
            Y's target column bf16(1 - s) = bf16(-tail), d(lnf) = bf16(bf16(Y @ wte) * dloss / s) (the
            matmul's bf16 output, then the row scale); compare with today-bf16

Rows are drawn with the target's probability p_t set (0.5, 0.9, 0.99, 0.999, 0.99999): the logits are
Gaussian (sd 2, GPT-2-like spread) with the target's logit raised until softmax gives p_t (with --spread,
1 - p_t varies by up to 2x either way from row to row: with one p_t for every row, a bf16 rounding of a
value set by p_t, such as a target coefficient, errs by the same amount in every row, so a column's
median can fall anywhere between 0 and 2^-8 by luck). wte is Gaussian (sd 0.02). Prints each scheme's
error relative to the reference's norm, the median over rows.

  python3 dev/classifier_exp_lab.py [--rows 64] [--vocab 50257] [--channels 768] [--seed 0]
                                    [--offset 4 | --c-target] [--spread]
"""
import argparse

import numpy as np


def bf16(a):
    """Rounds float32 values to the nearest bf16 (ties to even), returned as float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def rows_with_target_probability(rng, rows, vocab, p_t, spread=False):
    """Logits (rows, vocab) float32 and targets whose softmax probability is p_t (to fp64 accuracy); with
    spread, each row's 1 - p_t is 1 - p_t times a log-uniform factor in [1/2, 2] (so that a bf16 rounding of
    a p_t-dependent value is not the same in every row)."""
    x = rng.normal(0.0, 2.0, size=(rows, vocab))
    targets = rng.integers(0, vocab, size=rows)
    for i, t in enumerate(targets):
        others = np.delete(x[i], t)
        m = others.max()
        rest = np.exp(others - m).sum()
        p = 1.0 - (1.0 - p_t) * 2.0 ** rng.uniform(-1.0, 1.0) if spread else p_t
        # p = e^(x_t - m) / (e^(x_t - m) + rest)  =>  x_t = m + log(p rest / (1 - p))
        x[i, t] = m + np.log(p * rest / (1.0 - p))
    return x.astype(np.float32), targets


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offset", type=float, default=4.0, help="c = row max - uniform [0, offset)")
    ap.add_argument("--c-target", action="store_true", help="c = the target's logit instead")
    ap.add_argument("--spread", action="store_true", help="each row's 1 - p_t times a factor in [1/2, 2]")
    args = ap.parse_args()
    if args.rows < 1 or args.vocab < 2 or args.channels < 1 or not args.offset >= 0:
        ap.error("--rows and --channels must be >= 1, --vocab >= 2, --offset >= 0")
    rng = np.random.default_rng(args.seed)
    wte = bf16(rng.normal(0.0, 0.02, size=(args.vocab, args.channels)).astype(np.float32))
    dloss = 1.0 / 65536.0
    where = "the target's logit" if args.c_target else f"the row max - [0, {args.offset})"
    print(f"rows {args.rows}, vocab {args.vocab}, channels {args.channels}, seed {args.seed}, c = {where}"
          + (", 1 - p_t spread over [1/2, 2]x per row" if args.spread else ""))
    print(f"{'p_t':>7} | {'today':>10} | {'exp':>10} | {'exp-notgt':>10} | {'today-bf16':>10} | {'built':>10}"
          "   (median |error| / |reference| over rows)")
    for p_t in (0.5, 0.9, 0.99, 0.999, 0.99999):
        x, targets = rows_with_target_probability(rng, args.rows, args.vocab, p_t, args.spread)
        rows = np.arange(args.rows)
        # The reference in fp64 from the same bf16-exact logits.
        xd = x.astype(np.float64)
        e = np.exp(xd - xd.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        g = p.copy()
        g[rows, targets] -= 1.0
        ref = (dloss * g) @ wte.astype(np.float64)

        # today: bf16 dlogits (formed in fp32), fp32 matmul.
        x32 = x.astype(np.float32)
        m32 = x32.max(axis=1, keepdims=True)
        e32 = np.exp(x32 - m32)
        s32 = e32.sum(axis=1, keepdims=True, dtype=np.float32)
        d32 = e32 * (np.float32(dloss) / s32)
        d32[rows, targets] -= np.float32(dloss)
        today = bf16(d32) @ wte

        # exp: Y in bf16 with the target column, at an offset c below the row max.
        # (drawn with --c-target too, so that both modes see the same rows)
        c = m32 - rng.uniform(0.0, args.offset, size=(args.rows, 1)).astype(np.float32)
        if args.c_target:
            c = x32[rows, targets][:, None]
        ec = np.exp(x32 - c)
        sc = ec.sum(axis=1, keepdims=True, dtype=np.float32)
        Y = bf16(ec)
        scale = np.float32(dloss) / sc
        exp_all = scale * (Y @ wte) - np.float32(dloss) * wte[targets]

        # exp-notgt: Y's target column 0; the sum kept as the target's term and the rest (the tail), so
        # that the coefficient dloss (p_t - 1) = -dloss tail / s is formed in fp32 without cancellation.
        Y0 = Y.copy()
        Y0[rows, targets] = 0.0
        ec0 = ec.copy()
        ec0[rows, targets] = 0.0
        tail = ec0.sum(axis=1, dtype=np.float32)
        s0 = ec[rows, targets] + tail
        scale0 = (np.float32(dloss) / s0)[:, None]
        coef = -np.float32(dloss) * tail / s0
        exp_notgt = scale0 * (Y0 @ wte) + coef[:, None] * wte[targets]

        # built: as the trainer's exp forward does it (llmc/classifier_sm90.cuh): c = x_t, Y's target column
        # = bf16(1 - s) = bf16(-tail), the matmul's d(lnf) rounded to bf16 and then scaled by dloss / s in
        # bf16; today's path rounds its d(lnf) to bf16 once (today-bf16).
        cb = x32[rows, targets][:, None]
        eb = np.exp(x32 - cb)
        eb[rows, targets] = 0.0
        tail_b = eb.sum(axis=1, dtype=np.float32)
        Yb = bf16(eb)
        Yb[rows, targets] = bf16(-tail_b)
        scale_b = (np.float32(dloss) / (np.float32(1.0) + tail_b))[:, None]
        built = bf16(bf16(Yb @ wte) * scale_b)

        norm = np.linalg.norm(ref, axis=1)
        err = [np.median(np.linalg.norm(v.astype(np.float64) - ref, axis=1) / norm)
               for v in (today, exp_all, exp_notgt, bf16(today), built)]
        print(f"{p_t:>7} | {err[0]:>10.2e} | {err[1]:>10.2e} | {err[2]:>10.2e} | {err[3]:>10.2e} | {err[4]:>10.2e}")


if __name__ == "__main__":
    main()
