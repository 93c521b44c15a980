"""The package's forward with kernels/forward_ws.py as the working tree has it against the same file at another
revision, timed in turns (A, B, A, B, ...) in one process, through blockattn.attention on the same inputs. For a
kernel change with no switch of its own (a reordered loader, say), where ws_forward_ab.py's settings do not reach:
the base revision's file is loaded as a second module (blockattn.kernels.forward_ws_base), its kernels compiled
apart, and forward.gluon_module pointed at one module or the other before each call. Each case also prints the
largest gap between the two ways' outputs (0 where the change keeps the arithmetic).

    cd benchmarks && python revision_ab.py --base HEAD --rounds 5
    cd benchmarks && python revision_ab.py --base HEAD~1 --cases d64 key-split --rounds 4
    cd benchmarks && python revision_ab.py --base HEAD --cases d64-densities   # D=64 at d=0.5 / 0.25 / 0.1, both blocks
    cd benchmarks && python revision_ab.py --base HEAD --cases d64-short   # D=64 B8 S2048 / 4096 and the skewed mask
    cd benchmarks && python revision_ab.py --base-file /path/to/forward_ws.py   # where the copy has no .git

Only forward_ws.py differs between the ways; the rest of the package is the working tree's. A base whose file
needs a package the working tree lacks fails to load, as it says.
"""

import argparse
import atexit
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import torch

import blockattn
from blockattn.bench import Case, _flops, _inputs, _time_ms, block_mask
from blockattn.kernels import forward

# the package's own choice of module, put back after each case
_GLUON_MODULE = forward.gluon_module
# (case, KEY_SPLIT_DIMS for both ways): the design shape's d=0.1 at both head dims and block shapes, D=64 at d=0.5
SUITES = {"design": [(Case(block=block, density=0.1), ()) for block in ((128, 128), (128, 64))],
          "d64": [(Case(dim=64, block=(128, 128), density=d), ()) for d in (0.5, 0.1)]
          + [(Case(dim=64, block=(128, 64), density=0.1), ())],
          # D=64 at the design densities and both block shapes: a change that trades dense masks for sparse ones
          "d64-densities": [(Case(dim=64, block=block, density=d), ()) for block in ((128, 128), (128, 64))
                            for d in (0.5, 0.25, 0.1)],
          # D=64 where items are short (B8 S2048 / 4096) or long and short mixed (the skewed mask, target 6)
          "d64-short": [(Case(batch=8, heads=16, kv_heads=16, seq=seq, dim=64, density=0.5), ())
                        for seq in (2048, 4096)] + [(Case(dim=64, pattern="skewed", density=0.25), ())],
          "causal": [(Case(pattern="causal", block=(128, 128), density=0.5), ()),
                     (Case(dim=64, pattern="causal", block=(128, 64), density=0.5), ())],
          "key-split": [(Case(dim=64, block=(128, 128), density=d), (64, )) for d in (0.5, 0.1)]}


def base_module(revision: str, path: str | None = None):
    """kernels/forward_ws.py at `revision` (git show, from the repository holding this file), or the file at `path`
    where one is given, loaded as blockattn.kernels.forward_ws_base (its relative imports resolve in the installed
    package)."""
    if path is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = subprocess.run(["git", "show", f"{revision}:blockattn/kernels/forward_ws.py"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
        # Triton's JIT reads a kernel's source from its file (inspect), so the file must outlive the import: it goes
        # at exit
        handle = tempfile.NamedTemporaryFile("w", suffix="_forward_ws_base.py", delete=False)
        handle.write(source)
        handle.close()
        atexit.register(os.remove, handle.name)
        path = handle.name
    spec = importlib.util.spec_from_file_location("blockattn.kernels.forward_ws_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the revision to time the working tree's forward_ws against")
    parser.add_argument("--base-file", help="a forward_ws.py to load as the base instead of --base's (its name in "
                        "the table stays --base)")
    parser.add_argument("--cases", choices=sorted(SUITES), nargs="+", default=["design", "d64"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    modules = {"working tree": forward.gluon_module("forward_ws"), args.base: base_module(args.base, args.base_file)}
    key_split_dims = [module.KEY_SPLIT_DIMS for module in modules.values()]
    device = torch.device("cuda")
    names = list(modules)
    print(f"| case | {names[0]} ms (each round) | {names[1]} ms (each round) | {names[1]} / {names[0]} (medians) "
          f"| largest output gap |")
    print("| --- | --- | --- | --- | --- |")
    for case, key_split in [entry for name in args.cases for entry in SUITES[name]]:
        keep = block_mask(case, device)
        blocks = blockattn.BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=False)
        causal = case.pattern == "causal"

        def call(module):
            module.KEY_SPLIT_DIMS = key_split
            forward.gluon_module = lambda name: module
            return blockattn.attention(q, k, v, blocks, is_causal=causal)

        try:
            outputs = [call(modules[name]).float() for name in names]
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    times[name].append(_time_ms(lambda: call(modules[name])))
        finally:
            forward.gluon_module = _GLUON_MODULE
            for module, dims in zip(modules.values(), key_split_dims):
                module.KEY_SPLIT_DIMS = dims
        med = {name: statistics.median(t) for name, t in times.items()}
        flops = _flops(case, blocks.density())
        cells = [f"{' / '.join(f'{t:.3f}' for t in times[name])} ({flops / med[name] / 1e9:.0f})" for name in names]
        label = case.label + (", keys split" if key_split else "")
        print(f"| {label} | {cells[0]} | {cells[1]} | {med[names[1]] / med[names[0]]:.3f} | "
              f"{(outputs[0] - outputs[1]).abs().max().item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
