#!/usr/bin/env python3
"""Writes small synthetic token shards for the trainer's script tests (shard format version 1).

    make_synthetic_shards.py DIR NAME=N[,N...] ...      e.g.  DIR syn_train=60000,60000 syn_val=8000

For each NAME, shard i holds N_i tokens and is DIR/NAME_00000i.bin; shard i of the k-th NAME uses seed
SEED_k + i (--seeds, default 1 for the first name's first shard, counting on). The tokens follow a
mostly deterministic chain over 97 states spread across the GPT-2 vocabulary, so a small model can learn
them and the loss visibly falls within a few dozen steps.
"""
import argparse
import random
import struct


def shard(path, tokens):
    header = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header) + struct.pack("<%dH" % len(tokens), *tokens))


def chain(n, seed):
    rng, t, out = random.Random(seed), 0, []
    for _ in range(n):
        t = (7 * t + 3) % 97 if rng.random() < 0.9 else rng.randrange(97)
        out.append(t * 500)  # spread over the vocabulary, all below 50257
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("specs", nargs="+", help="NAME=N[,N...]")
    ap.add_argument("--seeds", help="first seed of each NAME, comma-separated (default: 1, 2, 3, ... across shards)")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")] if a.seeds else None
    next_seed = 1
    for k, spec in enumerate(a.specs):
        name, _, counts = spec.partition("=")
        sizes = [int(c) for c in counts.split(",")]
        first = seeds[k] if seeds else next_seed
        for i, n in enumerate(sizes):
            shard("%s/%s_%06d.bin" % (a.dir, name, i), chain(n, first + i))
        next_seed = first + len(sizes)


if __name__ == "__main__":
    main()
