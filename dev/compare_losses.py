#!/usr/bin/env python3
"""Compares the per-step train losses (and the final validation loss) of two JSONL logs in train_gpt2cu's
format (dev/train_gpt2_torch.py --log writes the same keys), as the training-dynamics check
against PyTorch does (docs/performance.md):

    python3 dev/compare_losses.py ours.jsonl torch.jsonl [--max-diff 0.05] [--max-val-rel 0.01] [--from-step 1]

Prints the largest |difference| and its step, the mean difference (first minus second), the rms, and the
final validation losses; PASS when every step of the second log is in the first, the largest difference
over the steps from --from-step on (default: all) is within --max-diff and the final validation losses within --max-val-rel. Exit 0 PASS, 1 FAIL.
"""
import argparse
import json
import sys


def load(path):
    train, val = {}, {}
    for line in open(path):
        r = json.loads(line)
        if "loss" in r:
            train[r["step"]] = r["loss"]
        if "val_loss" in r:
            val[r["step"]] = r["val_loss"]
    return train, val


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--max-diff", type=float, default=0.05)
    ap.add_argument("--max-val-rel", type=float, default=0.01)
    ap.add_argument("--from-step", type=int, default=1, help="compare the train losses from this step on")
    a = ap.parse_args()
    (t1, v1), (t2, v2) = load(a.first), load(a.second)
    steps = sorted(s for s in t2 if s >= a.from_step)
    missing = [s for s in steps if s not in t1]
    common = [s for s in steps if s in t1]
    if not common:
        sys.exit(f"no common steps between {a.first} and {a.second}")
    diffs = [(s, t1[s] - t2[s]) for s in common]
    worst = max(diffs, key=lambda x: abs(x[1]))
    mean = sum(d for _, d in diffs) / len(diffs)
    rms = (sum(d * d for _, d in diffs) / len(diffs)) ** 0.5
    ok = not missing and abs(worst[1]) <= a.max_diff
    line = (f"per-step |loss difference|: max {abs(worst[1]):.4f} at step {worst[0]}, mean {mean:+.4f}, rms {rms:.4f} "
            f"over {len(common)}/{len(steps)} steps from step {a.from_step} (limit {a.max_diff})")
    last = max(set(v1) & set(v2), default=None)
    if last is not None:
        rel = abs(v1[last] - v2[last]) / abs(v2[last])
        ok = ok and rel <= a.max_val_rel
        line += f"; val loss at step {last}: {v1[last]:.6f} vs {v2[last]:.6f}, rel diff {rel:.2e} (limit {a.max_val_rel})"
    print(line + (" PASS" if ok else " FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
