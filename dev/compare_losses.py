#!/usr/bin/env python3
"""Compares the per-step train losses (and the final validation loss) of two JSONL logs in train_gpt2cu's
format (dev/train_gpt2_torch.py --log writes the same keys), as the training-dynamics check
against PyTorch does (docs/performance.md):

    python3 dev/compare_losses.py ours.jsonl torch.jsonl [--max-diff 0.05] [--max-val-rel 0.01] [--from-step 1]
                                  [--reference other.jsonl [--reference-label R]]
                                  [--plot diff.png [--labels A,B] [--title T]] [--windows N]

Prints the largest |difference| and its step, the mean difference (first minus second), the rms, and the
final validation losses; PASS when every step of the second log is in the first, the largest difference
over the steps from --from-step on (default: all) is within --max-diff and the final validation losses within --max-val-rel. Exit 0 PASS, 1 FAIL.
A loss that is not a number (null, as the trainer writes one it could not compute, or NaN) fails every limit;
lines that are not records (cut short by a killed run) are skipped with a note, and so are the records of a
run that trained nothing (-x 0), after its {"evaluation_of": ...} line.
--reference: a third log, compared with the second in the same way and printed on a line of its own (it
does not change PASS or FAIL), and drawn beside the first on the plot: what another change of rounding
alone does (say the same run with its batch split into micro-batches), the scale to read the first against.
--plot draws the per-step difference (first minus second), its 20-step mean and the +-max-diff band.
--windows N also prints, for each window of N steps ((0, N], (N, 2N], ..., from --from-step on), the mean
and the largest |difference| and how many steps are over --max-diff: how a gap grows through a run (the
last window's mean is the "last N steps" figure docs/performance.md quotes).
A log whose step records count the FP8 tensors that outgrew their delayed scale's history (fp8_outgrown,
train_gpt2cu with FP8 delayed scaling) gets a line saying how many, in how many steps, and the first.
"""
import argparse
import json
import math
import os
import sys


def load(path):
    """The train and val losses by step. A loss the trainer could not compute (null; NaN or Infinity from
    Python's json) reads as NaN, which no limit accepts. Lines that are not records (blank, or cut short by
    a killed run, which the trainer's log leaves in place) are skipped with a note on stderr."""
    train, val = {}, {}
    skipped = 0
    evaluation = False  # after an {"evaluation_of": ...} line: a run that trained nothing (-x 0), left out
    for line in open(path, encoding="utf-8", errors="replace"):
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if not isinstance(r, dict):
            skipped += line.strip() != ""
            continue
        if "evaluation_of" in r or "resume_from_step" in r:
            evaluation = "evaluation_of" in r
            continue
        if evaluation:
            continue
        if not isinstance(r.get("step"), int):
            continue  # a record without a step, e.g. {"resume_from_step": S}
        for key, losses in (("loss", train), ("val_loss", val)):
            if key in r:
                v = r[key]
                losses[r["step"]] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    if skipped:
        print(f"note: {path}: skipped {skipped} line(s) that are not log records", file=sys.stderr)
    return train, val


def outgrown(path):
    """(total, steps, first step) of the log's fp8_outgrown counts (first None when all are 0), or None when
    its step records carry none."""
    total, steps, first, seen = 0, 0, None, False
    for line in open(path, encoding="utf-8", errors="replace"):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        k = r.get("fp8_outgrown") if isinstance(r, dict) and "loss" in r else None
        if not isinstance(k, int) or isinstance(k, bool):
            continue
        seen = True
        total += k
        if k > 0:
            steps += 1
            first = r["step"] if first is None else first
    return (total, steps, first) if seen else None


def magnitude(d):
    """|d| for ranking differences: a non-finite difference (a NaN or infinite loss) ranks above all."""
    return abs(d) if math.isfinite(d) else math.inf


def over_limit(d, limit):
    return not abs(d) <= limit  # NaN is over every limit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--max-diff", type=float, default=0.05)
    ap.add_argument("--max-val-rel", type=float, default=0.01)
    ap.add_argument("--from-step", type=int, default=1, help="compare the train losses from this step on")
    ap.add_argument("--reference", help="a third log, compared with the second alongside the first")
    ap.add_argument("--reference-label", default="reference", help="its name in the output and on the plot")
    ap.add_argument("--plot", help="a PNG of the per-step difference")
    ap.add_argument("--labels", default="first,second", help="the two logs' names on the plot")
    ap.add_argument("--title", help="the plot's title")
    ap.add_argument("--windows", type=int, default=0, help="also the difference per window of this many steps")
    a = ap.parse_args()
    if a.windows < 0:
        sys.exit("--windows: a number of steps >= 1 (0: none)")
    for path in [a.first, a.second] + ([a.reference] if a.reference else []):
        if not os.path.isfile(path):
            sys.exit(f"compare_losses.py: no such log: {path}")
    (t1, v1), (t2, v2) = load(a.first), load(a.second)
    ok, line = compare(a, a.first, t1, v1, t2, v2)
    print(line + (" PASS" if ok else " FAIL"))
    if a.windows:
        for w in windows(a, t1, t2):
            print(w)
    ref = None
    if a.reference:
        tr, vr = load(a.reference)
        _, ref_line = compare(a, a.reference, tr, vr, t2, v2)
        print(f"{a.reference_label}: {ref_line}")
        ref = [(s, tr[s] - t2[s]) for s in sorted(t2) if s in tr]
    for path in [a.first, a.second] + ([a.reference] if a.reference else []):
        o = outgrown(path)
        if o is not None:
            print(f"{path}: FP8 tensors past their amax history (fp8_outgrown): {o[0]} in {o[1]} steps"
                  + (f", the first at step {o[2]}" if o[2] is not None else ""))
    if a.plot:
        plot(a, [(s, t1[s] - t2[s]) for s in sorted(t2) if s in t1], ref)
    sys.exit(0 if ok else 1)


def compare(a, first_path, t1, v1, t2, v2):
    """(PASS?, the summary line) of log 1 against log 2."""
    steps = sorted(s for s in t2 if s >= a.from_step)
    missing = [s for s in steps if s not in t1]
    common = [s for s in steps if s in t1]
    if not common:
        sys.exit(f"no common steps between {first_path} and {a.second}")
    diffs = [(s, t1[s] - t2[s]) for s in common]
    worst = max(diffs, key=lambda x: magnitude(x[1]))
    mean = sum(d for _, d in diffs) / len(diffs)
    rms = (sum(d * d for _, d in diffs) / len(diffs)) ** 0.5
    over = sum(1 for _, d in diffs if over_limit(d, a.max_diff))
    ok = not missing and not over_limit(worst[1], a.max_diff)
    line = (f"per-step |loss difference|: max {abs(worst[1]):.4f} at step {worst[0]}, mean {mean:+.4f}, rms {rms:.4f} "
            f"over {len(common)}/{len(steps)} steps from step {a.from_step} (limit {a.max_diff}, {over} steps over it)")
    last = max(set(v1) & set(v2), default=None)
    if last is not None:
        rel = abs(v1[last] - v2[last]) / abs(v2[last])
        ok = ok and not over_limit(rel, a.max_val_rel)
        line += f"; val loss at step {last}: {v1[last]:.6f} vs {v2[last]:.6f}, rel diff {rel:.2e} (limit {a.max_val_rel})"
    return ok, line


def windows(a, t1, t2):
    """One line per window of a.windows steps of the compared steps: its mean, max |difference| and steps over."""
    common = [s for s in sorted(t2) if s >= a.from_step and s in t1]
    lines = []
    for k in sorted({(s - 1) // a.windows for s in common}):
        d = [t1[s] - t2[s] for s in common if (s - 1) // a.windows == k]
        first, last = max(k * a.windows + 1, a.from_step), (k + 1) * a.windows
        over = sum(1 for x in d if over_limit(x, a.max_diff))
        worst = abs(max(d, key=magnitude))
        lines.append(f"  steps {first}-{last}: mean {sum(d) / len(d):+.4f}, max {worst:.4f}, "
                     f"{over} of {len(d)} over {a.max_diff}")
    return lines


def plot(a, diffs, ref=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, second = (a.labels.split(",") + ["second"])[:2]
    window = 20

    def running_mean(values):
        return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]

    steps = [s for s, _ in diffs]
    values = [d for _, d in diffs]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, values, lw=0.6, alpha=0.5, label="per step")
    ax.plot(steps, running_mean(values), lw=1.8, label=f"{window}-step mean")
    if ref:
        rsteps, rvalues = [s for s, _ in ref], [d for _, d in ref]
        ax.plot(rsteps, rvalues, lw=0.6, alpha=0.35, color="tab:green")
        ax.plot(rsteps, running_mean(rvalues), lw=1.5, color="tab:green",
                label=f"{a.reference_label} - {second}: per step, {window}-step mean")
    for y in (a.max_diff, -a.max_diff):
        ax.axhline(y, color="gray", ls="--", lw=0.8)
    ax.axhline(0, color="black", lw=0.5)
    ax.axvline(a.from_step, color="gray", ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss: {first} - {second}")
    ax.set_title(a.title or f"{first} - {second}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)
    print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
