"""How the L2 counts the backward's dQ adds: a kernel that adds (or stores) a known number of [64, 64] fp32 boxes
through the TMA unit, exactly as backward_ws._add_dq does, for Nsight Compute to count the L2's sectors against.

The paired backward's reductions read 1.4-1.5x the bytes it adds (thirty-fifth session); this tells whether the L2
counts any box that way (then it is the L2's own doing, e.g. a request that crosses to the other L2 partition counted
in both) or only the backward's (then the kernel adds more than it should).

    ncu --clock-control none --kernel-name regex:_add_boxes --metrics lts__t_sectors_op_red.sum,\\
        lts__t_sectors_op_write.sum python benchmarks/tma_reduce_count.py --mode reduce --rows 262144

--rows: the target's rows (x 128 fp32 columns): 262144 (128 MiB) is cold, larger than the L2; 4096 (2 MiB) stays in
it. Prints the sectors the boxes hold, and checks the sum of what was added. --time: the time of a call (no
profiler) for each count of programs given, the same boxes in all: how the adds' rate grows with the boxes in flight
(one a program, up to 8 programs a multiprocessor).

    python benchmarks/tma_reduce_count.py --rows 4096 --time 132 264 528 1056
"""

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from blockattn.kernels.backward_ws import _tma_add
from blockattn.kernels.forward_ws import host_descriptor, tma_store

ROWS, COLS = 64, 64  # a dQ box of the backward (STEP_ROWS x CONSUMER_KEYS)


@gluon.jit
def _add_boxes(DESC, row_blocks, repeats, REDUCE: gl.constexpr):
    """Program p adds (REDUCE) or stores a [64, 64] tile of ones at `repeats` boxes of DESC's [1, 1, rows, 128]
    tensor, one at a time (as _add_dq waits for the last before reusing its tile), walking the boxes in order."""
    R: gl.constexpr = DESC.block_type.shape[2]
    C: gl.constexpr = DESC.block_type.shape[3]
    smem = gl.allocate_shared_memory(gl.float32, [R, C], gl.NVMMASharedLayout.get_default_for([R, C], gl.float32))
    fill: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    smem.store(gl.full([R, C], 1.0, gl.float32, fill))
    fence_async_shared()
    box = smem.reshape([1, 1, R, C])
    for r in range(repeats):
        t = gl.program_id(0) * repeats + r
        row = (t % row_blocks) * R
        col = ((t // row_blocks) % 2) * C
        tma.store_wait(0)
        if REDUCE:
            _tma_add(DESC, [0, 0, row, col], box)
        else:
            tma_store(DESC, [0, 0, row, col], box)
    tma.store_wait(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("reduce", "store"), default="reduce")
    parser.add_argument("--rows", type=int, default=262144, help="the target's rows (of 128 fp32)")
    parser.add_argument("--programs", type=int, default=1056)
    parser.add_argument("--repeats", type=int, default=256)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--time", type=int, nargs="*", metavar="PROGRAMS",
                        help="time a call for each count of programs (repeats scaled to the same boxes)")
    args = parser.parse_args()
    if args.time:
        time_rates(args)
        return
    target = torch.zeros(1, 1, args.rows, 2 * COLS, device="cuda", dtype=torch.float32)
    desc = host_descriptor(target, ROWS, COLS)
    for _ in range(args.calls):
        target.zero_()
        _add_boxes[(args.programs,)](desc, args.rows // ROWS, args.repeats, args.mode == "reduce", num_warps=4)
    torch.cuda.synchronize()
    boxes = args.programs * args.repeats
    elements = boxes * ROWS * COLS
    total = target.double().sum().item()
    expected = elements if args.mode == "reduce" else min(elements, target.numel())
    print(f"{args.mode}: {boxes} boxes of [{ROWS}, {COLS}] fp32 into {args.rows} rows x {2 * COLS}: "
          f"{elements * 4 / 32:,.0f} sectors ({elements * 4 / 1e9:.3f} GB) a call; sum {total:.0f}, "
          f"{'as expected' if total == expected else f'EXPECTED {expected}'}")


def time_rates(args):
    """The time and the rate of --programs x --repeats boxes' adds (or stores), split over each count of programs."""
    from triton.testing import do_bench
    target = torch.zeros(1, 1, args.rows, 2 * COLS, device="cuda", dtype=torch.float32)
    desc = host_descriptor(target, ROWS, COLS)
    boxes = args.programs * args.repeats
    for programs in args.time:
        repeats = boxes // programs
        ms = do_bench(lambda: _add_boxes[(programs,)](desc, args.rows // ROWS, repeats, args.mode == "reduce",
                                                      num_warps=4))
        nbytes = programs * repeats * ROWS * COLS * 4
        print(f"{args.mode} {programs} programs x {repeats} boxes into {args.rows} rows: {ms:.3f} ms, "
              f"{nbytes / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
