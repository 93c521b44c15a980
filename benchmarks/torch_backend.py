"""The PyTorch backend (blockattn.reference, what runs on CPUs and GPUs without Triton) timed on the CPU: forward,
and forward+backward, on random masks of uneven rows (each block kept with probability d), a mask whose rows keep
equally many blocks (the demo's), a skewed mask (a sixteenth of the query blocks keep everything, the rest d/4),
causal, small blocks, GQA with one mask for every head ("shared": the query heads of a group stack into one row),
a forward that returns the LSE, and dense calls (blocks=None, also causal); fp32, 2 threads. With --old FILE, the same calls
through another version of blockattn/reference.py (e.g. `git show REV:blockattn/reference.py > old.py`), the two
taking turns; the fastest of --rounds calls each.

    python benchmarks/torch_backend.py
    git show 0383540:blockattn/reference.py > /tmp/old_reference.py
    python benchmarks/torch_backend.py --old /tmp/old_reference.py
"""

import argparse
import importlib.util
import time

import torch

import blockattn
from blockattn import reference
from blockattn.bench import Case, block_mask

# (batch, heads, kv heads, sequence, head dim, block, density, mask: "random", "even", "skewed", "shared" or
#  "dense" (blocks=None), backward, causal, return_lse)
CASES = [(1, 4, 4, 4096, 64, (128, 128), 0.25, "random", False, False, False),
         (1, 4, 4, 4096, 64, (128, 128), 0.25, "even", False, False, False),
         (1, 4, 4, 4096, 64, (128, 128), 0.25, "skewed", False, False, False),
         (1, 4, 4, 4096, 64, (128, 64), 0.25, "random", False, False, False),
         (1, 4, 4, 2048, 64, (128, 128), 0.25, "random", True, False, False),
         (1, 4, 4, 2048, 64, (128, 64), 0.25, "random", True, False, False),
         (1, 4, 4, 4096, 64, (128, 128), 0.25, "random", False, True, False),
         (1, 4, 4, 4096, 64, (128, 64), 0.25, "random", False, True, False),
         (1, 4, 4, 2048, 64, (128, 128), 0.25, "random", True, True, False),
         (1, 8, 2, 4096, 64, (128, 128), 0.25, "shared", False, True, False),
         (2, 8, 8, 1024, 64, (64, 64), 0.5, "random", False, False, False),
         (1, 8, 2, 4096, 64, (128, 128), 0.25, "shared", False, False, False),
         (1, 8, 2, 2048, 64, (128, 128), 0.25, "shared", True, False, False),
         (1, 4, 4, 4096, 64, (128, 128), 0.25, "random", False, False, True),
         (1, 4, 4, 4096, 64, (128, 128), 1.0, "dense", False, False, False),
         (1, 4, 4, 2048, 64, (128, 128), 1.0, "dense", True, False, False),
         (1, 4, 4, 4096, 64, (128, 128), 1.0, "dense", False, True, False),
         (1, 4, 4, 2048, 64, (128, 128), 1.0, "dense", True, True, False)]


def load_old(path: str):
    """The block_sparse_attention of another version of blockattn/reference.py (its relative import pointed at the
    installed package)."""
    source = open(path).read().replace("from .sparsity import", "from blockattn.sparsity import")
    spec = importlib.util.spec_from_loader("old_reference", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, path, "exec"), module.__dict__)
    return module.block_sparse_attention


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=None, help="another version of blockattn/reference.py to time beside")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    impls = {"now": reference.block_sparse_attention}
    if args.old:
        impls["old"] = load_old(args.old)
    print(f"torch {torch.__version__}, CPU, {args.threads} threads; ms, fastest of {args.rounds}")
    print("| case | " + " | ".join(impls) + (" | old / now |" if args.old else " |"))
    print("| --- " * (len(impls) + 1 + bool(args.old)) + "|")
    gen = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, seq, dim, block, density, pattern, backward, causal, lse in CASES:
        q = torch.randn(batch, heads, seq, dim, generator=gen, requires_grad=backward)
        k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen, requires_grad=backward) for _ in range(2))
        nq, nk = -(-seq // block[0]), -(-seq // block[1])
        if pattern == "dense":
            keep = None
        elif pattern == "even":
            case = Case(batch=batch, heads=heads, kv_heads=heads, seq=seq, dim=dim, block=block, density=density)
            keep = block_mask(case, torch.device("cpu")).expand(batch, heads, nq, nk)
        else:
            mask_heads = (batch, heads) if pattern != "shared" else ()
            keep = torch.rand(*mask_heads, nq, nk, generator=gen) < (density / 4 if pattern == "skewed" else density)
            keep[..., :max(1, nq // 16) if pattern == "skewed" else 0, :] = True
            keep |= torch.eye(nq, nk, dtype=torch.bool)
        blocks = None if keep is None else blockattn.BlockSparsity.from_mask(keep, block, seq, seq)

        def call():
            out = blockattn.attention(q, k, v, blocks, backend="torch", is_causal=causal, return_lse=lse)
            if backward:
                out = out[0] if lse else out
                torch.autograd.grad(out.sum(), (q, k, v))
        times = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                reference.block_sparse_attention = fn
                call()  # warm-up
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) * 1e3)
        reference.block_sparse_attention = impls["now"]
        label = (f"B{batch} H{heads}" + (f" Hkv{kv_heads}" if kv_heads != heads else "")
                 + f" S{seq} {block[0]}x{block[1]} d={density} {pattern}" + (" causal" if causal else "")
                 + (" fwd+bwd" if backward else " fwd") + (" +lse" if lse else ""))
        best = {name: min(t) for name, t in times.items()}
        ratio = f" | {best['old'] / best['now']:.2f}x" if args.old else ""
        print(f"| {label} | " + " | ".join(f"{best[name]:.0f}" for name in impls) + ratio + " |", flush=True)


if __name__ == "__main__":
    main()
