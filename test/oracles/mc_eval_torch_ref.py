#!/usr/bin/python3
"""PyTorch check of multiple-choice scoring (cpu/mc_eval_cpu.h, through build/eval_mc and the CPU model).

Writes a tiny GPT-2 (test/oracles/gpt2_torch_ref.py's model and model-file writer) and a set of random
items in llm.c's eval .bin layout, written here independently of our writer, the way llm.c's
dev/data/data_common.py write_evalfile lays it out (its K = 4 assert aside: items have 2 to 5 endings).
Some contexts are longer than the T the set is scored with, so the left-truncation rule is exercised:
kept = min(context, T + 1 - longest ending), the same for every candidate of an item.

PyTorch scores each item the way llm.c's dev/data/hellaswag.py does: the item's rows (kept context +
ending) padded into one batch, per-position cross-entropy against the next token, masked to the ending,
summed (acc: argmin of the sums) and divided by the ending's length (acc_norm: argmin of the means).
Compared with eval_mc's per-candidate sums: ours fp32 vs PyTorch fp32 within 1e-5 and ours fp64 vs
PyTorch fp64 within 1e-10 (relative to max(1, |sum|)); both predictions of every item whose two best
candidates are further apart than 1e-3, and the counts of right answers; and the acc and acc_norm that
eval_mc prints, each against its own PyTorch count (the set is one where the two differ, so a report that
swapped them would not pass).

Usage: /usr/bin/python3 test/oracles/mc_eval_torch_ref.py --eval-mc build/eval_mc [--workdir DIR]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch_ref as ref  # noqa: E402

CFG = dict(maxT=24, V=67, Vp=128, L=2, NH=4, C=32)
T = 20  # positions per row: rows of up to T + 1 tokens fit maxT
ITEMS = 14
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DECIDED = 1e-3


def random_items(seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    tokens = lambda n: torch.randint(0, CFG["V"], (n,), generator=g).tolist()
    items = []
    for _ in range(ITEMS):
        k = rand(2, 5)
        items.append({"ctx_tokens": tokens(rand(1, 30)), "ending_tokens": [tokens(rand(1, 7)) for _ in range(k)],
                      "label": rand(0, k - 1)})
    return items


def write_evalfile(path, items):
    """llm.c's eval .bin: 256 int32 of header, then per example a uint16 stream."""
    stream, longest = [], 0
    for idx, it in enumerate(items):
        ex = [2**16 - 1, 0, idx, it["label"], len(it["ending_tokens"]), len(it["ctx_tokens"])] + it["ctx_tokens"]
        for end in it["ending_tokens"]:
            ex += [len(end)] + end
        ex[1] = 2 * len(ex)
        longest = max(longest, ex[1])
        stream += ex
    header = np.zeros(256, dtype=np.int32)
    header[:4] = [20240522, 1, len(items), longest]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(stream, dtype=np.uint16).tobytes())


def torch_scores(P, items, dtype):
    """Per candidate: the sum of the ending's token losses, hellaswag.py's way."""
    P = {n: P[n].to(dtype) for n in ref.NAMES}
    sums = []
    for it in items:
        ends = it["ending_tokens"]
        kept = min(len(it["ctx_tokens"]), T + 1 - max(len(e) for e in ends))
        ctx = it["ctx_tokens"][len(it["ctx_tokens"]) - kept:]
        rows = [ctx + e for e in ends]
        width = max(len(r) for r in rows)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, e) in enumerate(zip(rows, ends)):
            tokens[i, :len(r)] = torch.tensor(r)
            mask[i, len(ctx):len(r)] = 1
        with torch.no_grad():
            logits, _ = ref.forward(P, CFG, tokens, tokens)
        logits = logits[..., :CFG["V"]]
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, CFG["V"]), tokens[:, 1:].reshape(-1), reduction="none")
        losses = losses.view(len(rows), -1) * mask[:, 1:]
        sums.append(losses.sum(dim=1).double().numpy())
    return sums


def read_scores(path):
    sums, preds = {}, {}
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.split("\t")
            if parts[0] == "pred":
                preds[int(parts[1])] = (int(parts[2]), int(parts[3]))
            else:
                sums[(int(parts[0]), int(parts[1]))] = (float(parts[3]), int(parts[4]))
    return sums, preds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-mc", required=True, help="path to the eval_mc binary")
    ap.add_argument("--workdir", help="where to put the files (default: a temporary directory)")
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="mc_eval_torch_")
    f = lambda name: os.path.join(workdir, name)
    P = ref.init_params(CFG, seed=4321)
    ref.write_model(f("model.bin"), CFG, P, 3)
    items = random_items(77)
    write_evalfile(f("items.bin"), items)
    cut = sum(1 for it in items if len(it["ctx_tokens"]) + max(map(len, it["ending_tokens"])) - 1 > T)

    failures = []
    for dtype, flag in ((torch.float32, []), (torch.float64, ["--fp64"])):
        name = str(dtype).replace("torch.", "")
        out = f(f"scores_{name}.tsv")
        run = subprocess.run([args.eval_mc, "--model", f("model.bin"), "--eval", f("items.bin"), "--seq", str(T),
                              "--batch", "5", "--scores", out] + flag, check=True, capture_output=True, text=True)
        print(run.stdout, end="")
        ours, preds = read_scores(out)
        theirs = torch_scores(P, items, dtype)
        worst, decided = 0.0, 0
        right = [0, 0]
        for i, it in enumerate(items):
            s = theirs[i]
            counts = np.array([len(e) for e in it["ending_tokens"]], dtype=np.float64)
            for c in range(len(s)):
                got, n = ours[(i, c)]
                if n != counts[c]:
                    failures.append(f"{name}: item {i} candidate {c}: {n} tokens, expected {int(counts[c])}")
                worst = max(worst, abs(got - s[c]) / max(1.0, abs(s[c])))
            for k, (scores, ours_pred) in enumerate(((s, preds[i][0]), (s / counts, preds[i][1]))):
                order = np.sort(scores)
                best = int(np.argmin(scores))  # the first of equal minima, as torch.argmin and llm.c
                right[k] += best == it["label"]
                if order[1] - order[0] > DECIDED:
                    decided += 1
                    if ours_pred != best:
                        failures.append(f"{name}: item {i} {'acc_norm' if k else 'acc'}: we pick {ours_pred}, "
                                        f"PyTorch {best} (margin {order[1] - order[0]:.3g})")
        ok = worst <= TOL[dtype]
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(items)} items ({cut} cut to T={T}), worst relative sum error "
              f"{worst:.3e} (tolerance {TOL[dtype]:.0e}); {decided} of {2 * len(items)} predictions decided; "
              f"PyTorch acc {right[0]}/{len(items)}, acc_norm {right[1]}/{len(items)}")
        if not ok:
            failures.append(f"{name}: worst relative error {worst:.3e} > {TOL[dtype]:.0e}")
        ours_right = [sum(preds[i][k] == it["label"] for i, it in enumerate(items)) for k in (0, 1)]
        if decided == 2 * len(items) and ours_right != right:
            failures.append(f"{name}: we count {ours_right} right, PyTorch {right}")
        # What eval_mc reports, each figure against its own count: PyTorch's where every prediction is
        # decided, else ours from the per-item predictions checked above.
        expected = right if decided == 2 * len(items) else ours_right
        m = re.search(r": (\d+) items, acc ([\d.]+) \((\d+)\), acc_norm ([\d.]+) \((\d+)\)$", run.stdout.strip())
        if not m:
            failures.append(f"{name}: eval_mc printed no acc/acc_norm line: {run.stdout!r}")
        else:
            for k, label in enumerate(("acc", "acc_norm")):
                fraction, count = float(m.group(2 + 2 * k)), int(m.group(3 + 2 * k))
                if int(m.group(1)) != len(items) or count != expected[k] or \
                        abs(fraction - expected[k] / len(items)) > 1e-4:
                    failures.append(f"{name}: eval_mc reports {label} {fraction} ({count}) of {m.group(1)} items, "
                                    f"expected {expected[k] / len(items):.4f} ({expected[k]}) of {len(items)}")
        if decided < len(items):
            failures.append(f"{name}: only {decided} decided predictions; the check would say little")
    if cut < 2:
        failures.append(f"only {cut} items are cut to T; the truncation rule is not exercised")
    if right[0] == right[1]:
        failures.append(f"acc and acc_norm both count {right[0]} right: a report that swapped them would pass")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
