#!/usr/bin/python3
"""Plots training runs from their log.jsonl files into one PNG, several runs overlaid.

usage: scripts/plot.py RUN [RUN ...] [-o plot.png] [--labels A,B] [--smooth N] [--baseline-acc X]

RUN is a log.jsonl, or the folder holding one (the trainer's -o folder). The log's lines are read as
train_gpt2cu writes them:
    {"step": S, "loss": .., "lr": .., "norm": .., "ms": .., "tok_per_s": .., "mfu": ..}   a training step
    {"step": S, "val_loss": ..}                                                           validation
    {"step": S, "eval_acc": .., "eval_acc_norm": .., "eval_items": N}                     multiple choice
    {"resume_from_step": S}                                         a resumed run continues from step S
    {"evaluation_of": MODEL}                         a run that trained nothing (-x 0) appended its lines
A "tokens" key (tokens seen so far) in step lines adds a panel of the losses against tokens. After a
resume line, the earlier lines of steps beyond S are dropped (the resumed run redid them); the lines after an
evaluation_of line are left out, up to the next resume line. Values the
trainer could not compute (null) and lines cut short by a killed run are skipped.

Panels: loss (train, and validation as markers), loss against tokens (when logged), learning rate,
gradient norm, throughput (tokens/s), and eval accuracy (acc solid, acc_norm dashed; --baseline-acc
draws a reference line, e.g. 0.294 for GPT-2 124M's HellaSwag acc_norm as llm.c reports it). A panel
whose series no run has says so in place of lines. Labels default to the runs' folder names. The panel
titles (and which are empty) are printed and stored in the PNG's "Description" text chunk, and each
run's last step, best validation loss and best acc_norm are printed.

Does not: read stdout logs, plot runs live, or compare runs statistically.
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class Run:
    def __init__(self, label):
        self.label = label
        self.series = {}  # key -> list of (step, value)
        self.tokens = {}  # step -> tokens seen
        self.skipped = 0

    def add(self, key, step, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self.series.setdefault(key, []).append((step, float(value)))

    def resume(self, step):
        for key in self.series:
            self.series[key] = [(s, v) for s, v in self.series[key] if s <= step]
        self.tokens = {s: t for s, t in self.tokens.items() if s <= step}

    def get(self, key):
        return self.series.get(key, [])


def log_path(run):
    return os.path.join(run, "log.jsonl") if os.path.isdir(run) else run


def default_label(run):
    path = os.path.abspath(run)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    return os.path.basename(folder) or path


def read_run(path, label):
    run = Run(label)
    evaluation = False  # after an {"evaluation_of": ...} line: a run that trained nothing (-x 0), not drawn
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                run.skipped += 1
                continue
            if not isinstance(rec, dict):
                run.skipped += 1
                continue
            if "evaluation_of" in rec:
                evaluation = True
                continue
            if "resume_from_step" in rec:
                evaluation = False
                resumed = rec["resume_from_step"]
                if isinstance(resumed, int) and not isinstance(resumed, bool):
                    run.resume(resumed)
                else:
                    run.skipped += 1  # a damaged line: no step to drop the redone lines after
                continue
            if evaluation:
                continue
            step = rec.get("step")
            if not isinstance(step, int):
                run.skipped += 1
                continue
            for key in ("loss", "lr", "norm", "tok_per_s", "mfu", "val_loss", "eval_acc", "eval_acc_norm"):
                if key in rec:
                    run.add(key, step, rec[key])
            if isinstance(rec.get("tokens"), (int, float)):
                run.tokens[step] = rec["tokens"]
    return run


def smoothed(points, window):
    if window <= 1 or len(points) < window:
        return points
    out, total = [], 0.0
    for i, (s, v) in enumerate(points):
        total += v
        if i >= window:
            total -= points[i - window][1]
        out.append((s, total / min(i + 1, window)))
    return out


def xy(points):
    return [p[0] for p in points], [p[1] for p in points]


def tokens_of(run, points):
    """Points with the step replaced by the tokens seen at that step (steps without a count dropped)."""
    return [(run.tokens[s], v) for s, v in points if s in run.tokens]


def draw_loss(ax, runs, colors, args, tokens=False):
    drawn = False
    for run, color in zip(runs, colors):
        train, val = run.get("loss"), run.get("val_loss")
        if tokens:
            train, val = tokens_of(run, train), tokens_of(run, val)
        if train:
            if args.smooth > 1:
                ax.plot(*xy(train), color=color, alpha=0.25, linewidth=0.8)
                ax.plot(*xy(smoothed(train, args.smooth)), color=color, linewidth=1.5, label=f"{run.label} train")
            else:
                ax.plot(*xy(train), color=color, linewidth=1.0, label=f"{run.label} train")
            drawn = True
        if val:
            ax.plot(*xy(val), color=color, marker="o", markersize=3, linestyle="--", linewidth=1.0,
                    label=f"{run.label} val")
            drawn = True
    ax.set_xlabel("tokens" if tokens else "step")
    ax.set_ylabel("loss")
    return drawn


def draw_series(ax, runs, colors, key, ylabel, log=False):
    drawn = False
    for run, color in zip(runs, colors):
        points = run.get(key)
        if points:
            ax.plot(*xy(points), color=color, linewidth=1.0, label=run.label)
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log and drawn and all(v > 0 for run in runs for _, v in run.get(key)):
        ax.set_yscale("log")
    return drawn


def draw_eval(ax, runs, colors, args):
    drawn = False
    for run, color in zip(runs, colors):
        for key, style, name in (("eval_acc", "-", "acc"), ("eval_acc_norm", "--", "acc_norm")):
            points = run.get(key)
            if points:
                ax.plot(*xy(points), color=color, linestyle=style, marker=".", linewidth=1.0,
                        label=f"{run.label} {name}")
                drawn = True
    if args.baseline_acc is not None and drawn:
        ax.axhline(args.baseline_acc, color="gray", linestyle=":", linewidth=1.0, label=f"baseline {args.baseline_acc:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    return drawn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="log.jsonl files or the folders holding them")
    ap.add_argument("-o", "--out", default="plot.png", help="the PNG to write (default: plot.png)")
    ap.add_argument("--labels", help="comma-separated legend labels, one per run (default: folder names)")
    ap.add_argument("--smooth", type=int, default=0, help="also draw the train loss averaged over N steps")
    ap.add_argument("--baseline-acc", type=float, help="a reference accuracy drawn on the eval panel")
    ap.add_argument("--title", help="a title over the panels")
    args = ap.parse_args(argv)

    labels = args.labels.split(",") if args.labels else [default_label(r) for r in args.runs]
    if len(labels) != len(args.runs):
        ap.error(f"--labels gives {len(labels)} labels for {len(args.runs)} runs")
    runs = []
    for run, label in zip(args.runs, labels):
        path = log_path(run)
        if not os.path.isfile(path):
            print(f"error: {path}: no such log (give a log.jsonl or the folder holding one)", file=sys.stderr)
            return 3
        runs.append(read_run(path, label))
        if runs[-1].skipped:
            print(f"note: {path}: skipped {runs[-1].skipped} line(s) that are not log records", file=sys.stderr)
    colors = [f"C{i % 10}" for i in range(len(runs))]

    panels = [("loss", lambda ax: draw_loss(ax, runs, colors, args))]
    if any(run.tokens for run in runs):
        panels.append(("loss vs tokens", lambda ax: draw_loss(ax, runs, colors, args, tokens=True)))
    panels += [
        ("learning rate", lambda ax: draw_series(ax, runs, colors, "lr", "learning rate")),
        ("gradient norm", lambda ax: draw_series(ax, runs, colors, "norm", "norm", log=True)),
        ("throughput (tokens/s)", lambda ax: draw_series(ax, runs, colors, "tok_per_s", "tokens/s")),
        ("eval accuracy", lambda ax: draw_eval(ax, runs, colors, args)),
    ]
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), dpi=100, squeeze=False)
    flat = [ax for row in axes for ax in row]
    empty = []
    for ax, (title, draw) in zip(flat, panels):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if draw(ax):
            ax.legend(fontsize=7)
        else:
            empty.append(title)
            ax.text(0.5, 0.5, "no data in these logs", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    titles = [t for t, _ in panels]
    description = "panels: " + " | ".join(titles) + "; empty: " + (" | ".join(empty) if empty else "none")
    fig.savefig(args.out, metadata={"Description": description})
    plt.close(fig)

    print(f"wrote {args.out} ({cols * 600}x{rows * 400}): {description}")
    for run in runs:
        last = max((s for key in run.series for s, _ in run.series[key]), default=None)
        val = min((v for _, v in run.get("val_loss")), default=None)
        acc = max((v for _, v in run.get("eval_acc_norm")), default=None)
        print(f"  {run.label}: last step {last}"
              + (f", best val loss {val:.4f}" if val is not None else "")
              + (f", best acc_norm {acc:.4f}" if acc is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
