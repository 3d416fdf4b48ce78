"""
attention_sdpa: PyTorch's fused attention kernels (scaled_dot_product_attention with each of its CUDA
backends: cuDNN, FlashAttention, memory-efficient) timed at the shapes our flash attention runs in a GPT-2
step, so that build/attention_lab's table has an outside yardstick: is there attention time left to win at
these shapes, and how much?

  python3 dev/attention_sdpa.py                      # d12: B=64, NH=12, T=1024, HS=64, causal, bf16
  python3 dev/attention_sdpa.py -b 16 --nh 16        # other shapes (d24: NH=16)

Run it right before or after ./build/attention_lab on the same GPU (both are short bursts at similar clocks; the
trainer runs at the power cap, where every kernel is slower). q, k, v and the output's gradient are
separate contiguous (B, NH, T, HS) tensors, the backends' own layout, so no copy into it is timed. Each
backend is first checked against PyTorch's math backend in fp32 on a small batch of the same shape
(relative error norm of out, dq, dk, dv), then timed: CUDA events, median of --iters launches after
--warmup, the forward alone and the backward alone (autograd.grad on a graph kept from one forward).
Where PyTorch offers other FlashAttention implementations (torch.nn.attention.list_flash_attention_impls,
e.g. FA3), each is timed as well. TFLOP/s count the causal products' useful work:
4 B NH T^2 HS / 2 forward (QK^T and PV), 2.5 times that backward (dV, dP, dQ, dK and S recomputed).
Needs a CUDA GPU and PyTorch >= 2.3 (torch.nn.attention.sdpa_kernel), else exits 2 saying which is
missing; a backend PyTorch cannot run at the shape is listed as unavailable with its reason. Exit 0 when
the table was printed (test/test_attention_sdpa.sh checks its errors on a GPU).
"""
import argparse
import statistics
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--batch", type=int, default=64)
    ap.add_argument("--nh", type=int, default=12)
    ap.add_argument("-t", "--seq", type=int, default=1024)
    ap.add_argument("--hs", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--check-batch", type=int, default=2, help="batch of the fp32 check (default 2)")
    args = ap.parse_args()
    for name in ("batch", "nh", "seq", "hs", "iters", "check_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.warmup < 0:
        ap.error(f"--warmup must not be negative (got {args.warmup})")

    try:
        import torch
    except ImportError as e:
        print(f"attention_sdpa: cannot import PyTorch ({e})", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        print("attention_sdpa: no CUDA GPU visible to PyTorch", file=sys.stderr)
        return 2
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        print(f"attention_sdpa: PyTorch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs >= 2.3)",
              file=sys.stderr)
        return 2

    B, NH, T, HS = args.batch, args.nh, args.seq, args.hs
    dev = torch.device("cuda")
    backends = [("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FlashAttention", SDPBackend.FLASH_ATTENTION),
                ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)]

    def make(b, dtype, seed):
        # q, k, v and dout as separate contiguous (B, NH, T, HS) tensors: each backend's own layout, so
        # that no copy into it is timed.
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randn(b, NH, T, HS, device=dev, dtype=torch.float32, generator=g).to(dtype) for _ in range(4)]

    def run(tensors, backward):
        q, k, v, dout = (x.detach().requires_grad_(backward) for x in tensors)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            return out, torch.autograd.grad(out, (q, k, v), dout)
        return out, None

    def timed(fn):
        for _ in range(args.warmup):
            fn()
        ms = []
        for _ in range(args.iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ms.append(e0.elapsed_time(e1))
        return statistics.median(ms)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # fp32 reference on a small batch, then each backend's error against it.
    check = make(args.check_batch, torch.float32, 1)
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out, ref_grad = run(check, True)

    flop_fwd = 4.0 * B * NH * T * T * HS / 2
    flop_bwd = 2.5 * flop_fwd
    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    print(f"shape B={B} NH={NH} T={T} HS={HS}, causal, bf16; ms per launch, median of {args.iters}")
    print(f"{'backend':<18} | {'fwd ms':>8} | {'bwd ms':>8} | {'fwd TFLOP/s':>11} | {'bwd TFLOP/s':>11} | "
          f"max rel err (out, dq, dk, dv) against fp32")
    data = make(B, torch.bfloat16, 2)
    impls = []
    try:
        from torch.nn import attention as tna
        impls = [i for i in tna.list_flash_attention_impls() if i != tna.current_flash_attention_impl()]
    except (ImportError, AttributeError):
        pass
    for impl in impls:
        backends.append((f"FlashAttention {impl}", (SDPBackend.FLASH_ATTENTION, impl)))
    for name, be in backends:
        try:
            if isinstance(be, tuple):
                be, impl = be
                tna.activate_flash_attention_impl(impl)
            with sdpa_kernel([be]):
                o, g = run([x.to(torch.bfloat16) for x in check], True)
                errs = [rel(o, ref_out)] + [rel(g[i], ref_grad[i]) for i in range(3)]
                fwd = timed(lambda: run(data, False))
                q, k, v, dout = (x.detach().requires_grad_(True) for x in data)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                del out, q, k, v
        except (RuntimeError, ValueError, ImportError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"{name:<18} | unavailable: {reason[:100]}")
            continue
        print(f"{name:<18} | {fwd:8.3f} | {bwd:8.3f} | {flop_fwd / fwd / 1e9:11.0f} | {flop_bwd / bwd / 1e9:11.0f} | "
              + ", ".join(f"{x:.2e}" for x in errs))
    print("bwd ms: the backward alone (autograd.grad on a kept graph), PyTorch's own preprocessing included "
          "(e.g. D = rowsum(dO o O), as our backward's time includes it).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
