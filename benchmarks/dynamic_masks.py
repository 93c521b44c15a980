"""A mask made afresh for every call (a video model's top-k blocks chosen each step): what the backward's per-mask
preparation (tile order, the paired programs' matching and lists) costs, against the same calls on one mask whose
lists stay cached. 128x64 blocks (paired programs), random masks, bf16, D=128.

Per case and way, the wall time per call of `calls` forward+backward calls in a row, each on its own mask (from
`distinct` masks made beforehand, BlockSparsity.from_mask called inside the call), synchronized once at the end,
and the host time the loop took to enqueue them. Ways:

- "same mask": one BlockSparsity for all calls (the preparation cached; tiles matched from the second call on);
- "new mask": a new mask per call, the default: its tiles unmatched (backward_ws.MATCH_FROM_USE 2), the preparation
  (tile order, pair lists) replayed from CUDA graphs (kernels/replay.py);
- "new, matched": the same with the tiles matched at once (MATCH_FROM_USE 1), replayed;
- "new, matched, eager": matched at once and computed eagerly (replay.ENABLED False), as the package ran until the
  fortieth session (the preparation's ~200 PyTorch operations on the host each call);
- "new, step captured": the whole step (from_mask, forward, backward) captured once in a CUDA graph, a call copying
  the next mask into the graph's mask tensor and replaying it (a user's torch.cuda.graphs capture; the host does
  almost nothing, and the tiles are unmatched: nothing is kept under a capture);
- "new, compiled": the step compiled with torch.compile(mode="reduce-overhead", fullgraph=True), the mask an
  argument (Inductor's CUDA graphs replay forward and backward; the tiles unmatched as under any capture).

    python benchmarks/dynamic_masks.py --calls 30
    python benchmarks/dynamic_masks.py --profile     # the first case's kernels per call, same mask and new mask
    python benchmarks/dynamic_masks.py --first-calls # the first case's first calls on a mask, wall ms each
    python benchmarks/dynamic_masks.py --host-profile --cases 24,24,4096,0.1  # where a new mask's host time goes
    python benchmarks/dynamic_masks.py --cases 24,24,4096,0.1 --ways "same mask" "new mask" "new, compiled"
"""

import argparse
import cProfile
import itertools
import pstats
import time

import torch

import blockattn
from blockattn.kernels import backward_ws, replay

# (heads, kv heads, sequence, density)
CASES = [(24, 24, 16384, 0.1), (24, 24, 32768, 0.1), (32, 8, 16384, 0.1), (24, 24, 16384, 0.5)]
BLOCK = (128, 64)


def one_call(q, k, v, grad, masks, same: bool):
    """A function running one forward+backward call, on masks[0] always (`same`) or on the next of masks."""
    shared = blockattn.BlockSparsity.from_mask(masks[0], BLOCK, q.shape[2], k.shape[2])
    calls = itertools.count()

    def call():
        blocks = shared if same else blockattn.BlockSparsity.from_mask(masks[next(calls) % len(masks)], BLOCK,
                                                                      q.shape[2], k.shape[2])
        torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad)
    return call


def captured_step(q, k, v, grad, masks):
    """A function running one forward+backward call on the next of masks as the replay of a CUDA graph that captured
    the whole step, BlockSparsity.from_mask included, on a mask tensor each call overwrites."""
    from short_graphs import graphed
    mask = masks[0].clone()
    replay_step = graphed(lambda: torch.autograd.grad(blockattn.attention(
        q, k, v, blockattn.BlockSparsity.from_mask(mask, BLOCK, q.shape[2], k.shape[2])), (q, k, v), grad))
    calls = itertools.count()

    def call():
        mask.copy_(masks[next(calls) % len(masks)])
        replay_step()
    return call


def compiled_step(q, k, v, grad, masks):
    """A function running one forward+backward call on the next of masks through torch.compile's mode
    "reduce-overhead" (CUDA graph trees), BlockSparsity.from_mask inside the compiled function."""
    def step(q, k, v, mask):
        return blockattn.attention(q, k, v, blockattn.BlockSparsity.from_mask(mask, BLOCK, q.shape[2], k.shape[2]))
    compiled = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")
    calls = itertools.count()

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        torch.autograd.grad(compiled(q, k, v, masks[next(calls) % len(masks)]), (q, k, v), grad)
    return call


# (same mask, replayed, the call from which on tiles are matched), or the function building the call
WAYS = {"same mask": (True, True, 2), "new mask": (False, True, 2), "new, matched": (False, True, 1),
        "new, matched, eager": (False, False, 1), "new, step captured": captured_step, "new, compiled": compiled_step}


def run_calls(call, calls: int) -> tuple:
    """(wall ms, host ms) per call of `calls` forward+backward calls, each `call()` (a way's function)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return wall * 1e3 / calls, host * 1e3 / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--distinct", type=int, default=8, help="masks made beforehand, used in turn")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="print the first case's GPU time per kernel (torch.profiler), same mask and new mask")
    parser.add_argument("--first-calls", action="store_true",
                        help="print the wall time of each of the first case's first calls on new masks of one shape")
    parser.add_argument("--host-profile", action="store_true",
                        help="print cProfile's view of the first case's host time, new mask each call")
    parser.add_argument("--cases", nargs="+", default=None, help="heads,kv_heads,seq,density each (default: CASES)")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS), metavar="WAY",
                        help="which ways to time (default: all): " + ", ".join(f'"{w}"' for w in WAYS))
    args = parser.parse_args()
    cases = CASES if args.cases is None else [
        (int(h), int(hkv), int(s), float(d)) for h, hkv, s, d in (c.split(",") for c in args.cases)]
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.calls} calls a way, ms per call "
          "(wall / host enqueue)")
    print("| case | " + " | ".join(args.ways) + " |")
    print("| --- " * (len(args.ways) + 1) + "|")
    for heads, kv_heads, seq, density in cases:
        gen = torch.Generator(device=device).manual_seed(seq + heads)
        nq, nk = seq // BLOCK[0], seq // BLOCK[1]
        masks = [torch.rand(1, heads, nq, nk, generator=gen, device=device) < density for _ in range(args.distinct)]
        q = torch.randn(1, heads, seq, 128, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, seq, 128, generator=gen, device=device, dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        grad = torch.randn_like(q)
        if args.first_calls:
            for replayed in (True, False, True):
                replay.ENABLED = replayed
                replay.clear()
                for mask in masks[:3]:  # each mask's first three calls, graphs captured on the first mask's
                    call, walls = one_call(q, k, v, grad, [mask], True), []
                    for _ in range(3):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        call()
                        torch.cuda.synchronize()
                        walls.append((time.perf_counter() - start) * 1e3)
                    print(f"replayed {replayed}: a mask's first three calls " + " / ".join(f"{t:.1f}" for t in walls)
                          + " ms", flush=True)
            replay.ENABLED = True
            return
        if args.host_profile:
            call = one_call(q, k, v, grad, masks, False)
            for _ in range(5):  # compiles, captures
                call()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                call()
            profiler.disable()
            torch.cuda.synchronize()
            print(f"H{heads}/{kv_heads} S{seq} d={density}, new mask, {args.calls} calls:")
            stats = pstats.Stats(profiler).strip_dirs()
            stats.sort_stats("cumulative").print_stats(40)
            stats.sort_stats("tottime").print_stats(25)
            return
        if args.profile:
            from ws_backward import profile
            for same in (True, False):
                profile(f"H{heads}/{kv_heads} S{seq} d={density} {'same mask' if same else 'new mask'}",
                        one_call(q, k, v, grad, masks, same), top=16)
            return
        ways = {name: WAYS[name] for name in args.ways}
        results = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                same, replayed, match_from = way if isinstance(way, tuple) else (False, True, 2)
                replay.ENABLED, backward_ws.MATCH_FROM_USE = replayed, match_from
                # warm-up: compiles, captures, and for "same mask" its first two calls (the second matches its
                # tiles), so that the timed calls are all alike
                call = (one_call(q, k, v, grad, masks, same) if isinstance(way, tuple)
                        else way(q, k, v, grad, masks))
                run_calls(call, 3)
                results[name].append(run_calls(call, args.calls))
        replay.ENABLED, backward_ws.MATCH_FROM_USE = True, 2
        cells = [" ".join(f"{wall:.2f} / {host:.2f}" for wall, host in results[name]) for name in ways]
        label = f"H{heads}" + (f"/{kv_heads}" if kv_heads != heads else "") + f" S{seq} d={density}"
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
