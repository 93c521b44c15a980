"""Benchmarks: blockattn against FlexAttention (compiled, same block mask) and dense SDPA (cuDNN, flash), forward
and forward+backward, in one run. Used by `blockattn bench` and benchmarks/bench_attention.py. Without a GPU the
same on the CPU: blockattn's PyTorch backend, FlexAttention compiled for the CPU, and PyTorch's own SDPA.

Effective TFLOP/s count only the kept work: 4 * B * Hq * Sq * Sk * D * density for the forward, 2.5 times that for
the backward (so fwd+bwd is 3.5 times). SDPA rows are dense: density 1.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from .api import attention
from .sparsity import BlockSparsity, _difference_range, build_lists

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    batch: int = 1
    heads: int = 24
    kv_heads: int = 24
    seq: int = 32768
    dim: int = 128
    block: tuple = (128, 128)
    density: float = 0.25
    dtype: str = "bf16"
    # "random": every query block keeps the same count; "skewed": a few keep everything; "causal": the blocks on or
    # below the diagonal, run with is_causal (density is then the causal one, whatever the field says)
    pattern: str = "random"

    @property
    def label(self) -> str:
        gqa = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"B{self.batch} H{self.heads}{gqa} S{self.seq} D{self.dim} {self.dtype} block {self.block[0]}x"
                f"{self.block[1]} {self.pattern} d={self.density:g}")


@dataclass
class Row:
    case: str
    impl: str
    mode: str          # "fwd", "fwd+bwd" or "bwd" (the difference)
    density: float     # actual kept fraction
    ms: float
    tflops: float
    note: str = ""


def block_mask(case: Case, device, seed: int = 0) -> torch.Tensor:
    """bool [1, H, nq, nk] at the case's density: each query block keeps round(density * nk) blocks (its diagonal
    block among them); "skewed" gives a tenth of the query blocks every block and spreads the rest evenly."""
    nq, nk = math.ceil(case.seq / case.block[0]), math.ceil(case.seq / case.block[1])
    if case.pattern == "causal":
        return causal_blocks(case, device).expand(1, case.heads, nq, nk)
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(1, case.heads, nq, nk, generator=gen, device=device)
    diagonal = (torch.arange(nq, device=device)[:, None] * case.block[0]) // case.block[1]
    scores.scatter_(-1, diagonal.clamp(max=nk - 1).expand(1, case.heads, nq, 1), 2.0)
    if case.pattern == "skewed":
        heavy = max(1, nq // 10)
        light_keep = max(1, round((case.density * nq * nk - heavy * nk) / max(nq - heavy, 1)))
        keep_per_row = torch.full((nq,), light_keep, device=device)
        keep_per_row[torch.randperm(nq, generator=gen, device=device)[:heavy]] = nk
    else:
        keep_per_row = torch.full((nq,), max(1, round(case.density * nk)), device=device)
    rank = scores.argsort(-1, descending=True).argsort(-1)
    return rank < keep_per_row[None, None, :, None]


def causal_blocks(case: Case, device, full: bool = False) -> torch.Tensor:
    """bool [nq, nk]: the blocks holding a key at or before one of their queries (masks.causal's blocks);
    full=True: only those whose every key lies at or before every query (no element test needed)."""
    smallest, largest = _difference_range(case.seq, case.seq, case.block, device)  # of query - key per block
    return smallest >= 0 if full else largest >= 0


def _time_ms(fn: Callable, calls: int = 25, device: Optional[torch.device] = None) -> float:
    """Median ms of fn over at least `calls` timed calls (triton.testing.do_bench: CUDA events, the L2 cache flushed
    before each call) after a warm-up of at least 3 calls. do_bench's budgets are milliseconds, so they grow with
    the call's own time: a fixed 200 ms would time a 60 ms backward 3 times, too few for a stable median. On the CPU
    (device "cpu", or no GPU): the median of 5 to `calls` calls by the wall clock, about 2 s of them, after one."""
    on_cpu = device.type == "cpu" if device is not None else not torch.cuda.is_available()
    if on_cpu:
        fn()
        start = time.perf_counter()
        fn()
        once_ms = (time.perf_counter() - start) * 1e3
        times = []
        for _ in range(max(5, min(calls, int(2000 / max(once_ms, 1e-3))))):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    import triton.testing
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=max(50.0, 3 * once_ms), rep=max(200.0, calls * once_ms),
                                   return_mode="median")


def _set_head_dim(module, attribute: str, dim: int, on: bool) -> None:
    """Put head dim `dim` into or out of a kernel module's head-dim setting (a tuple such as
    forward_ws.SPLIT_KEY_BLOCK_DIMS), the other dims kept: the benchmarks' A/B timings of one setting."""
    dims = set(getattr(module, attribute)) - {dim}
    setattr(module, attribute, tuple(sorted(dims | ({dim} if on else set()))))


def _flops(case: Case, density: float) -> float:
    return 4.0 * case.batch * case.heads * case.seq * case.seq * case.dim * density


def _inputs(case: Case, device, requires_grad: bool):
    dtype = _DTYPES[case.dtype]
    gen = torch.Generator(device=device).manual_seed(1)
    shapes = [(case.batch, case.heads, case.seq, case.dim)] + [(case.batch, case.kv_heads, case.seq, case.dim)] * 2
    return [torch.randn(s, generator=gen, device=device, dtype=dtype).requires_grad_(requires_grad) for s in shapes]


def backward_inputs(case: Case, device):
    """(blocks, q, k, v, grad_out, out) to time a case's backward alone: its block mask's BlockSparsity, inputs
    that require grad, a random gradient of out and blockattn's forward output, so that
    torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True) runs the backward again and again."""
    keep = block_mask(case, device)
    blocks = BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
    q, k, v = _inputs(case, device, requires_grad=True)
    grad_out = torch.randn_like(q)
    return blocks, q, k, v, grad_out, attention(q, k, v, blocks, is_causal=case.pattern == "causal")


def flex_block_mask(blocks: BlockSparsity):
    """The FlexAttention BlockMask the benchmarks give compiled FlexAttention for blocks: every kept block full and
    no mask_mod, so FlexAttention runs its fastest path (kv_num_blocks int32 [B, H, nq] and kv_indices
    [B, H, nq, nk] from blocks.kv_count and kv_index). blockattn.flex.to_block_mask also carries a mask_mod that
    looks the block up, for FlexAttention's eager path."""
    from torch.nn.attention.flex_attention import BlockMask
    return BlockMask.from_kv_blocks(torch.zeros_like(blocks.kv_count), blocks.kv_index, blocks.kv_count,
                                    blocks.kv_index, BLOCK_SIZE=blocks.block_size,
                                    seq_lengths=(blocks.seq_q, blocks.seq_kv))


def _runners(case: Case, keep: torch.Tensor, device, quant: Optional[str] = None):
    """name -> (forward fn(q, k, v), density) for every implementation available; with quant also
    "blockattn-<quant>", blockattn's quantized forward (inference only)."""
    runners = {}
    blocks = BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
    density = blocks.density()
    causal = case.pattern == "causal"
    runners["blockattn"] = (lambda q, k, v: attention(q, k, v, blocks, is_causal=causal), density)
    if quant is not None:
        runners[f"blockattn-{quant}"] = (lambda q, k, v: attention(q, k, v, blocks, is_causal=causal, quant=quant),
                                         density)
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        if causal:  # FlexAttention's own split: full blocks skip the mask_mod, the diagonal ones apply it
            full = causal_blocks(case, device, full=True).expand_as(keep) & keep
            partial_count, partial_index = build_lists(keep & ~full)
            full_count, full_index = build_lists(full)
            flex_mask = BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index,
                                                 BLOCK_SIZE=case.block, seq_lengths=(case.seq, case.seq),
                                                 mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
        else:
            flex_mask = flex_block_mask(blocks)
        compiled = torch.compile(flex_attention, dynamic=False)
        gqa = case.kv_heads != case.heads
        # Flex's default tiles are 128 wide: a narrower mask block needs tiles that nest in it.
        options = None if min(case.block) >= 128 else {
            "BLOCK_M": min(case.block[0], 128), "BLOCK_N": min(case.block[1], 128),
            "BLOCK_M1": min(case.block[0], 64), "BLOCK_N1": min(case.block[1], 128),
            "BLOCK_M2": min(case.block[0], 128), "BLOCK_N2": min(case.block[1], 64)}
        runners["flex"] = (lambda q, k, v: compiled(q, k, v, block_mask=flex_mask, enable_gqa=gqa,
                                                     kernel_options=options), density)
    except Exception as error:  # FlexAttention missing in this torch: report, keep going
        runners["flex"] = (error, density)
    gqa = case.kv_heads != case.heads
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            def run(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                            enable_gqa=gqa)
            runners[name] = (run, density if causal else 1.0)
    else:  # whichever kernel PyTorch picks there (its fused CPU one)
        runners["sdpa"] = (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=gqa), density if causal else 1.0)
    return runners


def bench_case(case: Case, device, *, backward: bool = True, sdpa: bool = True,
               impls: Optional[tuple] = None, quant: Optional[str] = None) -> list[Row]:
    """Rows of forward, forward+backward and backward times for every implementation (only those named in impls,
    if given; SDPA only when sdpa; with quant also blockattn's quantized forward, which has no backward)."""
    keep = block_mask(case, device)
    rows = []
    q, k, v = _inputs(case, device, requires_grad=backward)
    grad = torch.randn_like(q)
    for name, (fn, density) in _runners(case, keep, device, quant).items():
        if (name.startswith("sdpa") and not sdpa) or (impls is not None and name not in impls):
            continue
        if isinstance(fn, Exception):
            rows.append(Row(case.label, name, "fwd", density, float("nan"), float("nan"),
                            f"unavailable: {_one_line(fn)}"))
            continue
        flops = _flops(case, density)
        # (FlexAttention on the CPU refuses inputs that require grad even under no_grad: its forward takes detached
        # ones there)
        inputs = (q, k, v) if device.type == "cuda" else (q.detach(), k.detach(), v.detach())
        passes = [("fwd", 1.0, lambda: fn(*inputs))]
        if backward and not name.startswith("blockattn-"):
            passes.append(("fwd+bwd", 3.5, lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)))
        times = {}
        for mode, work, run_pass in passes:
            try:
                with torch.set_grad_enabled(mode != "fwd"):
                    times[mode] = _time_ms(run_pass, device=device)
                rows.append(Row(case.label, name, mode, density, times[mode], work * flops / times[mode] / 1e9))
            except Exception as error:  # a failing implementation is a result too
                rows.append(Row(case.label, name, mode, density, float("nan"), float("nan"),
                                f"failed: {type(error).__name__}: {_one_line(error)[:120]}"))
        if "fwd" in times and "fwd+bwd" in times:
            bwd = times["fwd+bwd"] - times["fwd"]
            rows.append(Row(case.label, name, "bwd", density, bwd, 2.5 * flops / bwd / 1e9))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _one_line(error: Exception) -> str:
    """An error's message on one line (a table cell): Inductor's compile errors span many."""
    return " ".join(str(error).split())


def ratios(rows: list[Row], impl_name: str = "blockattn") -> dict:
    """(case, mode) -> FlexAttention's time / impl_name's time (>1: impl_name is faster); none where either
    failed (a NaN time)."""
    table = {(r.case, r.impl, r.mode): r.ms for r in rows if math.isfinite(r.ms)}
    out = {}
    for (case, impl, mode), ms in table.items():
        if impl == impl_name and (case, "flex", mode) in table:
            out[(case, mode)] = table[(case, "flex", mode)] / ms
    return out


def markdown(rows: list[Row]) -> str:
    impls = {r.impl for r in rows if r.impl.startswith("blockattn")}
    ratio = {impl: ratios(rows, impl) for impl in impls}
    lines = ["| case | impl | pass | kept density | ms | effective TFLOP/s | vs flex | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        vs = ratio[r.impl].get((r.case, r.mode)) if r.impl in ratio else None
        # (three significant figures below 10 TFLOP/s: a CPU's rates)
        rate = f"{r.tflops:.0f}" if not r.tflops < 10 else f"{r.tflops:.3g}"
        lines.append(f"| {r.case} | {r.impl} | {r.mode} | {r.density:.3f} | {r.ms:.3f} | {rate} | "
                     f"{'' if vs is None else f'{vs:.2f}x'} | {r.note} |")
    return "\n".join(lines)


def plot(rows: list[Row], path) -> None:
    """TFLOP/s against density per implementation and pass, one panel per (case without density, pass)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in rows:
        if r.mode == "fwd+bwd" or not math.isfinite(r.tflops):
            continue
        base = r.case.rsplit(" d=", 1)[0]
        groups.setdefault((base, r.mode), {}).setdefault(r.impl, []).append((r.density, r.tflops))
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(7, 3.2 * len(groups)), squeeze=False)
    for ax, ((base, mode), impls) in zip(axes[:, 0], sorted(groups.items())):
        for impl, points in sorted(impls.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
        ax.set_xscale("log")
        ax.set_title(f"{base} - {mode}", fontsize=9)
        ax.set_xlabel("kept density")
        ax.set_ylabel("effective TFLOP/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict:
    import platform

    import triton
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    else:
        info["cpu"] = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return info


def run(cases: list[Case], *, backward: bool = True, out_prefix: Optional[str] = None, progress: bool = True,
        sdpa_once: bool = True, quant: Optional[str] = None) -> list[Row]:
    """Benchmark every case (SDPA once per shape when sdpa_once: it does not depend on the mask), print a table,
    and write <out_prefix>.md, .json and .png."""
    from tqdm import tqdm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Every case compiles FlexAttention anew; past dynamo's recompile limit it would silently run unfused.
    import torch._dynamo as dynamo
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), 256))
    rows, seen_shapes = [], set()
    for case in tqdm(cases, disable=not progress, desc="bench"):
        shape = (case.batch, case.heads, case.kv_heads, case.seq, case.dim, case.dtype, case.pattern == "causal")
        rows += bench_case(case, device, backward=backward, sdpa=not (sdpa_once and shape in seen_shapes),
                           quant=quant)
        seen_shapes.add(shape)
    table = markdown(rows)
    print(table)
    if out_prefix:
        with open(f"{out_prefix}.md", "w") as f:
            f.write(f"{json.dumps(environment())}\n\n{table}\n")
        with open(f"{out_prefix}.json", "w") as f:
            json.dump({"environment": environment(), "rows": [asdict(r) for r in rows]}, f, indent=1)
        plot(rows, f"{out_prefix}.png")
    return rows
