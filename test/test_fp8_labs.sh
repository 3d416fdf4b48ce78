#!/usr/bin/env bash
# The CPU FP8 labs' roundings (dev/fp8_weights_lab.py's E4M3, dev/fp8_dlogits_lab.py's E5M2) against every
# value of the format, built from its bit fields here: round to nearest gives the nearest value (ties to
# the even mantissa), saturating past the largest; stochastic rounding gives one of the two neighbours,
# and over 2000 draws (a fixed seed) the mean of a value halfway between two neighbours is within 5% of a
# step of it (the standard error of such a mean is 1.1% of a step). And
# the weights lab runs end to end (two short runs of a tiny slice) and prints its tables.
# Exit 0 pass, 1 fail, 77 skip (no PyTorch/numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import torch and numpy (apt-get install python3-torch python3-numpy)"
    exit 77
fi
/usr/bin/python3 - <<'PY'
import sys
import torch
sys.path.insert(0, "dev")
from fp8_dlogits_lab import e5m2, e5m2_stochastic
from fp8_weights_lab import e4m3, e4m3_stochastic

def values(ebits, mbits, bias, top_is_nan):
    """Every finite value >= 0 of an FP8 format from its fields."""
    out = set()
    for e in range(2 ** ebits):
        for m in range(2 ** mbits):
            if e == 2 ** ebits - 1 and (not top_is_nan or m == 2 ** mbits - 1):
                continue  # E5M2: the top exponent is inf/NaN; E4M3: only S.1111.111 is NaN
            out.add(m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    return torch.tensor(sorted(out), dtype=torch.float64)

fails = 0
for name, rne, sr, vals in (("E4M3", e4m3, e4m3_stochastic, values(4, 3, 7, True)),
                            ("E5M2", e5m2, e5m2_stochastic, values(5, 2, 15, False))):
    top = float(vals[-1])
    # Points: every value, every midpoint, and points a quarter and three quarters between neighbours.
    lo, hi = vals[:-1], vals[1:]
    pts = torch.cat([vals, (lo + hi) / 2, lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4, torch.tensor([top * 1.5])])
    x = torch.cat([pts, -pts]).float()
    got = rne(x).double()
    # The nearest value, ties to the even mantissa (the even one of two neighbours has the even index in vals).
    a = x.abs().double().clamp(max=top)
    idx = torch.searchsorted(vals, a)
    idx = idx.clamp(max=len(vals) - 1)
    below = vals[(idx - 1).clamp(min=0)]
    above = vals[idx]
    exact = above == a
    d_lo, d_hi = a - below, above - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (idx % 2 == 0))
    want = torch.where(exact | pick_hi, above, below) * torch.sign(x.double())
    bad = (got != want).sum().item()
    print(f"{name}: {len(x)} points rounded to nearest, {bad} wrong (largest {top:g})")
    fails += bad
    g = torch.Generator().manual_seed(3)
    mids = ((lo + hi) / 2).float()
    draws = torch.stack([sr(mids, g) for _ in range(2000)]).double()
    neighbour = ((draws == lo) | (draws == hi)).all().item()
    err = ((draws.mean(0) - mids.double()) / (hi - lo)).abs().max().item()
    print(f"{name}: stochastic rounding of {len(mids)} midpoints, 2000 draws each: only neighbours {neighbour}, "
          f"largest bias {err:.4f} of a step")
    fails += (not neighbour) + (err > 0.05)
sys.exit(1 if fails else 0)
PY
dir=$(mktemp -d /tmp/fp8_labs_XXXXXX)
trap 'rm -rf "$dir"' EXIT
/usr/bin/python3 test/make_synthetic_shards.py "$dir" syn=2000
out=$(/usr/bin/python3 dev/fp8_weights_lab.py --tokens 1024 --steps 4 -B 2 -T 16 --window 2 --seeds 1 \
      --schemes fp32,e4m3,e4m3-sr,e4m3-act,e4m3-all --shard "$dir/syn_000000.bin" 2>&1) ||
    { echo "FAIL: the weights lab"; echo "$out"; exit 1; }
echo "$out" | tail -n 6
for s in e4m3 e4m3-sr e4m3-act e4m3-all; do
    echo "$out" | grep -q " $s: train" || { echo "FAIL: the weights lab printed no per-seed line for $s"; exit 1; }
done
# Each scheme rounds something: its run's last window differs from fp32's (a hook left unused would print
# a difference of exactly zero).
zero=$(echo "$out" | grep -E " (e4m3|e4m3-sr|e4m3-act|e4m3-all): train [+-]0\.0000 " || true)
[ -z "$zero" ] || { echo "FAIL: a scheme trained exactly as fp32 did: $zero"; exit 1; }
echo "ok"
