"""Whether a change moved the GPU code: the sm_90 SASS of the kernels' variants at a base revision against the
working tree, compiled ahead of time with no GPU (the Triton kernels through sass_loop.compile_kernel, the
warp-specialized Gluon kernels through their compile_sm90). A refactor whose SASS is the same instruction for
instruction needs no new GPU run; one that differs lists the variants it touched.

Run it under the Triton the GPU machine has (3.6; see sass_loop.py for the environment):

    /tmp/t36/bin/python benchmarks/sass_same.py --base 4f3f440
"""

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# (kernel, constexpr flags, quant, tensor descriptors): the design case, and each walk and test the flags select
VARIANTS = [
    ("fwd", {}, None, True), ("dq", {}, None, True), ("dkdv", {}, None, True),
    ("fwd", {"IS_CAUSAL": True, "SPLIT_WALK": True, "EVEN_KV": False}, None, True),
    ("dq", {"IS_CAUSAL": True, "SPLIT_WALK": True, "EVEN_KV": False}, None, True),
    ("dkdv", {"IS_CAUSAL": True, "SPLIT_WALK": True, "EVEN_KV": False}, None, True),
    ("fwd", {"GATHER_BLOCK_MASK": 2, "EVEN_KV": False}, None, True),
    ("dkdv", {"GATHER_BLOCK_MASK": 2, "EVEN_KV": False}, None, True),
    ("fwd", {"GATHER_BLOCK_MASK": 4, "FULL_TILES_FIRST": True, "EVEN_KV": False}, None, True),
    ("dq", {"GATHER_BLOCK_MASK": 4, "FULL_TILES_FIRST": True, "EVEN_KV": False}, None, True),
    ("dkdv", {"GATHER_BLOCK_MASK": 4, "FULL_TILES_FIRST": True, "EVEN_KV": False, "EVEN_Q": False}, None, True),
    ("fwd", {"IS_VARLEN": True, "HAS_TOKEN_MASK": True, "EVEN_KV": False}, None, False),
    ("dq", {"IS_VARLEN": True, "HAS_KV_VALID": True, "EVEN_KV": False}, None, False),
    ("dkdv", {"IS_VARLEN": True, "HAS_TOKEN_MASK": True, "EVEN_Q": False}, None, False),
    ("fwd", {}, "int8", True), ("fwd", {}, "int8-fp8", False),
    ("fwd", {"GATHER_BLOCK_MASK": 1, "HAS_KV_VALID": True}, "int8-int8", False),
    # kv_valid over key tiles split from its blocks (api.KV_VALID_TILE_KV): full tiles first, a count per tile
    ("fwd", {"HAS_KV_VALID": True, "FULL_TILES_FIRST": True, "BLOCK_KV": 64, "EVEN_KV": False}, None, True),
    ("dkdv", {"HAS_KV_VALID": True, "FULL_TILES_FIRST": True, "BLOCK_KV": 64, "IS_CAUSAL": True}, None, True),
]


# The warp-specialized Gluon kernels, through their modules' compile_sm90 (keyword arguments): each walk, head dim,
# fixed offsets or not, and the backward's paired, grouped and split programs
GLUON_VARIANTS = [
    ("forward_ws", dict(block_q=128, block_kv=128)), ("forward_ws", dict(block_q=128, block_kv=64)),
    ("forward_ws", dict(block_q=128, block_kv=128, causal=True)),
    ("forward_ws", dict(block_q=128, block_kv=128, fixed_offsets=True)),
    ("forward_ws", dict(block_q=128, block_kv=128, dim=64)), ("forward_ws", dict(block_q=128, block_kv=64, dim=64)),
    ("forward_ws", dict(block_q=128, block_kv=128, dim=64, causal=True)),
    ("forward_ws", dict(block_q=128, block_kv=128, dim=64, fixed_offsets=False)),
    ("forward_ws", dict(block_q=128, block_kv=128, dim=64, check_rise=True)),
    ("forward_ws", dict(block_q=128, block_kv=64, dim=64, causal=True)),
    ("forward_ws", dict(block_q=128, block_kv=64, causal=True)),
    ("backward_ws", dict(block_q=128, block_kv=128)), ("backward_ws", dict(block_q=128, block_kv=64)),
    ("backward_ws", dict(block_q=128, block_kv=128, causal=True)),
    ("backward_ws", dict(block_q=128, block_kv=64, grouped=True, kv_split=4)),
    ("backward_ws", dict(block_q=128, block_kv=128, dim=64)),
]


def _sass_fingerprint(sass: str) -> str:
    """Instruction count and a hash of an nvdisasm listing without addresses and comments."""
    # (a called function's mangled name spells its argument types, which a regrouping of its arguments changes
    # without changing an instruction: names count as one, and so does any run of spaces, whose padding follows them)
    lines = [" ".join(re.sub(r"\$[^\s,;()`]+", "$name", re.sub(r"/\*[0-9a-f]+\*/", "", line)).split())
             for line in sass.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("//", "."))]
    return f"{len(lines)} instructions, {hashlib.sha1(chr(10).join(lines).encode()).hexdigest()[:12]}"


def fingerprints(root: str) -> dict:
    """variant label -> (instruction count, hash of the SASS without addresses and comments), for the kernels of
    the tree at root; a variant that does not compile there (a flag it lacks) maps to its error."""
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    import sass_loop  # puts root first on the path, so blockattn comes from root
    result = {}
    for kernel, flags, quant, tma in VARIANTS:
        label = f"{kernel} {json.dumps(flags, sort_keys=True)} quant={quant} tma={tma}"
        try:
            compiled = sass_loop.compile_kernel(sass_loop.KERNELS[kernel], (64, 64, 4, 2), 128, tma, "kernel",
                                                quant, flags)
        except Exception as error:  # the base may predate a flag
            result[label] = f"does not compile: {type(error).__name__}"
            continue
        result[label] = _sass_fingerprint(sass_loop.disassemble(compiled.asm["cubin"]))
    for module, kwargs in GLUON_VARIANTS:
        label = f"{module} {json.dumps(kwargs, sort_keys=True)}"
        try:
            compiled = importlib.import_module(f"blockattn.kernels.{module}").compile_sm90(**kwargs)
        except Exception as error:
            result[label] = f"does not compile: {type(error).__name__}"
            continue
        result[label] = _sass_fingerprint(sass_loop.disassemble(compiled.asm["cubin"]))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--_side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._side:  # one tree's fingerprints, in a process of its own (the modules differ between trees)
        print(json.dumps(fingerprints(args._side)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as base_tree:
        subprocess.run(["git", "-C", here, "worktree", "add", "-q", "--detach", base_tree, args.base], check=True)
        # both sides compile through this tree's sass_loop (the base's may predate its options)
        shutil.copy(os.path.join(here, "benchmarks", "sass_loop.py"), os.path.join(base_tree, "benchmarks"))
        try:
            sides = {}
            for name, root in (("base", base_tree), ("tree", here)):
                run = subprocess.run([sys.executable, script, "--base", args.base, "--_side", root],
                                     capture_output=True, text=True, check=True)
                sides[name] = json.loads(run.stdout.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", here, "worktree", "remove", "--force", base_tree], check=True)
    same = True
    for label, fingerprint in sides["tree"].items():
        before = sides["base"].get(label)
        if before != fingerprint:
            same = False
        print(f"{'same' if before == fingerprint else 'DIFFERS'}  {label}: {before} -> {fingerprint}")
    print("SASS unchanged in every variant" if same else "SASS changed: run the GPU tests of the variants marked")


if __name__ == "__main__":
    main()
