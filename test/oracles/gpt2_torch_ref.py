#!/usr/bin/python3
"""PyTorch check of the CPU reference GPT-2 (cpu/gpt2_cpu.h) and of the model file format.

Builds a tiny GPT-2 in PyTorch (dev/gpt2_torch.py's model, the one the PyTorch reference trainer uses
too), writes it as llm.c model files (fp32 version 3 and bf16 version 5), has build/gpt2_cpu_dump load
them and run forward, backward and 10 AdamW steps in fp32 and in fp64, runs the same in PyTorch, and
compares:
  - logits, loss, the gradient of every parameter tensor, the losses of 11 forwards around 10 AdamW
    steps and the gradient norms: ours fp32 vs PyTorch fp32 within 1e-5, ours fp64 vs PyTorch fp64
    within 1e-12 (relative: max |ours - torch| / max |torch| per quantity);
  - the files our writer produces from what it read: byte-identical to the ones written here, including
    the fp32 -> bf16 conversion (round to nearest even, ties included) and the bf16 -> fp32 reading.
Prints the worst case per quantity. Exit status 0 when everything agrees, 1 otherwise.

Usage: /usr/bin/python3 test/oracles/gpt2_torch_ref.py --dump build/gpt2_cpu_dump [--workdir DIR]
"""
import argparse
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "dev"))
from gpt2_torch import DECAYED, NAMES, forward, model_header, shapes, write_model  # noqa: E402

# A tiny model with an odd vocabulary (67, padded to 128) and T < maxT, so that padded rows and unused
# position rows exist; B and T are not powers of two.
CFG = dict(maxT=16, V=67, Vp=128, L=2, NH=4, C=32)
B, T, STEPS = 3, 11, 10
HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1, clip=1.0)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def init_params(c, seed):
    """Random parameters in llm.c's layout, larger than GPT-2's init so attention is far from uniform,
    with random LayerNorm weights and biases; padded vocabulary rows are zero."""
    g = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape in shapes(c).items():
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        if name in DECAYED:
            P[name] = 0.1 * r
        elif name in ("ln1w", "ln2w", "lnfw"):
            P[name] = 1.0 + 0.2 * r
        else:
            P[name] = 0.1 * r
    P["wte"][c["V"]:] = 0
    # Values exactly half-way between two bf16 numbers, so the fp32 -> bf16 rounding of ties is tested.
    ties = [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3C01_8000, 0x3C02_8000]
    for i, bits in enumerate(ties):
        P["lnfb"][i] = struct.unpack("<f", struct.pack("<I", bits))[0]
    return P


def run_torch(c, P0, batches, dtype):
    """Forward/backward on batch 0, then STEPS AdamW steps (decay on matrices only, clipping with llm.c's
    scale max_norm / norm), with torch.optim.AdamW doing the update."""
    P = {n: P0[n].detach().to(dtype).clone().requires_grad_(True) for n in NAMES}
    opt = torch.optim.AdamW(
        [{"params": [P[n] for n in NAMES if n in DECAYED], "weight_decay": HP["wd"]},
         {"params": [P[n] for n in NAMES if n not in DECAYED], "weight_decay": 0.0}],
        lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    out = {"losses": [], "norms": []}
    for step in range(STEPS + 1):
        inputs, targets = batches[step]
        logits, loss = forward(P, c, inputs, targets)
        out["losses"].append(loss.item())
        if step == STEPS:
            break
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if step == 0:
            out["loss"] = [loss.item()]
            out["logits"] = logits.detach().double().numpy().ravel()
            for n in NAMES:
                out["grad " + n] = P[n].grad.detach().double().numpy().ravel().copy()
        norm = torch.sqrt(sum((P[n].grad.double() ** 2).sum() for n in NAMES)).item()
        out["norms"].append(norm)
        if norm > HP["clip"]:
            for n in NAMES:
                P[n].grad.mul_(HP["clip"] / norm)
        opt.step()
    out["losses"] = np.array(out["losses"])
    out["norms"] = np.array(out["norms"])
    return out


def read_dump(path, c):
    """Splits gpt2_cpu_dump's float64 output into the same quantities as run_torch."""
    d = np.fromfile(path, dtype=np.float64)
    out, pos = {}, 0

    def take(key, n):
        nonlocal pos
        out[key] = d[pos:pos + n]
        pos += n
    take("loss", 1)
    take("logits", B * T * c["Vp"])
    for name, shape in shapes(c).items():
        take("grad " + name, int(np.prod(shape)))
    take("losses", STEPS + 1)
    take("norms", STEPS)
    if pos != d.size:
        raise SystemExit(f"{path}: {d.size} values, expected {pos}")
    return out


def rel_error(ours, ref):
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max()
    return np.abs(ours - ref).max() / (scale if scale > 0 else 1.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", required=True, help="path to the gpt2_cpu_dump binary")
    ap.add_argument("--workdir", help="where to put the files (default: a temporary directory)")
    args = ap.parse_args()
    torch.manual_seed(0)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpt2_torch_ref_")
    os.makedirs(workdir, exist_ok=True)
    f = lambda name: os.path.join(workdir, name)
    c = CFG
    P0 = init_params(c, seed=1234)
    write_model(f("model_fp32.bin"), c, P0, 3)
    write_model(f("model_bf16.bin"), c, P0, 5)

    g = torch.Generator().manual_seed(99)
    batches = [(torch.randint(0, c["V"], (B, T), generator=g), torch.randint(0, c["V"], (B, T), generator=g))
               for _ in range(STEPS + 1)]
    with open(f("tokens.bin"), "wb") as fh:
        fh.write(np.array([B, T, len(batches)], dtype=np.int32).tobytes())
        for inputs, targets in batches:
            fh.write(inputs.to(torch.int32).numpy().tobytes())
            fh.write(targets.to(torch.int32).numpy().tobytes())

    hp = ["--steps", str(STEPS), "--lr", repr(HP["lr"]), "--beta1", repr(HP["beta1"]), "--beta2",
          repr(HP["beta2"]), "--eps", repr(HP["eps"]), "--wd", repr(HP["wd"]), "--clip", repr(HP["clip"])]
    runs = [
        ["--model", f("model_fp32.bin"), "--tokens", f("tokens.bin"), "--out", f("ours_fp32.out"),
         "--write-model", f("ours_v3.bin"), "--write-version", "3"] + hp,
        ["--model", f("model_fp32.bin"), "--tokens", f("tokens.bin"), "--out", f("ours_fp64.out"), "--fp64",
         "--write-model", f("ours_v5.bin"), "--write-version", "5"] + hp,
        ["--model", f("model_bf16.bin"), "--write-model", f("ours_from_bf16.bin"), "--write-version", "3"],
    ]
    for r in runs:
        subprocess.run([args.dump] + r, check=True)

    failures = []

    def check(what, ok):
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    # Model files, both directions.
    read = lambda p: open(p, "rb").read()
    check("our fp32 writer reproduces the PyTorch-written version 3 file byte for byte",
          read(f("ours_v3.bin")) == read(f("model_fp32.bin")))
    check("our fp32 -> bf16 conversion reproduces PyTorch's (version 5 file byte for byte, ties included)",
          read(f("ours_v5.bin")) == read(f("model_bf16.bin")))
    expected = model_header(c, 3) + b"".join(
        P0[n].to(torch.bfloat16).to(torch.float32).numpy().tobytes() for n in NAMES)
    check("a bf16 file read by us and written as fp32 holds PyTorch's bf16 -> fp32 values",
          read(f("ours_from_bf16.bin")) == expected)
    check("the bf16 file really is rounded (differs from fp32)", expected != read(f("model_fp32.bin")))

    ref = {dt: run_torch(c, P0, batches, dt) for dt in (torch.float32, torch.float64)}
    ours = {torch.float32: read_dump(f("ours_fp32.out"), c), torch.float64: read_dump(f("ours_fp64.out"), c)}
    clipped = int((ref[torch.float64]["norms"] > HP["clip"]).sum())
    print(f"PyTorch {torch.__version__}; {c}, B={B} T={T}; losses {ref[torch.float32]['losses'][0]:.6f} -> "
          f"{ref[torch.float32]['losses'][-1]:.6f} over {STEPS} AdamW steps ({clipped} of them clipped)")
    check("the AdamW steps lower the loss", ref[torch.float32]["losses"][-1] < ref[torch.float32]["losses"][0] - 0.1)
    check("clipping is exercised on some steps but not all", 0 < clipped < STEPS)

    print(f"{'quantity':<16}{'fp32 vs torch fp32':>20}{'fp64 vs torch fp64':>20}{'fp32 vs torch fp64':>20}")
    worst = {torch.float32: 0.0, torch.float64: 0.0}
    for key in ref[torch.float32]:
        errs = [rel_error(ours[dt][key], ref[dt][key]) for dt in (torch.float32, torch.float64)]
        vs_exact = rel_error(ours[torch.float32][key], ref[torch.float64][key])
        print(f"{key:<16}{errs[0]:>20.3e}{errs[1]:>20.3e}{vs_exact:>20.3e}")
        for dt, e in zip((torch.float32, torch.float64), errs):
            worst[dt] = max(worst[dt], e)
            if not e <= TOL[dt]:
                failures.append(f"{key} ({dt}): relative error {e:.3e} > {TOL[dt]:.0e}")
    for dt in (torch.float32, torch.float64):
        print(f"worst case {str(dt).replace('torch.', '')}: {worst[dt]:.3e} (tolerance {TOL[dt]:.0e})")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
