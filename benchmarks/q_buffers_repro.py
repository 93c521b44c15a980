"""Reproduce the two-Q-buffer fault of the warp-specialized forward (forward_ws.Q_BUFFER_DIMS, kernels/README.md,
"Two Q buffers") and say which rows go wrong.

One call of the D=64 forward on the case the GPU tests failed on: B1 H2 Sq1000 Sk1024 bf16, 256x256 blocks walked as
listed (256-key TMA boxes), the rise checked, claimed items on a persistent grid of --programs programs, query block 1
keeping nothing. Prints the plan the kernel ran with, the largest errors of out and LSE against the fp64 oracle, and a
map of every 64-row group of each head ('.' right, else its largest error): even groups are a tile's first consumer's
(HALF 0), odd ones the second's. With --explain, for each wrong group the nearest of some guesses (another group's
output, another group's Q with this group's keys, this Q with another group's keys). Knobs that isolate the fault:

  --buffers 1             one Q buffer (passes)
  --split                 the blocks walked as 64-key ones, 64-key boxes (passes)
  --bounded               the offsets kept by the key-norm bound instead of the rise check (passes)
  --walk-again always     every warpgroup walked again with running maxima (_walk_again) after its walk
  --walk-again never      none walked again (the rise check's limit infinite)

GPU only (a Hopper GPU: the kernel declines elsewhere). Example, from the repository root:
  PYTHONPATH=$PWD python benchmarks/q_buffers_repro.py --explain
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import blockattn  # noqa: E402
from blockattn.kernels import forward_ws, tma  # noqa: E402
from conftest import expand, oracle, qkv, random_keep  # noqa: E402

ROWS = forward_ws.CONSUMER_ROWS


def set_up(args) -> list:
    """The module's settings for the run; returns the list the kernel's plans are recorded in."""
    import triton.experimental.gluon.language as gl
    forward_ws.Q_BUFFER_DIMS = (64, ) if args.buffers == 2 else ()
    forward_ws.SPLIT_KEY_BLOCK_DIMS = (64, ) if args.split else ()
    forward_ws.RISE_CHECKED_DIMS = () if args.bounded else (64, )
    forward_ws.CLAIMED_DIMS = (64, )
    forward_ws.MIN_KEYS = {}
    forward_ws.PERSISTENT_PROGRAMS = args.programs
    tma.MIN_DESCRIPTOR_WORK = 0  # (the case is small)
    if args.walk_again != "as-checked":
        # _sums_within's limit: -1 fails every warpgroup (walked again), inf none
        forward_ws._SUM_LIMIT = gl.constexpr(-1.0 if args.walk_again == "always" else float("inf"))
    plans = []
    run = forward_ws.attention_forward_ws

    def recorded(*call):
        plans.append(call[-1])
        return run(*call)
    forward_ws.attention_forward_ws = recorded
    return plans


def explain(out, want, visible, q, k, v, wrong: list) -> None:
    """For each wrong (head, group): the three guesses nearest its rows."""
    qd, kd, vd = q.double(), k.double(), v.double()
    heads, seq_q = q.shape[1], q.shape[2]
    groups = math.ceil(seq_q / ROWS)

    def attend(rows_q, head, keys):
        scores = (rows_q @ kd[0, head].T * q.shape[-1] ** -0.5).masked_fill(~keys, -math.inf)
        return torch.softmax(scores, -1) @ vd[0, head]
    for head, group in wrong:
        rows = slice(group * ROWS, min((group + 1) * ROWS, seq_q))
        count = rows.stop - rows.start
        got = out[0, head, rows].double()
        keys = visible[0, head, rows.start][None, :].expand(count, -1)
        guesses = []
        for other_head in range(heads):
            for other in range(groups):
                other_rows = slice(other * ROWS, other * ROWS + count)
                if other_rows.stop > seq_q:
                    continue
                guesses.append(((want[0, other_head, other_rows] - got).abs().max().item(),
                                f"out(h{other_head}, g{other})"))
                guesses.append(((attend(qd[0, other_head, other_rows], head, keys) - got).abs().max().item(),
                                f"Q(h{other_head}, g{other}) with keys of (h{head}, g{group})"))
                other_keys = visible[0, other_head, other * ROWS][None, :].expand(count, -1)
                if other_keys.any():
                    guesses.append(((attend(qd[0, head, rows], other_head, other_keys) - got).abs().max().item(),
                                    f"Q(h{head}, g{group}) with keys of (h{other_head}, g{other})"))
        guesses.sort()
        print(f"  h{head} g{group}: nearest " + "; ".join(f"{name} {gap:.2e}" for gap, name in guesses[:3]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=1, help="programs of the persistent grid")
    parser.add_argument("--buffers", type=int, choices=(1, 2), default=2)
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--bounded", action="store_true")
    parser.add_argument("--walk-again", choices=("as-checked", "always", "never"), default="as-checked")
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("a Hopper GPU is needed: the warp-specialized forward runs nowhere else")
    plans = set_up(args)
    batch, heads, seq_q, seq_kv, block = 1, 2, 1000, 1024, (256, 256)
    q, k, v = qkv(batch, heads, seq_q, 64, seq_kv=seq_kv, dtype=torch.bfloat16)
    keep = random_keep(batch, heads, seq_q, seq_kv, block, density=0.4)
    keep[:, :, 1] = False
    out, lse = blockattn.attention(q, k, v, keep, block, return_lse=True, backend="triton")
    visible = expand(keep, block, seq_q, seq_kv)
    want, want_lse = oracle(q, k, v, visible)
    err = (out.double() - want).abs().amax(-1)
    seen = torch.isfinite(want_lse)
    print(f"{vars(args)}\nplans {plans}\nlargest error {err.max().item():.3e}, relative "
          f"{((out.double() - want).norm() / want.norm()).item():.3e}, LSE "
          f"{(lse.double() - want_lse)[seen].abs().max().item():.3e} (rows with a key)")
    wrong = []
    for head in range(heads):
        marks = []
        for group in range(math.ceil(seq_q / ROWS)):
            gap = err[0, head, group * ROWS:(group + 1) * ROWS].max().item()
            marks.append(f"{gap:.0e}" if gap > 0.05 else ".")
            if gap > 0.05:
                wrong.append((head, group))
        print(f"h{head} groups: " + " ".join(marks))
    if args.explain and wrong:
        explain(out, want, visible, q, k, v, wrong)


if __name__ == "__main__":
    main()
