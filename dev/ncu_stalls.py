#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

    ncu --set full --import-source yes -o prof ... ./program          # one kernel, --kernel-name ...
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 dev/ncu_stalls.py sass.csv [--top 30]

Reads the per-instruction warp-state samples ("Warp Stall Sampling (All Samples)") and the stall reasons
(the stall_* columns, counting issued and not-issued samples alike). Prints the total, the share of the
samples by opcode (the mnemonic before its first '.', predicates dropped), and the instructions with the
most samples: address, share, the running total, the instruction, and its reasons with at least a tenth
of its samples. A wait loop shows as its branch (a try-wait's BRA, stall_long_sb), a wgmma wait as
WARPGROUP.DEPBAR, an exponential as MUFU. Every warp of the kernel counts, producer warps included.
"""
import argparse
import csv
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source):
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    ap.add_argument("--top", type=int, default=30, help="instructions to list (default 30)")
    ap.add_argument("--opcodes", type=int, default=15, help="opcodes to list (default 15)")
    args = ap.parse_args()
    try:
        with open(args.csv, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        sys.exit(f"ncu_stalls: cannot read {args.csv}: {e.strerror}")
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if header_at is None:
        sys.exit(f"ncu_stalls: {args.csv} has no header with 'Source' and '{SAMPLES}' columns "
                 "(the source page of a report collected with --import-source and a set that samples warps)")
    header = rows[header_at]
    src, samp = header.index("Source"), header.index(SAMPLES)
    addr = header.index("Address") if "Address" in header else None
    reasons = [(i, c[len("stall_"):]) for i, c in enumerate(header) if c.startswith("stall_") and "(Not Issued)" not in c]
    data = [r for r in rows[header_at + 1:] if len(r) > max(src, samp)]
    total = sum(number(r[samp]) for r in data)
    if total <= 0:
        sys.exit(f"ncu_stalls: {args.csv}: no warp samples in {len(data)} instructions")
    kernel = next((r[1] for r in rows[:header_at] if len(r) > 1 and r[0] == "Kernel Name"), None)
    if kernel:
        print(f"kernel: {kernel}")
    print(f"{int(total)} samples over {len(data)} instructions")

    by_op = Counter()
    for r in data:
        by_op[opcode(r[src])] += number(r[samp])
    print("\nsamples by opcode:")
    for op, v in by_op.most_common(args.opcodes):
        print(f"  {op:<14} {100 * v / total:5.1f}%")

    print(f"\nthe {args.top} instructions with the most samples (share, running total, reasons >= 10% of its samples):")
    running = 0.0
    for r in sorted(data, key=lambda r: -number(r[samp]))[: args.top]:
        v = number(r[samp])
        running += v
        why = sorted(((number(r[i]), name) for i, name in reasons if i < len(r)), reverse=True)
        why = ", ".join(f"{name} {100 * n / v:.0f}%" for n, name in why if v > 0 and n >= 0.1 * v)
        where = r[addr][-6:] if addr is not None else ""
        print(f"  {where:>6} {100 * v / total:5.1f}% {100 * running / total:5.1f}%  {r[src].strip()[:64]:<64} {why}")


if __name__ == "__main__":
    main()
