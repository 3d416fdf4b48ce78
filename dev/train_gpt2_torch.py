#!/usr/bin/env python3
"""PyTorch reference trainer for train_gpt2cu: the same model, data, schedule and optimizer, in PyTorch
with bf16 autocast (fp32 parameters and AdamW state, bf16 matmuls and attention), for comparing losses
step by step and throughput side by side on the same GPU.

It loads one of our model files (llm.c version 3 = fp32 or 5 = bf16) or makes a new model from a
descriptor (d2 .. d48, GPT-2 initialisation, not bitwise ours), and reads our token shards in the order
train_gpt2cu's DataLoader (llmc/dataloader.h) hands them to one rank: sample k of a shard = tokens
[k*T, k*T + T + 1); with --shuffle 1 (the default, as in train_gpt2cu) a per-epoch shard order and a
per-(epoch, shard) sample order, seeded permutations drawn from SplitMix64 and seeded by --seed exactly
as train_gpt2cu's --seed seeds them; with --shuffle 0 shards in name order and samples in file order
(validation always reads that way); B consecutive samples per micro-batch, epochs concatenated. So
starting both from the same model file with the same -b, -t, --seed and --shuffle gives the same
batches (test/test_torch_ref_order.sh checks the order against the DataLoader's, sample for sample).
Learning-rate schedules are those of llmc/schedule.h; AdamW decays the weight matrices only (wte, wpe,
qkvw, attprojw, fcw, fcprojw); clipping multiplies the gradients by clip / norm when the global norm
exceeds clip, as train_gpt2cu does.

Prints one line per step (loss, lr, norm, ms, tok/s), the validation loss every -v steps, the mean
throughput (steps after the first) and the peak GPU memory; with --compare LOG.jsonl (train_gpt2cu's
log) it also prints both losses per step and the largest relative difference.

The model itself is dev/gpt2_torch.py's, which the check of the CPU reference model
(test/oracles/gpt2_torch_ref.py) uses too. Not provided: sampling, checkpoints, several GPUs.

Example (the same start and data for both):
  ./train_gpt2cu -e d12 -x 0 -v 0 -s 0 --save-model llmc -o out/init              # writes out/init/model.bin
  ./train_gpt2cu -e out/init/model.bin --shuffle 1 --seed 1337 -b 16 -t 1024 -x 50 -v 25 -s 0 -o out/ours
  python3 dev/train_gpt2_torch.py -e out/init/model.bin --shuffle 1 --seed 1337 -b 16 -t 1024 -x 50 -v 25 \
      --compare out/ours/log.jsonl
"""
import argparse
import contextlib
import glob
import json
import math
import sys
import time

import numpy as np
import torch

from gpt2_torch import DECAYED, DESCRIPTORS, NAMES, forward, load_model, new_model

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9e3779b97f4a7c15  # splitmix64's increment, also the stream multiplier of stream_seed()


def splitmix64_mix(z):
    """llmc/rand.h's splitmix64_mix, on a Python int (or, elementwise, a numpy uint64 array)."""
    if isinstance(z, np.ndarray):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
        return z ^ (z >> np.uint64(31))
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK64
    return z ^ (z >> 31)


def seeded_permutation(seed, n):
    """llmc/dataloader.h's seeded_permutation: Fisher-Yates from the top, swapping out[i-1] with
    out[below(i)] for i = n..2, where below(i) draws SplitMix64 outputs (the c-th output is
    mix(seed + c * GOLDEN64)) and rejects those under (2^64 - i) % i. The draws are made in numpy
    batches; a rejection (probability < 2^-32 a draw) restarts the batch after the rejected output."""
    out = list(range(n))
    if n < 2:
        return np.array(out, dtype=np.int64)
    bounds = np.arange(n, 1, -1, dtype=np.uint64)
    thresholds = (np.uint64(0) - bounds) % bounds
    draws = np.empty(n - 1, dtype=np.uint64)
    used, k = 0, 0  # generator outputs consumed, draws done
    while k < n - 1:
        m = n - 1 - k
        counters = np.arange(used + 1, used + m + 1, dtype=np.uint64)
        r = splitmix64_mix(np.uint64(seed) + counters * np.uint64(GOLDEN64))
        ok = r >= thresholds[k:]
        take = m if ok.all() else int(np.argmin(ok))
        draws[k:k + take] = r[:take] % bounds[k:k + take]
        k += take
        used += take if take == m else take + 1
    for i, j in zip(range(n - 1, 0, -1), draws.tolist()):
        out[i], out[j] = out[j], out[i]
    return np.array(out, dtype=np.int64)


class Shards:
    """One rank's (W=1) samples in the order of llmc/dataloader.h's SampleSchedule: a sample is T+1
    tokens starting at a multiple of T; an epoch is every shard's samples, shards in a per-epoch order
    and each shard's samples in a per-(epoch, shard) order (seeded permutations with shuffle, else name
    order and file order); epochs concatenated, batch i = stream samples [i*B, i*B + B)."""

    def __init__(self, pattern, B, T, shuffle=False, seed=0):
        paths = []
        for item in pattern.split(","):
            matches = sorted(glob.glob(item))
            if not matches:
                sys.exit(f"no shard file matches '{item}'")
            paths += matches
        if len(set(paths)) != len(paths):
            sys.exit(f"a shard is named twice by '{pattern}'")
        self.tokens, self.counts = [], []
        for p in paths:
            h = np.fromfile(p, dtype=np.int32, count=256)
            if h[0] != 20240520 or h[1] not in (1, 2):
                sys.exit(f"{p}: not a token shard (magic {h[0]}, version {h[1]})")
            n = int(h[2]) if h[1] == 1 else (int(h[2]) & 0xffffffff) | (int(h[3]) << 32)
            if n < T + 1:
                sys.exit(f"{p}: {n} tokens, fewer than one sample of T+1 = {T + 1}")
            self.tokens.append(np.memmap(p, dtype=np.uint16 if h[1] == 1 else np.uint32, mode="r", offset=1024,
                                         shape=(n,)))
            self.counts.append((n - 1) // T)
        self.samples_per_epoch = sum(self.counts)
        if self.samples_per_epoch < B:
            sys.exit(f"'{pattern}' holds {self.samples_per_epoch} samples, fewer than one batch of B = {B}")
        self.B, self.T, self.shuffle, self.seed = B, T, shuffle, seed & MASK64
        self.epochs = {}  # epoch -> (shard, token offset) arrays of its samples in stream order; the last two

    def stream_seed(self, epoch, stream):
        """Stream 0 orders the epoch's shards; stream slot+1 orders the samples of the shard at that slot."""
        z = splitmix64_mix(splitmix64_mix(self.seed) ^ epoch)
        return splitmix64_mix(z ^ ((stream * GOLDEN64) & MASK64))

    def epoch_samples(self, epoch):
        if epoch not in self.epochs:
            n = len(self.counts)
            order = seeded_permutation(self.stream_seed(epoch, 0), n) if self.shuffle else np.arange(n)
            shards, offsets = [], []
            for slot, k in enumerate(order.tolist()):
                c = self.counts[k]
                samples = seeded_permutation(self.stream_seed(epoch, slot + 1), c) if self.shuffle else np.arange(c)
                shards.append(np.full(c, k, dtype=np.int64))
                offsets.append(samples * self.T)
            self.epochs = {e: v for e, v in self.epochs.items() if e == epoch - 1}
            self.epochs[epoch] = (np.concatenate(shards), np.concatenate(offsets))
        return self.epochs[epoch]

    def samples(self, i):
        """(shard index, token offset) of the B samples of batch i."""
        out = []
        for s in range(i * self.B, i * self.B + self.B):
            shards, offsets = self.epoch_samples(s // self.samples_per_epoch)
            j = s % self.samples_per_epoch
            out.append((int(shards[j]), int(offsets[j])))
        return out

    def rows(self, i):
        """Batch i as a (B, T+1) int64 array of tokens."""
        return np.stack([np.asarray(self.tokens[k][off:off + self.T + 1], dtype=np.int64)
                         for k, off in self.samples(i)])

    def batch(self, i, device):
        x = torch.from_numpy(self.rows(i)).to(device, non_blocking=True)
        return x[:, :-1], x[:, 1:]

    def batches_per_epoch(self):
        return self.samples_per_epoch // self.B


def lr_at(a, step, total):
    """llmc/schedule.h's LRSchedule::at."""
    lo = a.lr if a.schedule == "constant" else a.lr * a.final_lr_fraction
    if step >= total:
        return lo
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.schedule == "constant":
        return a.lr
    start = a.warmup
    if a.schedule == "wsd":
        start = max(a.warmup, total - int(math.floor(a.decay_fraction * total + 0.5)))
        if step < start:
            return a.lr
    progress = (step - start) / (total - start)
    if a.schedule == "cosine":
        return lo + 0.5 * (a.lr - lo) * (1.0 + math.cos(math.pi * progress))
    return a.lr + (lo - a.lr) * progress


def loss_of(P, c, idx, targets):
    return forward(P, c, idx, targets)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-i", "--train", default="data/quickstart_train_*.bin")
    ap.add_argument("-j", "--val", default="data/quickstart_val_*.bin", help='"" for none')
    ap.add_argument("-e", "--model", default="d12", help="model file (v3/v5) or descriptor d2..d48")
    ap.add_argument("-b", "--batch-size", type=int, default=4)
    ap.add_argument("-t", "--seq-len", type=int, default=1024)
    ap.add_argument("-d", "--total-batch", type=int, default=-1)
    ap.add_argument("-l", "--lr", type=float, default=3e-4)
    ap.add_argument("-u", "--warmup", type=int, default=0)
    ap.add_argument("-q", "--final-lr-fraction", type=float, default=1.0)
    ap.add_argument("-c", "--weight-decay", type=float, default=0.0)
    ap.add_argument("-x", "--max-steps", type=int, default=-1)
    ap.add_argument("-v", "--val-every", type=int, default=20)
    ap.add_argument("-m", "--val-max-steps", type=int, default=20)
    ap.add_argument("-k", "--schedule", default="cosine", choices=["cosine", "linear", "constant", "wsd"])
    ap.add_argument("--decay-fraction", type=float, default=0.2)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--seed", type=int, default=1337,
                    help="seed of a new model's initialisation and of the training data order (train_gpt2cu's --seed)")
    ap.add_argument("--shuffle", type=int, default=1, choices=[0, 1],
                    help="1: train_gpt2cu's shuffled order (seeded by --seed); 0: shards in name order, samples in file order")
    ap.add_argument("--compile", type=int, default=0, help="1: torch.compile the forward")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                    help="bf16: autocast (the reference); fp32: no autocast and no TF32, for the noise floor of bf16")
    ap.add_argument("--log", help="write the step and val losses as JSONL (train_gpt2cu's keys), for --compare")
    ap.add_argument("--compare", help="train_gpt2cu's log.jsonl: print both losses per step and judge them")
    ap.add_argument("--max-loss-diff", type=float, default=0.05,
                    help="with --compare: the largest |loss difference| allowed at any step (default 0.05)")
    ap.add_argument("--max-val-rel", type=float, default=0.01,
                    help="with --compare: the largest relative difference of the final val loss (default 0.01)")
    a = ap.parse_args()
    if not 0 <= a.seed < 2**63:
        sys.exit(f"--seed {a.seed}: must lie in [0, 2^63) like train_gpt2cu's")

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to PyTorch")
    dev = torch.device("cuda")
    torch.manual_seed(a.seed)
    c, P0 = load_model(a.model) if a.model not in DESCRIPTORS else new_model(a.model, a.seed)
    B, T = a.batch_size, a.seq_len
    if T > c["maxT"]:
        sys.exit(f"-t {T} is longer than the model's maxT {c['maxT']}")
    tokens_per_step = B * T if a.total_batch == -1 else a.total_batch
    if tokens_per_step % (B * T):
        sys.exit(f"-d {tokens_per_step} is not a multiple of B*T = {B * T}")
    accum = tokens_per_step // (B * T)
    train = Shards(a.train, B, T, shuffle=bool(a.shuffle), seed=a.seed)
    val = Shards(a.val, B, T) if a.val and a.val_every > 0 else None
    steps = a.max_steps if a.max_steps >= 0 else max(1, train.batches_per_epoch() // accum)
    val_steps = 0
    if val:
        val_steps = val.batches_per_epoch() if a.val_max_steps == -1 else min(a.val_max_steps, val.batches_per_epoch())
        val_steps = max(1, val_steps)

    P = {n: torch.nn.Parameter(P0[n].to(dev, torch.float32)) for n in NAMES}
    nparams = sum(p.numel() for p in P.values())
    opt = torch.optim.AdamW(
        [{"params": [P[n] for n in NAMES if n in DECAYED], "weight_decay": a.weight_decay},
         {"params": [P[n] for n in NAMES if n not in DECAYED], "weight_decay": 0.0}],
        lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, fused=True)
    fwd = torch.compile(loss_of) if a.compile else loss_of
    if a.precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def autocast():
        if a.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16)

    log = open(a.log, "w") if a.log else None
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; model {a.model}: {c}, {nparams} parameters")
    print(f"B={B} T={T}, {tokens_per_step} tokens per step, {accum} micro-step(s), {steps} steps, compile={a.compile}, "
          f"precision={a.precision}, training data {'shuffled with seed %d' % a.seed if a.shuffle else 'in order'}")

    def evaluate():
        with torch.no_grad(), autocast():
            losses = [fwd(P, c, *val.batch(i, dev)).item() for i in range(val_steps)]
        return sum(losses) / len(losses)

    ours, ours_val = {}, {}
    if a.compare:
        for line in open(a.compare):
            r = json.loads(line)
            if "loss" in r:
                ours[r["step"]] = r["loss"]
            if "val_loss" in r:
                ours_val[r["step"]] = r["val_loss"]
    worst, worst_abs, timed, timed_s, batch_index = 0.0, 0.0, 0, 0.0, 0
    final_val = None
    for step in range(steps + 1):
        if val and (step % a.val_every == 0 or step == steps):
            final_val = evaluate()
            print(f"step {step:5d}/{steps} | val loss {final_val:.6f}")
            if log:
                log.write(json.dumps({"step": step, "val_loss": final_val}) + "\n")
        if step == steps:
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lr = lr_at(a, step, max(1, steps))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dev)
        for _ in range(accum):
            x, y = train.batch(batch_index, dev)
            batch_index += 1
            with autocast():
                loss = fwd(P, c, x, y)
            (loss / accum).backward()
            loss_sum += loss.detach()
        grads = [p.grad for p in P.values()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if a.grad_clip > 0:
            scale = torch.where(norm > a.grad_clip, a.grad_clip / norm, torch.ones_like(norm))
            torch._foreach_mul_(grads, scale)
        opt.step()
        loss_value, norm_value = (loss_sum / accum).item(), norm.item()
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        if step > 0 or steps == 1:
            timed, timed_s = timed + 1, timed_s + secs
        line = (f"step {step + 1:5d}/{steps} | loss {loss_value:.6f} | lr {lr:.2e} | norm {norm_value:.4f} | "
                f"{secs * 1e3:.2f} ms | {tokens_per_step / secs:.0f} tok/s")
        if step + 1 in ours:
            rel = abs(ours[step + 1] - loss_value) / abs(loss_value)
            worst = max(worst, rel)
            worst_abs = max(worst_abs, abs(ours[step + 1] - loss_value))
            line += f" | train_gpt2cu loss {ours[step + 1]:.6f} (rel diff {rel:.2e})"
        print(line, flush=True)
        if log:
            log.write(json.dumps({"step": step + 1, "loss": loss_value, "norm": norm_value}) + "\n")
    if log:
        log.close()
    if timed:
        print(f"average over {timed} steps: {1e3 * timed_s / timed:.2f} ms/step, {tokens_per_step * timed / timed_s:.0f} tok/s")
    print(f"peak GPU memory (torch.cuda.max_memory_allocated): {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if ours:
        print(f"largest relative loss difference to train_gpt2cu: {worst:.3e}")
        compared = sum(1 for k in range(1, steps + 1) if k in ours)
        ok = compared == steps and worst_abs <= a.max_loss_diff
        verdict = (f"per-step |loss difference|: max {worst_abs:.4f} over {compared}/{steps} steps "
                   f"(limit {a.max_loss_diff}) {'PASS' if ok else 'FAIL'}")
        if final_val is not None and steps in ours_val:
            rel_val = abs(ours_val[steps] - final_val) / abs(final_val)
            val_ok = rel_val <= a.max_val_rel
            ok = ok and val_ok
            verdict += (f"; final val loss {ours_val[steps]:.6f} (ours) vs {final_val:.6f} (torch): rel diff "
                        f"{rel_val:.2e} (limit {a.max_val_rel}) {'PASS' if val_ok else 'FAIL'}")
        print(verdict)
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
