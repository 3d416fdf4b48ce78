#!/usr/bin/env python3
"""Per-kernel GPU time from an Nsight Compute CSV (gpu__time_duration.sum), grouped by kernel name.

    ncu --csv --print-units base --metrics gpu__time_duration.sum --log-file prof.csv ./train_gpt2cu ... -x 3
    python3 dev/ncu_summary.py prof.csv --steps 3

Prints one row per kernel (name cut before its argument list and template arguments): launches per
step, ms per step, share of the total, sorted by time; then the total per step. ncu serialises the
kernels, so the total is the sum of kernel times (no overlap, no launch gaps), not the step time.

    python3 dev/ncu_summary.py prof.csv --last-step adamw_kernel
takes only the kernels of the last whole step: after the second-to-last launch of the named kernel (the
step's last one), up to and including the last. The trainer's first step also runs the gemm tuner's
trial matmuls (every candidate algorithm, gemm_fingerprint_kernel), which --steps would spread over
the steps. It then also prints the time by kind: matmul (cuBLASLt's kernels), attention (flash), other.

    python3 dev/ncu_summary.py prof.csv --variants
compares kernel variants instead (e.g. the flash kernels of build/attention_lab under ncu, where ncu
holds the clocks fixed): one row per kernel name with its template arguments and grid size, with the
number of launches and the median and minimum ms per launch, sorted by name.
"""
import argparse
import csv
import re
import sys

UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def short_name(name):
    name = re.sub(r"\(.*$", "", name)  # argument list
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).strip()
    return name.split(" ")[-1] if " " in name else name


def kind_of(short):
    """matmul (cuBLAS/cuBLASLt's own kernels), attention (our flash kernels) or other."""
    if short.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "cutlass", "ampere_", "sm90_", "cublas")) or "splitKreduce" in short:
        return "matmul"
    if "flash" in short:
        return "attention"
    return "other"


def variant_name(name):
    """'void ns::k<64, true, 2>(float *, int)' -> 'k<64, true, 2>'."""
    name = name.split("(")[0].strip()
    head, _, targs = name.partition("<")
    head = head.split(" ")[-1].split("::")[-1]
    return head + ("<" + targs if targs else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=1, help="training steps the profile covers (times are divided by it)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--variants", action="store_true", help="median ms per launch by template arguments and grid")
    ap.add_argument("--last-step", metavar="KERNEL", help="only the kernels of the last step, which ends with KERNEL")
    a = ap.parse_args()
    lines = open(a.csv, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{a.csv}: no ncu CSV header (a line starting with \"ID\")")
    rows = [r for r in csv.DictReader(lines[start:]) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if a.last_step:
        if a.variants or a.steps != 1:
            sys.exit("--last-step goes with neither --variants nor --steps")
        ends = [i for i, r in enumerate(rows) if a.last_step in r["Kernel Name"]]
        if len(ends) < 2:
            sys.exit(f"{a.csv}: --last-step needs two launches of a kernel named like '{a.last_step}', found {len(ends)}")
        rows = rows[ends[-2] + 1:ends[-1] + 1]
    total, per, launches = 0.0, {}, {}
    for row in rows:
        unit = row.get("Metric Unit", "ns").strip()
        if unit not in UNITS:
            sys.exit(f"{a.csv}: unknown time unit '{unit}'")
        ms = float(row["Metric Value"].replace(",", "")) * UNITS[unit]
        if a.variants:
            full = variant_name(row["Kernel Name"])
            launches.setdefault((full, row.get("Grid Size", "?")), []).append(ms)
            continue
        name = short_name(row["Kernel Name"])
        t, n = per.get(name, (0.0, 0))
        per[name] = (t + ms, n + 1)
        total += ms
    if a.variants:
        if not launches:
            sys.exit(f"{a.csv}: no gpu__time_duration.sum rows")
        print("| kernel | grid | launches | median ms | min ms |")
        print("|---|---|---|---|---|")
        for (name, grid), ms in sorted(launches.items()):
            ms = sorted(ms)
            print(f"| {name} | {grid} | {len(ms)} | {ms[len(ms) // 2]:.4f} | {ms[0]:.4f} |")
        return
    if not per:
        sys.exit(f"{a.csv}: no gpu__time_duration.sum rows")
    print(f"| kernel | launches/step | ms/step | share |")
    print(f"|---|---|---|---|")
    for name, (t, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"| {name} | {n / a.steps:.1f} | {t / a.steps:.3f} | {100 * t / total:.1f}% |")
    print(f"total kernel time: {total / a.steps:.2f} ms/step over {len(per)} kernel names ({a.steps} step(s))")
    if a.last_step:
        kinds = {}
        for name, (t, _) in per.items():
            kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + t
        print("by kind (ms/step): " + ", ".join(f"{k} {t:.2f}" for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
