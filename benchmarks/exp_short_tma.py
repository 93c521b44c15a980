import time, torch, triton.testing, blockattn
from blockattn.bench import Case, block_mask
from blockattn.kernels import tma
dev = torch.device("cuda")
for seq in (1024, 2048, 4096):
    case = Case(batch=8, heads=16, kv_heads=16, seq=seq, density=0.5, block=(128, 128))
    blocks = blockattn.BlockSparsity.from_mask(block_mask(case, dev), case.block, seq, seq)
    q, k, v = (torch.randn(8, 16, seq, 128, device=dev, dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    g = torch.randn_like(q)
    def fwd():
        with torch.no_grad(): return blockattn.attention(q, k, v, blocks)
    def fb(): return torch.autograd.grad(blockattn.attention(q, k, v, blocks), (q, k, v), g)
    for rep in range(2):
        for on in (True, False):
            tma.TMA_LOADS = on
            res = []
            for fn in (fwd, fb):
                fn(); torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(100): fn()
                host = (time.perf_counter() - t) * 10
                torch.cuda.synchronize()
                res.append(f"host {host:.3f} do_bench {triton.testing.do_bench(fn, warmup=25, rep=100, return_mode='median'):.3f}")
            print(f"S{seq} tma={on} fwd: {res[0]} | fwd+bwd: {res[1]}", flush=True)
