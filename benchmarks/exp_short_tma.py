"""Short sequences with and without descriptor (TMA) loads: host time per call (enqueue 100 calls, no waiting)
and do_bench time, forward and forward+backward, B8 H16 S1024..4096, twice each to show the spread.

    python benchmarks/exp_short_tma.py
"""

import time

import torch
import triton.testing

import blockattn
from blockattn.bench import Case, block_mask
from blockattn.kernels import tma


def host_and_device_ms(fn) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        fn()
    host = (time.perf_counter() - start) * 10  # ms per call
    torch.cuda.synchronize()
    return host, triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    device = torch.device("cuda")
    for seq in (1024, 2048, 4096):
        case = Case(batch=8, heads=16, kv_heads=16, seq=seq, density=0.5, block=(128, 128))
        blocks = blockattn.BlockSparsity.from_mask(block_mask(case, device), case.block, seq, seq)
        q, k, v = (torch.randn(8, 16, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                return blockattn.attention(q, k, v, blocks)

        def fwd_bwd():
            return torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), grad)

        for _ in range(2):
            for tma_loads in (True, False):
                tma.TMA_LOADS = tma_loads
                cells = [f"host {h:.3f} do_bench {d:.3f}" for h, d in map(host_and_device_ms, (fwd, fwd_bwd))]
                print(f"S{seq} tma={tma_loads} fwd: {cells[0]} | fwd+bwd: {cells[1]}", flush=True)
        tma.TMA_LOADS = True


if __name__ == "__main__":
    main()
