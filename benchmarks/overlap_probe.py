"""Can one warpgroup's exponentials run under another's tensor-core products on this GPU? A probe, not attention.

One program a multiprocessor (132 on the H200), two partitions of one warpgroup each:
  - products: per round, a 64x256x64 wgmma from shared memory (Q K^T's shape at D=64 with 256-key tiles), a wait,
    and a 64x64x256 one with its first operand in registers (P V's, P the scores in bf16), a wait: as the D=64
    forward's consumer issues them, without the softmax;
  - exponentials: per round, 64x256 values (a D=64 tile's scores for one consumer) through `exp2` alone, or through
    the forward's softmax step (row max, scale and offset, `exp2`, row sum).
Each runs the same number of rounds, and a round of either is about 1024 clocks of its unit at full rate (2.1M
multiply-adds at 2048 a clock; 16,384 exponentials at 16 a clock). The kernel runs with the products alone, the
exponentials alone and both; `overlap` is (t_products + t_exponentials - t_both) / min(t_products,
t_exponentials): 1 when the shorter hides wholly under the longer, 0 when they take turns. The D=64 forward needs
them to overlap to pass about 500 TFLOP/s (kernels/README.md, the warp-specialized forward).

Last, both warpgroups run the D=64 forward's consumer loop itself on one tile (no loads, no barriers), whose rate
bounds what the forward's loop can reach, in four variants (LOOP_VARIANTS): as the forward, the row sums from the
tensor cores, and without the row sums or the row maxima (wrong results: what each costs). Measured on the H200
(forty-third session, BENCHMARKS.md): exp2 alone overlaps the products by 0.87, the softmax step by 0.62; the
loop 503-507 TFLOP/s, 458-469 with the tensor cores' row sums, 555-559 without row sums, 585-589 without maxima.

    python benchmarks/overlap_probe.py [--rounds 2000]
"""

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

LOOP_VARIANTS = ("as the forward", "row sums by the tensor cores", "no row sums (wrong)", "no row maxima (wrong)")
ROWS = gl.constexpr(64)
KEYS = gl.constexpr(256)
DIM = gl.constexpr(64)


@gluon.jit
def _consumer_loop(q_smem, k_smem, ones_smem, ROUNDS, VARIANT: gl.constexpr):
    """The D=64 forward's consumer loop (256-key tiles, no overlap inside the warpgroup) on the same Q and K tile
    every round, without loads or barriers: Q K^T, its wait, the softmax step, P V, its wait. A checksum.
    VARIANT (LOOP_VARIANTS): 0 as the forward; 1 the row sums of P by the tensor cores (P times a [256, 8] tile of
    ones, beside P V) instead of by adds; 2 no row sums (wrong: what the adds cost); 3 no row maxima (a fixed
    offset, wrong: what the maxima cost)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DIM, 16])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 8, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
    s_zero = gl.zeros([ROWS, KEYS], gl.float32, s_layout)
    acc = gl.zeros([ROWS, DIM], gl.float32, o_layout)
    l_acc = gl.zeros([ROWS, 8], gl.float32, l_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    if VARIANT == 3:
        m_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    for _ in range(ROUNDS):
        qk = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        if VARIANT == 3:
            m_new = m_i
        else:
            m_new = gl.maximum(m_i, gl.max(qk, 1) * 0.18)
        p = gl.exp2(qk * 0.18 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        if VARIANT == 0 or VARIANT == 3:
            l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        if VARIANT == 1:
            l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
            acc = warpgroup_mma(p_op, k_smem, acc, is_async=True)
            l_acc = warpgroup_mma(gl.convert_layout(p_op, pl_layout), ones_smem.permute((1, 0)), l_acc,
                                  is_async=True)
            acc, l_acc, p_op = warpgroup_mma_wait(0, deps=(acc, l_acc, p_op))
        else:
            acc = warpgroup_mma(p_op, k_smem, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        m_i = m_new
    return gl.sum(gl.sum(acc, 1), 0) + gl.sum(l_i, 0) + gl.sum(gl.sum(l_acc, 1), 0) / 8


@gluon.jit
def _products(shared, ROUNDS, PRODUCTS: gl.constexpr, EXPONENTIALS: gl.constexpr):
    q_smem, k_smem, ones_smem, Out = shared
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    total = 0.0
    if EXPONENTIALS >= 3:
        total = _consumer_loop(q_smem, k_smem, ones_smem, ROUNDS, EXPONENTIALS - 3)
    elif PRODUCTS:
        s_zero = gl.zeros([ROWS, KEYS], gl.float32, s_layout)
        o = gl.zeros([ROWS, DIM], gl.float32, o_layout)
        for _ in range(ROUNDS):
            s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            p = gl.convert_layout((s * 0.01).to(gl.bfloat16), p_layout)
            o = warpgroup_mma(p, k_smem, o, is_async=True)
            o, p = warpgroup_mma_wait(0, deps=(o, p))
        total = gl.sum(gl.sum(o, 1), 0)
    gl.store(Out + gl.program_id(0) * 2, total)


@gluon.jit
def _exponentials(shared, ROUNDS, PRODUCTS: gl.constexpr, EXPONENTIALS: gl.constexpr):
    q_smem, k_smem, ones_smem, Out = shared
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    total = 0.0
    if EXPONENTIALS >= 3:
        total = _consumer_loop(q_smem, k_smem, ones_smem, ROUNDS, EXPONENTIALS - 3)
    elif EXPONENTIALS != 0:
        rows = gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, KEYS, gl.SliceLayout(0, s_layout))
        x = ((rows[:, None] * 31 + cols[None, :] * 17) % 97).to(gl.float32) * 0.01
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        for _ in range(ROUNDS):
            if EXPONENTIALS == 1:
                x = gl.exp2(x * -0.5 - 1.0)
            else:  # the forward's softmax step (_online_softmax) on scores x
                m = gl.max(x, 1) * 1.4426950408889634
                x = gl.exp2(x * 1.4426950408889634 - m[:, None])
                l_i = l_i + gl.sum(x, 1)
        total = gl.sum(gl.sum(x, 1), 0) + gl.sum(l_i, 0)
    gl.store(Out + gl.program_id(0) * 2 + 1, total)


@gluon.jit
def _idle(shared, ROUNDS, PRODUCTS: gl.constexpr, EXPONENTIALS: gl.constexpr):
    """The forward's loader warp's place (its register budget makes the split the forward's: 240, 240, 24)."""
    pass


@gluon.jit
def probe_kernel(Data, Out, ROUNDS, PRODUCTS: gl.constexpr, EXPONENTIALS: gl.constexpr):
    """Data bf16 [256, 64] (random: the products' operands, so that the tensor cores switch bits as with real
    data); Out fp32 [programs, 2] (what each partition computed, so that nothing is left out)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, DIM], gl.bfloat16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, DIM], gl.bfloat16)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, KEYS, gl.SliceLayout(1, load_layout))
    c = gl.arange(0, DIM, gl.SliceLayout(0, load_layout))
    data = gl.load(Data + r[:, None] * DIM + c[None, :])
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [KEYS, DIM], layout, data)
    rq = gl.arange(0, ROWS, gl.SliceLayout(1, load_layout))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, DIM], q_layout,
                                       gl.load(Data + rq[:, None] * DIM + c[None, :]))
    # K-major ([8, 256], read transposed, as K is): a [256, 8] tile's 16-byte rows made an illegal address
    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, KEYS], gl.bfloat16)
    ones_smem = gl.allocate_shared_memory(gl.bfloat16, [8, KEYS], ones_layout,
                                          gl.full([8, KEYS], 1.0, gl.bfloat16, load_layout))
    fence_async_shared()
    shared = (q_smem, k_smem, ones_smem, Out)
    gl.warp_specialize([(_products, (shared, ROUNDS, PRODUCTS, EXPONENTIALS)),
                        (_exponentials, (shared, ROUNDS, PRODUCTS, EXPONENTIALS)),
                        (_idle, (shared, ROUNDS, PRODUCTS, EXPONENTIALS))], [4, 1], [240, 24])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device("cuda")
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    data = torch.randn(256, 64, device=device, dtype=torch.bfloat16)
    out = torch.empty(programs, 2, device=device)

    def run(products, exponentials):
        probe_kernel[(programs, )](data, out, args.rounds, PRODUCTS=products, EXPONENTIALS=exponentials,
                                   num_warps=4, maxnreg=168)

    run(True, 2)  # warm-up: the GPU idles at a low clock
    triton.testing.do_bench(lambda: run(True, 2), warmup=200, rep=500)
    for exponentials, what in ((1, "exp2 alone"), (2, "softmax step")):
        times = {}
        for name, p, e in (("products", True, 0), ("exponentials", False, exponentials), ("both", True, exponentials)):
            times[name] = triton.testing.do_bench(lambda: run(p, e), warmup=50, rep=300)
        short = min(times["products"], times["exponentials"])
        overlap = (times["products"] + times["exponentials"] - times["both"]) / short
        clocks = 1024 * args.rounds / 1e3  # each partition's rounds at its unit's full rate, thousands of clocks
        print(f"{what}: products {times['products']:.3f} ms, exponentials {times['exponentials']:.3f} ms, both "
              f"{times['both']:.3f} ms; overlap {overlap:.2f} (each alone ~{clocks:.0f}k clocks at full rate)",
              flush=True)
    flops = programs * args.rounds * 2 * 4 * ROWS.value * KEYS.value * DIM.value
    checksums = []
    for variant, what in enumerate(LOOP_VARIANTS):
        run(True, 3 + variant)
        checksums.append(out.clone())
        ms = triton.testing.do_bench(lambda: run(True, 3 + variant), warmup=50, rep=300)
        print(f"the consumer loop in both warpgroups (no loads), {what}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s",
              flush=True)
    gap = ((checksums[1] - checksums[0]).abs() / checksums[0].abs()).max().item()
    print(f"checksums (P V's sum and the row sums) of the tensor cores' row sums against the adds: relative gap "
          f"{gap:.1e}")


if __name__ == "__main__":
    main()
