"""Host time of blockattn's Python layers above the launchers, on the CPU: attention() on the Triton backend under
TRITON_INTERPRET=1 with the forward and backward launchers stubbed out (they return buffers of the right shapes), so
what is timed is validation, argument preparation, the autograd Function and the ops' wrappers, on any machine. B1 H2
S256 D64 bf16, a prepared 128x128 BlockSparsity at density 0.5 (small: the buffers' allocation is not the point).
Per call, the fastest of 9 rounds of 2000: the forward without gradients, the forward of inputs that require grad,
and forward + torch.autograd.grad. The GPU host's real path costs 2-3 times its tight-loop times (BENCHMARKS.md,
thirty-first session). backend="triton" on CPU tensors also checks that the kernels were built for the interpreter
(about 1.5 us a call here), which CUDA tensors skip.

    python benchmarks/api_cost.py [--profile]
"""

import argparse
import cProfile
import os
import pstats
import timeit

os.environ["TRITON_INTERPRET"] = "1"  # before blockattn imports Triton's kernels: the triton backend on the CPU

import torch  # noqa: E402

import blockattn  # noqa: E402
from blockattn.kernels import forward, ops  # noqa: E402


def stub_launchers() -> None:
    """Replace the launchers ops calls by ones that only allocate their outputs."""
    def attention_forward(q, k, v, *args, **kwargs):
        return forward.output_buffers(q, v.shape[-1], False)

    def attention_backward(grad_out, q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ops.attention_forward, ops.attention_backward = attention_forward, attention_backward


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="a cProfile table of the forward without gradients")
    args = parser.parse_args()
    stub_launchers()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen).bfloat16().requires_grad_(True) for _ in range(3))
    grad = torch.randn(1, 2, 256, 64, generator=gen).bfloat16()
    blocks = blockattn.BlockSparsity.from_mask(torch.rand(1, 2, 2, 2, generator=gen) < 0.5, (128, 128), 256, 256)

    def forward_only():
        with torch.no_grad():
            blockattn.attention(q, k, v, blocks, backend="triton")

    def forward_with_grad():
        blockattn.attention(q, k, v, blocks, backend="triton")

    def forward_backward():
        torch.autograd.grad(blockattn.attention(q, k, v, blocks, backend="triton"), (q, k, v), grad)
    calls = {"forward, no grad": forward_only, "forward, inputs requiring grad": forward_with_grad,
             "forward + autograd.grad": forward_backward}
    best = dict.fromkeys(calls, float("inf"))
    for fn in calls.values():
        fn()
    for _ in range(9):  # rounds alternate between the calls, so that drift in the host's speed hits all alike
        for label, fn in calls.items():
            best[label] = min(best[label], timeit.timeit(fn, number=2000) / 2000 * 1e6)
    for label, us in best.items():
        print(f"{label}: {us:.1f} us", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5000):
            forward_only()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
