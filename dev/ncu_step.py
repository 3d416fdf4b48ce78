#!/usr/bin/env python3
"""One training step's kernels from an Nsight Compute CSV, summed by kernel.

The CSV comes from a trainer run of at least two steps with the metrics gpu__time_duration.sum,
sm__cycles_elapsed.max and gpc__cycles_elapsed.avg.per_second, e.g. (gpu_runs.sh's `profile` section):

    ncu --target-processes application-only --clock-control none --csv --print-units base \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,gpc__cycles_elapsed.avg.per_second \
        --log-file ncu.csv ./train_gpt2cu -e d12 -b 64 -t 1024 -x 2 -v 0 -s 0 -o ""
    python3 dev/ncu_step.py ncu.csv [--sequence N]

The step is the launches after the next-to-last adamw_kernel through the last one (the last step, its
update included). Prints, per kernel name (template arguments and parameters cut), the launches, ms, SM
cycles (millions) and median SM clock, largest first; then the totals; with --sequence N, the step's first
N launches in order (the forward's first layers). ncu runs kernels one at a time, so the times add up
without the overlap of the trainer's two streams; with --clock-control none each runs at the clock it gets.
"""
import argparse
import collections
import csv
import io
import re
import statistics
import sys


def read_kernels(path):
    with open(path) as f:
        text = "".join(line for line in f if not line.startswith("=="))  # ncu's own messages
    kernels = collections.OrderedDict()
    for row in csv.DictReader(io.StringIO(text)):
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
        try:
            k[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            sys.exit(f"ncu_step: {path}: metric {row['Metric Name']} of launch {row['ID']} is not a number")
    return list(kernels.values())


def short(name):
    return re.sub(r"[(<].*", "", re.sub(r"^void ", "", name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--sequence", type=int, default=0, help="also list the step's first N launches in order")
    a = ap.parse_args()
    ks = read_kernels(a.csv)
    need = ("gpu__time_duration.sum", "sm__cycles_elapsed.max", "gpc__cycles_elapsed.avg.per_second")
    missing = [m for m in need if ks and m not in ks[0]]
    if not ks or missing:
        sys.exit(f"ncu_step: {a.csv}: no launches, or without the metrics {', '.join(missing or need)}")
    ends = [i for i, k in enumerate(ks) if "adamw_kernel" in k["name"]]
    if len(ends) < 2:
        sys.exit(f"ncu_step: {a.csv}: {len(ends)} adamw_kernel launches; profile at least two steps")
    step = ks[ends[-2] + 1 : ends[-1] + 1]
    by = collections.OrderedDict()
    for k in step:
        by.setdefault(short(k["name"]), []).append(k)
    total_ms = sum(k["gpu__time_duration.sum"] for k in step) / 1e6
    total_cyc = sum(k["sm__cycles_elapsed.max"] for k in step) / 1e6
    print(f"the last step: {len(step)} launches, {total_ms:.2f} ms, {total_cyc:.2f} M SM cycles")
    print(f"{'ms':>8} {'share':>6} {'Mcycles':>8} {'MHz':>5} {'launches':>8}  kernel")
    for name, group in sorted(by.items(), key=lambda kv: -sum(k["gpu__time_duration.sum"] for k in kv[1])):
        ms = sum(k["gpu__time_duration.sum"] for k in group) / 1e6
        cyc = sum(k["sm__cycles_elapsed.max"] for k in group) / 1e6
        mhz = statistics.median(k["gpc__cycles_elapsed.avg.per_second"] for k in group) / 1e6
        print(f"{ms:8.3f} {100 * ms / total_ms:5.1f}% {cyc:8.3f} {mhz:5.0f} {len(group):8d}  {name}")
    if a.sequence:
        print(f"the step's first {a.sequence} launches:")
        for k in step[: a.sequence]:
            print(f"{k['gpu__time_duration.sum'] / 1e6:8.3f} ms {k['gpc__cycles_elapsed.avg.per_second'] / 1e6:5.0f} MHz  "
                  f"{short(k['name'])}")


if __name__ == "__main__":
    main()
