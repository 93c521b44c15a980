"""The warp-specialized forward's tensor-core loops in sm_90 SASS, offline: for each of the kernel's loops that
issue both products and exponentials (each consumer's loop with fixed offsets and its loop with running maxima, in
the order they lie in the SASS), how many instructions a step takes, how many exponentials (MUFU) it holds and how
far into the step the first one comes. ptxas gives the same instructions different orders in different builds: at
D=64 the fixed loop's first exponential comes 37-38 or 110-111 instructions in (kernels/README.md, "Key blocks walked
as 64-key blocks").

Run it under the Triton the GPU machine has (3.6; see sass_loop.py for the environment):

    /tmp/t36/bin/python benchmarks/ws_forward_loops.py                       # D=64 and 128, 128x128 and 128x64
    /tmp/t36/bin/python benchmarks/ws_forward_loops.py --dim 64 --as-listed  # 128-key blocks walked as listed
"""

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loop import _tool, loops  # noqa: E402  (stubs torch where it is missing, and puts the package on the path)

from blockattn.kernels import forward_ws  # noqa: E402


def product_loops(sass: str) -> list:
    """(line of the loop's label, instructions a step, exponentials a step, the first exponential's place) of each
    loop (sass_loop.loops) that holds both HGMMA and MUFU, in SASS order."""
    found = []
    for start, body in loops(sass):
        ops = [m.group(2).split(".")[0] for m in (re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
                                                   for line in body) if m]
        # (the innermost loops only: an outer loop spans thousands of instructions)
        if "HGMMA" in ops and "MUFU" in ops and len(ops) < 1500:
            found.append((start, len(ops), ops.count("MUFU"), ops.index("MUFU")))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--blocks", nargs="+", default=["128x128", "128x64"])
    parser.add_argument("--as-listed", action="store_true",
                        help="the key blocks walked as listed (forward_ws.SPLIT_KEY_BLOCK_DIMS empty)")
    args = parser.parse_args()
    if args.as_listed:
        forward_ws.SPLIT_KEY_BLOCK_DIMS = ()
    with tempfile.TemporaryDirectory() as tmp:
        for dim in args.dim:
            for blocks in args.blocks:
                block_q, block_kv = map(int, blocks.split("x"))
                path = os.path.join(tmp, f"fwd_{dim}_{blocks}.cubin")
                with open(path, "wb") as f:
                    f.write(forward_ws.compile_sm90(block_q, block_kv, dim=dim).asm["cubin"])
                print(f"D={dim} {blocks}:")
                for start, steps, exps, first in product_loops(_tool("nvdisasm", path, "-c")):
                    print(f"  loop at SASS line {start}: {steps} instructions a step, {exps} MUFU, "
                          f"the first at {first}")


if __name__ == "__main__":
    main()
