"""The warp-specialized forward with one of its settings each way, timed in turns (A, B, A, B, ...) so that drift
on the machine falls on both ways alike. One-off runs of `ws_forward.py --rise-checked` at D=64 disagreed by up to
12% in either direction between runs; this says which way is faster with the rounds beside each other.

Settings (module attributes of blockattn.kernels.forward_ws, set for the case's head dim):
  rise-checked    bf16's fixed offsets with the rise checked after the walk, or bounded by the key norms
                  (RISE_CHECKED_DTYPES, RISE_CHECKED_DIMS and RISE_CHECKED_CAUSAL_DIMS)
  emulated-exp2   one exponential in four from the FMA units' polynomial, or all from the special function unit
                  (EMULATED_EXP2_DIMS)
  persistent      a persistent grid, a program an SM taking query tiles in turn, or a program a query tile
                  (PERSISTENT_DIMS; the claims, which take precedence, off both ways unless named too)
  claimed         a persistent grid whose programs claim query tiles from a counter as they free up (under
                  is_causal too), or a program a query tile; with --also persistent, against the tiles in turn
                  (CLAIMED_DIMS and CLAIMED_CAUSAL_DIMS)
  split-key-blocks  each key block walked as 64-key blocks, from lists split once per mask, or as listed
                  (SPLIT_KEY_BLOCK_DIMS; at 128x64 and under is_causal the same kernel both ways)
  q-buffers       two Q buffers taken in turn by a persistent program's items, or one (Q_BUFFER_DIMS; D=64 only,
                  and where the grid is persistent: the claimed items, on where not causal)
  mma-sums        the fixed walk's row sums from the tensor cores (P times a tile of ones), or added up
                  (MMA_ROW_SUM_DIMS and MMA_ROW_SUM_CAUSAL_DIMS; D=64's walk in turn)
  early-release   on the persistent grid, each consumer gives Q back after its walk's last Q K^T, or after its
                  rows' store (EARLY_Q_RELEASE_DIMS; the claimed items, on where not causal)
  null            the same kernel both ways: how far apart the medians of two ways fall when nothing differs
                  (D=64, five rounds, H100, fifty-ninth session: 0.984-1.019x)

    cd benchmarks && python ws_forward_ab.py --setting rise-checked --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting emulated-exp2 --also rise-checked   # with the other on
    cd benchmarks && python ws_forward_ab.py --setting rise-checked --cases causal
    cd benchmarks && python ws_forward_ab.py --setting persistent --cases grid skewed
    cd benchmarks && python ws_forward_ab.py --setting claimed --cases grid skewed
    cd benchmarks && python ws_forward_ab.py --setting split-key-blocks --cases design --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting rise-checked --cases d64 --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting null --cases d64 --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting q-buffers --cases d64 --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting q-buffers --cases items --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting mma-sums --cases d64 --rounds 5
    cd benchmarks && python ws_forward_ab.py --setting early-release --cases items --rounds 3

The fifty-first session timed the walk in turn's wait for V, its last tile peeled off the loop and the causal walk's
split this way (BENCHMARKS.md) and kept the two that won, which have no switch since; and the persistent grid, which
lost on skewed and causal masks in turns. The fifty-third session timed its claimed items, on since where not causal.
The fifty-eighth timed two settings since removed (the consumers' score products in turns, and narrow last tiles:
kernels/README.md), the fifty-ninth a third (the compact walk, COMPACT_WALK_DIMS, in benchmarks/patches/).
"""

import argparse
import statistics

import torch

import blockattn
from blockattn.bench import Case, _flops, _inputs, _set_head_dim, _time_ms, block_mask
from blockattn.kernels import forward_ws

# D=64 (its walk in turn) at the design densities, and causal, at both block shapes
D64_RANDOM = [Case(dim=64, block=block, density=d) for block in ((128, 128), (128, 64)) for d in (0.5, 0.25, 0.1)]
D64_CAUSAL = [Case(dim=64, pattern="causal", block=block, density=0.5) for block in ((128, 128), (128, 64))]
SUITES = {"design": D64_RANDOM + [D64_CAUSAL[0], Case(block=(128, 128), density=0.1)],
          "d64": D64_RANDOM + D64_CAUSAL,
          "causal": [Case(pattern="causal", block=block, density=0.5) for block in ((128, 128), (128, 64))]
          + D64_CAUSAL + [Case(batch=8, heads=16, kv_heads=16, seq=4096, pattern="causal", density=0.5)],
          # target 6 (a few query blocks keep everything, most little) against the uniform mask of the same density
          "skewed": [Case(dim=dim, density=0.25, pattern=pattern) for dim in (128, 64)
                     for pattern in ("skewed", "random")],
          # the grid's shape: densities 1 and 0.1 (target 3), short lists, causal, many short calls' programs
          "grid": [Case(block=(128, 128), density=d) for d in (1.0, 0.1)] + [Case(block=(128, 64), density=0.1)]
          + [Case(dim=64, block=(128, 128), density=d) for d in (0.5, 0.1)]
          + [Case(dim=64, block=(128, 64), density=0.1)]
          + [Case(pattern="causal", block=(128, 64), density=0.5), Case(dim=64, pattern="causal", density=0.5)]
          + [Case(batch=8, heads=16, kv_heads=16, seq=s, density=0.5) for s in (2048, 4096)],
          # where an item's start and end weigh: D=64 at the design densities, D=128 dense and at d=0.1 (target 3),
          # short calls, and the skewed mask's long and short items
          "items": D64_RANDOM + [Case(block=(128, 128), density=d) for d in (1.0, 0.1)]
          + [Case(block=(128, 64), density=0.1), Case(batch=8, heads=16, kv_heads=16, seq=4096, density=0.5),
             Case(dim=64, density=0.25, pattern="skewed")]}
# each setting's module attributes (head dims), and its two ways' names
SETTINGS = {"rise-checked": (("RISE_CHECKED_DIMS", "RISE_CHECKED_CAUSAL_DIMS"), "checked", "bounded"),
            "emulated-exp2": (("EMULATED_EXP2_DIMS", ), "emulated", "special function unit"),
            "persistent": (("PERSISTENT_DIMS", ), "persistent", "a program a tile"),
            "claimed": (("CLAIMED_DIMS", "CLAIMED_CAUSAL_DIMS"), "claimed", "a program a tile or turns"),
            "split-key-blocks": (("SPLIT_KEY_BLOCK_DIMS", ), "64-key blocks", "the mask's blocks"),
            "key-split": (("KEY_SPLIT_DIMS", "KEY_SPLIT_CAUSAL_DIMS"), "four consumers", "two consumers"),
            "q-buffers": (("Q_BUFFER_DIMS", ), "two Q buffers", "one Q buffer"),
            "mma-sums": (("MMA_ROW_SUM_DIMS", "MMA_ROW_SUM_CAUSAL_DIMS"), "row sums on the tensor cores",
                         "row sums added"),
            "early-release": (("EARLY_Q_RELEASE_DIMS", ), "Q given back after the last Q K^T",
                              "Q given back after the rows"),
            "null": ((), "first", "second")}
ATTRIBUTES = [attribute for attributes, _, _ in SETTINGS.values() for attribute in attributes]


def set_setting(name: str, dim: int, on: bool) -> None:
    """forward_ws's setting `name` on or off at head dim dim (rise-checked: for bf16)."""
    for attribute in SETTINGS[name][0]:
        _set_head_dim(forward_ws, attribute, dim, on)
    if name == "rise-checked":
        forward_ws.RISE_CHECKED_DTYPES = (torch.bfloat16, )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="rise-checked")
    parser.add_argument("--also", choices=sorted(SETTINGS), action="append", default=[],
                        help="another setting, on for both ways")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", choices=sorted(SUITES), nargs="+", default=["design"])
    args = parser.parse_args()
    saved = {attribute: getattr(forward_ws, attribute) for attribute in ATTRIBUTES}
    saved_dtypes = forward_ws.RISE_CHECKED_DTYPES
    _, on_name, off_name = SETTINGS[args.setting]
    device = torch.device("cuda")
    print(f"{args.setting} each way{', with ' + ', '.join(args.also) + ' on' if args.also else ''}")
    print(f"| case | {on_name} ms (each round) | {off_name} ms (each round) | {off_name} / {on_name} (medians) |")
    print("| --- | --- | --- | --- |")
    for case in [case for name in args.cases for case in SUITES[name]]:
        keep = block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=False)
        causal = case.pattern == "causal"
        for name in args.also:
            set_setting(name, case.dim, True)
        if "persistent" in (args.setting, *args.also) and "claimed" not in (args.setting, *args.also):
            set_setting("claimed", case.dim, False)  # (on by default where not causal, it would take precedence)
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for on in (True, False):
                set_setting(args.setting, case.dim, on)
                times[on].append(_time_ms(lambda: blockattn.attention(q, k, v, blocks, is_causal=causal)))
        for attribute, value in saved.items():
            setattr(forward_ws, attribute, value)
        forward_ws.RISE_CHECKED_DTYPES = saved_dtypes
        med = {key: statistics.median(value) for key, value in times.items()}
        flops = _flops(case, blocks.density())
        print(f"| {case.label} | {' / '.join(f'{t:.3f}' for t in times[True])} ({flops / med[True] / 1e9:.0f}) | "
              f"{' / '.join(f'{t:.3f}' for t in times[False])} ({flops / med[False] / 1e9:.0f}) | "
              f"{med[False] / med[True]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
