"""Speed target 5: the cost of BlockSparsity.from_mask for a [1, 24, 256, 256] mask against one forward at S=32k,
no host synchronization inside attention() with a prepared BlockSparsity, and capture in a CUDA graph.

    python benchmarks/prep_cost.py
"""

import torch
import triton.testing

import blockattn
from blockattn.bench import Case, block_mask


def main():
    device = torch.device("cuda")
    case = Case(density=0.25)
    keep = block_mask(case, device)
    blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 24, case.seq, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    forward_ms = triton.testing.do_bench(lambda: blockattn.attention(q, k, v, blocks), return_mode="median")
    prep_ms = triton.testing.do_bench(lambda: blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq),
                                      return_mode="median")
    both_ms = triton.testing.do_bench(
        lambda: blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq).q_lists(),
        return_mode="median")
    print(f"forward {forward_ms:.3f} ms; from_mask {prep_ms:.3f} ms = {prep_ms / forward_ms:.2%} of it; "
          f"with the backward's q lists {both_ms:.3f} ms = {both_ms / forward_ms:.2%}")

    # No host synchronization: CUDA's sync debug mode raises on any synchronizing call.
    blockattn.attention(q, k, v, blocks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        blockattn.attention(q, k, v, blocks)
        print("attention() with a prepared BlockSparsity: no host synchronization")
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # Capture in a CUDA graph, replay on new inputs, compare with eager.
    static_q = q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        blockattn.attention(static_q, k, v, blocks)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = blockattn.attention(static_q, k, v, blocks)
    new_q = torch.randn_like(q)
    static_q.copy_(new_q)
    graph.replay()
    eager = blockattn.attention(new_q, k, v, blocks)
    replay_ms = triton.testing.do_bench(graph.replay, return_mode="median")
    print(f"CUDA graph: captured; replay equals eager: {torch.equal(static_out, eager)}; replay {replay_ms:.3f} ms")


if __name__ == "__main__":
    main()
