"""How much of a short eager forward+backward's host time is autograd's own, and how much is blockattn's: host
enqueue per call (fastest of several rounds, calls back to back, no profiler) of

  - a Function that launches nothing (its forward returns two new buffers, its backward three) on the same CUDA
    tensors (autograd runs the backward on its device thread) and on CPU tensors (on the calling thread);
  - blockattn's forward+backward through autograd (with autograd's multithreading on, its default, and off:
    torch.autograd.set_multithreading_enabled(False) runs the backward on the calling thread), and its forward
    alone with inputs requiring grad;
  - blockattn's backward (ops.backward_some, with the arguments autograd gave it) called directly on the calling
    thread, and the same on a second Python thread, to see what the device thread itself costs;
  - where a forward+backward's time goes on autograd's device thread: from autograd.grad's call to backward_some's
    start (the hand-off), inside backward_some, and from its end to autograd.grad's return (medians).

B8 H16 S1024 D128 bf16, d=0.5, 128x128 blocks by default (--batch, --heads, --seq, --density, --block).

    python benchmarks/autograd_floor.py [--seq 1024] [--calls 50] [--rounds 7]
    python benchmarks/autograd_floor.py --batch 1 --heads 24 --seq 8192 --density 0.1
    taskset -c 3 python benchmarks/autograd_floor.py   (every thread on one core)
"""

import argparse
import statistics
import threading
import time

import torch

import blockattn
from blockattn.kernels import ops

from exp_short import calling_thread, short_case, short_inputs
from host_cost import per_call_us


class Empty(torch.autograd.Function):
    """attention()'s Function's shape without its work: new (out, lse) buffers forward, new (dq, dk, dv) back."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def on_thread(fn):
    """fn run on a fresh Python thread (joined before returning)."""
    def run():
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128))
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.seq, args.density, tuple(args.block))
    rest = tuple(range(17))

    def row(label, fn, calls_per_fn: int = 1):
        """fn's host time (the fastest of --rounds rounds of calls back to back, the GPU drained between rounds),
        per call of what it runs calls_per_fn times."""
        print(f"{label}: {per_call_us(fn, args.calls // calls_per_fn, args.rounds) / calls_per_fn:.1f} us a call",
              flush=True)

    q, k, v, blocks, grad = short_inputs(*shape)
    for device in ("cuda", "cpu"):
        tq, tk, tv, tg = (t.detach().to(device).requires_grad_(t is not grad) for t in (q, k, v, grad))
        row(f"empty Function, {device}: forward", lambda: Empty.apply(tq, tk, tv, rest))
        row(f"empty Function, {device}: forward + autograd.grad",
            lambda: torch.autograd.grad(Empty.apply(tq, tk, tv, rest)[0], (tq, tk, tv), tg))
        row(f"empty Function, {device}: forward + autograd.grad, multithreading off",
            calling_thread(lambda: torch.autograd.grad(Empty.apply(tq, tk, tv, rest)[0], (tq, tk, tv), tg)))

    _, fwd_bwd = short_case(*shape)
    for _ in range(10):
        fwd_bwd()
    captured = []
    inner = ops.backward_some

    def capture(*call_args):
        captured.append(call_args)
        return inner(*call_args)
    ops.backward_some = capture
    fwd_bwd()
    ops.backward_some = inner
    backward_args = captured[0]
    row("blockattn: forward with inputs requiring grad", lambda: blockattn.attention(q, k, v, blocks))
    row("blockattn: forward + autograd.grad", fwd_bwd)
    row("blockattn: forward + autograd.grad, multithreading off", calling_thread(fwd_bwd))
    row("blockattn: backward_some on the calling thread", lambda: inner(*backward_args))
    row("blockattn: backward_some on another Python thread (10 calls a thread)",
        on_thread(lambda: [inner(*backward_args) for _ in range(10)]), calls_per_fn=10)
    hand_off_split(fwd_bwd, inner, args.calls)
    print(f"(q {tuple(q.shape)} {q.dtype}; the thread's row includes starting and joining it)")


def hand_off_split(fwd_bwd, backward_some, calls: int) -> None:
    """Median times (us) of a forward+backward's pieces with the backward on autograd's device thread: the
    forward, the wait from autograd.grad's call to backward_some's start, backward_some itself, and the wait
    from its end to autograd.grad's return. Clocks read inside the call; the GPU is not waited for."""
    marks = {}

    def timed(*call_args):
        marks["start"] = time.perf_counter()
        try:
            return backward_some(*call_args)
        finally:
            marks["end"] = time.perf_counter()
    grad_fn = torch.autograd.grad
    pieces = {"forward": [], "hand-off": [], "backward_some": [], "return": []}

    def grad_timed(*call_args):
        called = time.perf_counter()
        pieces["forward"].append(called - marks["forward"])
        result = grad_fn(*call_args)
        returned = time.perf_counter()
        pieces["hand-off"].append(marks["start"] - called)
        pieces["backward_some"].append(marks["end"] - marks["start"])
        pieces["return"].append(returned - marks["end"])
        return result
    ops.backward_some, torch.autograd.grad = timed, grad_timed
    try:
        torch.cuda.synchronize()
        for _ in range(calls):
            marks["forward"] = time.perf_counter()
            fwd_bwd()
        torch.cuda.synchronize()
    finally:
        ops.backward_some, torch.autograd.grad = backward_some, grad_fn
    print("blockattn forward + autograd.grad on the device thread, medians: " + ", ".join(
        f"{name} {statistics.median(values) * 1e6:.1f} us" for name, values in pieces.items()), flush=True)


if __name__ == "__main__":
    main()
