"""Short sequences without the host: B8 H16 S1024/2048 forwards timed eagerly and as CUDA graph replays, for
blockattn and FlexAttention (compiled), so the kernels' own time shows apart from launch overhead. Also the
D=256 forward case of issue 6 (no regression below FlexAttention).

    python benchmarks/short_graphs.py
"""

import torch
import triton.testing

import blockattn
from blockattn.bench import Case, bench_case, block_mask, flex_block_mask, markdown


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main():
    from torch.nn.attention.flex_attention import flex_attention
    device = torch.device("cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    for seq in (1024, 2048):
        case = Case(batch=8, heads=16, kv_heads=16, seq=seq, density=0.5, block=(128, 128))
        blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, seq, seq)
        flex_mask = flex_block_mask(blocks)
        q, k, v = (torch.randn(8, 16, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        forwards = {"blockattn": lambda: blockattn.attention(q, k, v, blocks),
                    "flex": lambda: compiled(q, k, v, block_mask=flex_mask)}
        for name, forward in forwards.items():
            def fwd(forward=forward):
                with torch.no_grad():
                    return forward()

            def fwd_bwd(forward=forward):
                return torch.autograd.grad(forward(), (q, k, v), grad)
            for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                replay = triton.testing.do_bench(graphed(fn), warmup=25, rep=100, return_mode="median")
                print(f"{case.label} {name} {mode}: eager {eager:.3f} ms, graph replay {replay:.3f} ms", flush=True)
    rows = bench_case(Case(dim=256, heads=16, kv_heads=16, seq=16384, density=0.5), device, backward=False,
                      sdpa=False)
    print(markdown(rows), flush=True)


if __name__ == "__main__":
    main()
