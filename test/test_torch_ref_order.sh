#!/usr/bin/env bash
# The PyTorch reference trainer (dev/train_gpt2_torch.py, class Shards) reads the training samples in
# exactly the order train_gpt2cu's DataLoader hands them to one rank, shuffled or not, so that the two
# trainers' losses can be compared step by step. build/loader_order prints, through the DataLoader itself,
# every sample of the first batches (shard, token offset and a position-weighted checksum of its T+1
# tokens); Shards.samples() and Shards.batch() must give the same lines, bit for bit, over 2.5+ epochs.
# Data: 7 synthetic shards of different sizes (one of them 32-bit tokens, version 2) named by two
# comma-separated globs, so shard and epoch boundaries and both header versions are crossed. Cases:
# shuffle off, and shuffle on for seeds 0, 1337, 2^63-1 and a seed built (by inverting splitmix64) so that
# one generator output inside a sample permutation is 0, which SplitMix64::below must reject and redraw:
# a path that random seeds reach with probability below 2^-32; several B and T (not dividing the shards).
# Exit 0 pass, 1 fail, 77 skip (no PyTorch/numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import torch and numpy (apt-get install python3-torch python3-numpy)"
    exit 77
fi
make -s build/loader_order
dir=$(mktemp -d /tmp/torch_ref_order_XXXXXX)
trap 'rm -rf "$dir"' EXIT
python3 test/make_synthetic_shards.py "$dir" syn=3000,1000,2500,700,1601 wide=900,2222
# wide_000001.bin becomes a version 2 shard (uint32 tokens); its token ids stay the same.
/usr/bin/python3 - "$dir/wide_000001.bin" <<'PY'
import sys
import numpy as np
path = sys.argv[1]
h = np.fromfile(path, dtype=np.int32, count=256)
tokens = np.fromfile(path, dtype=np.uint16, offset=1024)
h[1] = 2
with open(path, "wb") as f:
    f.write(h.tobytes() + tokens.astype(np.uint32).tobytes())
PY

# A time limit, so that a broken port that loops (say, on a rejected draw) fails rather than hangs.
OMP_NUM_THREADS=1 timeout -k 10 300 /usr/bin/python3 - "$dir/syn_*.bin,$dir/wide_*.bin" <<'PY'
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, "dev")
from train_gpt2_torch import GOLDEN64, MASK64, Shards, splitmix64_mix

pattern = sys.argv[1]


def unmix(z):
    """The inverse of llmc/rand.h's splitmix64_mix: undo each xor-shift, multiply by each inverse mod 2^64."""
    def unshift(z, k):
        x = z
        for _ in range(64 // k + 1):
            x = z ^ (x >> k)
        return x
    z = unshift(z, 31)
    z = (z * pow(0x94d049bb133111eb, -1, 1 << 64)) & MASK64
    z = unshift(z, 27)
    z = (z * pow(0xbf58476d1ce4e5b9, -1, 1 << 64)) & MASK64
    return unshift(z, 30)


def rejecting_seed(B, T):
    """A --seed under which output q of the generator ordering the samples of the shard at slot 0 of epoch 0
    is 0. That draw's bound is the shard's sample count minus q-1; when it is not a power of two (for
    every shard, whichever comes first), below() must reject the 0 (its threshold (2^64-bound) % bound is
    at least 1) and draw again."""
    counts = Shards(pattern, B, T).counts
    for q in range(2, 1000):
        if any(c - (q - 1) < 2 or not (c - (q - 1)) & (c - q) for c in counts):
            continue
        P = (unmix(0) - q * GOLDEN64) & MASK64            # that generator's seed: output q = mix(P + q*GOLDEN64) = 0
        X = unmix(P) ^ GOLDEN64                           # stream_seed(0, 1) = mix(mix(mix(seed) ^ 0) ^ 1 * GOLDEN64)
        seed = unmix(unmix(X))
        if seed < 1 << 63:                                # train_gpt2cu's --seed is a non-negative int64
            assert splitmix64_mix((P + q * GOLDEN64) & MASK64) == 0
            return seed
    sys.exit("no seed with a rejected draw found")


def python_lines(s, batches):
    lines = []
    weights = torch.arange(1, s.T + 2, dtype=torch.int64)
    for i in range(batches):
        x, y = s.batch(i, torch.device("cpu"))
        rows = torch.cat([x[:, :1], y], dim=1)
        sums = (rows * weights).sum(dim=1).tolist()
        for r, ((shard, offset), checksum) in enumerate(zip(s.samples(i), sums)):
            lines.append(f"{i} {r} {shard} {offset} {checksum}")
    return lines


cases = [(B, T, 0, 0) for B, T in [(1, 16), (4, 37), (7, 64)]]
cases += [(B, T, 1, seed) for B, T in [(1, 16), (3, 64), (5, 37), (8, 100)] for seed in (0, 1337, 2**63 - 1)]
cases += [(B, T, 1, rejecting_seed(B, T)) for B, T in [(2, 16), (6, 45)]]
failed = 0
for B, T, shuffle, seed in cases:
    s = Shards(pattern, B, T, shuffle=bool(shuffle), seed=seed)
    batches = (5 * s.samples_per_epoch) // (2 * B) + 2  # past the middle of epoch 2 (the third)
    cmd = ["build/loader_order", "-i", pattern, "-b", str(B), "-t", str(T), "--seed", str(seed),
           "--shuffle", str(shuffle), "-n", str(batches)]
    ours = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    theirs = python_lines(s, batches)
    what = f"B={B} T={T} shuffle={shuffle} seed={seed}: {batches} batches, {s.samples_per_epoch} samples an epoch"
    if len(ours) != batches * B or ours != theirs:
        failed += 1
        first = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        print(f"FAIL {what}: {len(ours)} lines from loader_order, {len(theirs)} from Shards; first difference at line "
              f"{first} (batch row shard offset checksum):")
        print(f"    loader_order: {ours[first] if first < len(ours) else '(none)'}")
        print(f"    Shards:       {theirs[first] if first < len(theirs) else '(none)'}")
    else:
        print(f"ok   {what}")
if failed:
    sys.exit(f"{failed} of {len(cases)} cases differ")
print(f"all {len(cases)} cases agree")
PY
