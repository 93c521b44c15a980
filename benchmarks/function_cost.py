"""Autograd's host cost for blockattn's eager Function, with the kernels stubbed out (runs on the CPU): the
Function as it is (apply(q, k, v, rest), seventeen non-differentiable arguments in one tuple) against the same
Function taking them as seventeen arguments (as before the thirty-first session), for apply alone and for apply +
torch.autograd.grad. The fastest of 7 rounds, per call.

    python benchmarks/function_cost.py
"""

import timeit

import torch

from blockattn.kernels import ops


class FlatAttention(torch.autograd.Function):
    """EagerAttention with sparse_attention_fwd's flat signature: apply(q, k, v, *rest)."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = ops.forward_eager(*inputs)
        ops._setup_context(ctx, inputs, (out, lse))
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        return ops._gradients(ctx, grad_out, grad_lse, ops.backward_some) + (None,) * 17


def main():
    q, k, v = (torch.randn(2, 2, 16, 16, requires_grad=True) for _ in range(3))  # small: the host cost is the point
    out, lse, grad = torch.empty(2, 2, 16, 16), torch.empty(2, 2, 16), torch.randn(2, 2, 16, 16)
    count, index = torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    rest = (count, index, count, index, None, None, None, None, None, 0.1, 128, 128, 128, 128, False, 0, 0)
    ops.forward_eager = lambda *args: (torch.empty_like(out), torch.empty_like(lse))
    ops.backward_some = lambda needs, *args: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    calls = {"EagerAttention (rest in one tuple)": lambda: ops.EagerAttention.apply(q, k, v, rest),
             "flat signature": lambda: FlatAttention.apply(q, k, v, *rest)}
    best = {label: [float("inf")] * 2 for label in calls}
    for _ in range(7):  # rounds alternate between the two, so that drift in the host's speed hits both alike
        for label, apply in calls.items():
            def forward_backward():
                torch.autograd.grad(apply()[0], (q, k, v), grad)
            best[label][0] = min(best[label][0], timeit.timeit(apply, number=2000) / 2000 * 1e6)
            best[label][1] = min(best[label][1], timeit.timeit(forward_backward, number=500) / 500 * 1e6)
    for label, (alone, both) in best.items():
        print(f"{label}: apply {alone:.1f} us, apply + autograd.grad {both:.1f} us", flush=True)


if __name__ == "__main__":
    main()
