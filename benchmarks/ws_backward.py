"""The backward with and without the warp-specialized Gluon kernel (kernels/backward_ws.py), and FlexAttention's
backward on the same block mask, in one process: ms and effective TFLOP/s per case (5 tile products credited,
2.5x the forward's FLOPs), each ratio to FlexAttention, and the largest gap between the two blockattn gradients.

    python benchmarks/ws_backward.py                       # the design cases, 128x128 blocks, densities 1 .. 0.1
    python benchmarks/ws_backward.py --cases short gqa     # B8 H16 S2048/4096 d=0.5; GQA 32/8 S16384
    python benchmarks/ws_backward.py --cases causal blocks # causal (and cuDNN's causal backward); 256x256, 64x128
    python benchmarks/ws_backward.py --cases d64           # head dim 64: densities 0.5 .. 0.1, causal, GQA, B8
    python benchmarks/ws_backward.py --cases paired        # 128x64 blocks (paired programs): the same spread
    python benchmarks/ws_backward.py --profile             # also each backward's GPU time per kernel (torch.profiler)
    python benchmarks/ws_backward.py --cases paired --skip 3 --no-flex  # from the fourth case on, without flex
"""

import argparse
import math
import time

import torch

import blockattn
from blockattn.bench import Case, _flops, _inputs, _runners, _time_ms, block_mask
from blockattn.kernels import backward_ws

SUITES = {
    "design": [Case(density=d) for d in (1.0, 0.5, 0.25, 0.1)],
    "short": [Case(batch=8, heads=16, kv_heads=16, seq=s, density=0.5) for s in (2048, 4096)],
    "gqa": [Case(heads=32, kv_heads=8, seq=16384, density=d) for d in (0.5, 0.1)],
    "blocks": [Case(block=(256, 256), density=0.25), Case(block=(64, 128), density=0.25)],
    # is_causal over the block-causal mask at 128x128 (the warp-specialized backward needs 128-key blocks)
    "causal": [Case(pattern="causal", density=0.5), Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal",
                                                       density=0.5)],
    # head dim 64 (the kernel's dQ over each consumer's own keys)
    "d64": [Case(dim=64, density=d) for d in (0.5, 0.25, 0.1)] + [
        Case(dim=64, pattern="causal", density=0.5), Case(dim=64, heads=32, kv_heads=8, seq=16384, density=0.25),
        Case(dim=64, batch=8, heads=16, kv_heads=16, seq=4096, density=0.5)],
    # 128x64 blocks: paired programs (two 64-key tiles each). FlexAttention's compiled backward finds no config for
    # 64-key blocks (benchmarks/flex_variants.py times the ways around that), so its column may read "failed"
    # (--no-flex skips it).
    "paired": [Case(block=(128, 64), density=d) for d in (0.5, 0.25, 0.1)] + [
        Case(block=(128, 64), heads=32, kv_heads=8, seq=16384, density=0.25),
        Case(block=(128, 64), pattern="causal", density=0.5), Case(block=(128, 64), dim=64, density=0.25),
        Case(block=(128, 64), batch=8, heads=16, kv_heads=16, seq=4096, density=0.5)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["design"], choices=list(SUITES))
    parser.add_argument("--profile", action="store_true",
                        help="print the GPU time of each kernel of the backward calls (blockattn's and flex's)")
    parser.add_argument("--no-flex", action="store_true",
                        help="skip FlexAttention (its 128x64 backward fails after a long compile)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first N cases of the chosen suites")
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| case | Triton backward ms | warp-specialized ms | flex ms | Triton vs flex | warp-specialized vs flex |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in [c for name in args.cases for c in SUITES[name]][args.skip:]:
        keep = block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=True)
        grad = torch.randn_like(q)
        flops = 2.5 * _flops(case, blocks.density())
        causal = case.pattern == "causal"
        out = blockattn.attention(q, k, v, blocks, is_causal=causal)
        times, grads = {}, {}
        for enabled in (False, True):
            backward_ws.ENABLED = enabled
            grads[enabled] = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
            times[enabled] = _time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        backward_ws.ENABLED = True
        times["flex"] = float("nan")  # skipped (--no-flex) or failed
        if not args.no_flex:
            try:
                flex_out = _runners(case, keep, device)["flex"][0](q, k, v)
                times["flex"] = _time_ms(lambda: torch.autograd.grad(flex_out, (q, k, v), grad, retain_graph=True))
            except Exception as error:  # FlexAttention's backward at 64-key blocks: a result too
                print(f"flex failed on {case.label}: {type(error).__name__}", flush=True)
        if causal:  # cuDNN's causal backward: the dense baseline a language model would otherwise run
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                sdpa_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            ms = _time_ms(lambda: torch.autograd.grad(sdpa_out, (q, k, v), grad, retain_graph=True))
            print(f"cuDNN SDPA causal backward {case.label}: {ms:.3f} ms", flush=True)
        if args.profile:
            profile(f"blockattn {case.label}", lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        if args.profile and not math.isnan(times["flex"]):
            profile(f"flex {case.label}", lambda: torch.autograd.grad(flex_out, (q, k, v), grad, retain_graph=True))
        gaps = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads[True], grads[False])]

        def cell(ms):
            return f"{ms:.3f} ({flops / ms / 1e9:.0f})"
        print(f"| {case.label} | {cell(times[False])} | {cell(times[True])} | {cell(times['flex'])} | "
              f"{times['flex'] / times[False]:.2f}x | {times['flex'] / times[True]:.2f}x | relative gap dq/dk/dv "
              + "/".join(f"{g:.1e}" for g in gaps), flush=True)


def profile(label, call, calls=10, top=8):
    """Print each kernel's GPU time per call of `call` (after a warm-up call), largest first; and, for the same
    calls back to back (no cache flush between them, unlike _time_ms), the wall time per call between CUDA events
    and the host's enqueue time per call. Wall above the kernels' sum is time the GPU waited (for the host, or at
    launches); a host synchronization inside the call would show as enqueue time close to the wall time."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begun = time.perf_counter()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    enqueue_ms = (time.perf_counter() - begun) * 1e3 / calls
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / calls
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels) / calls / 1e3
    print(f"{label}: GPU time per call {total:.3f} ms (back to back: wall {wall_ms:.3f}, host enqueue "
          f"{enqueue_ms:.3f} ms/call): " + "; ".join(
        f"{e.key[:60]} {e.device_time_total / calls / 1e3:.3f} ms x{e.count // calls}" for e in kernels[:top]), flush=True)


if __name__ == "__main__":
    main()
