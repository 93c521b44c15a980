"""Offline check of the warp-specialized forward's sm_90 SASS for wgmma operand descriptors that may be read before
they are written: for each HGMMA, the definitions of the uniform registers its `gdesc[URn]` operand reads (URn ..
URn+3: A's descriptor and B's; B's alone where A is in registers), by reaching definitions over the listing's
control flow (nvdisasm -c), and those where a path from the kernel's entry reaches the read with no write on it.

Why: with two Q buffers (forward_ws.Q_BUFFER_DIMS) on the 256-key-box build that failed on the GPU, ptxas 12.8
(Triton 3.6's, the GPU machine's) computes the first consumer's Q descriptors for k-steps 1-3 once, in the preheader
of the first walk's loop, which never runs, and reads them in every later tile body of the item (kernels/README.md,
"Two Q buffers"): the PTX computes them where they are read. Since the first tile is taken alone (sixty-fifth
session) that build has 8 reports, all on the path of an item with no tile, where no tile body runs either; the GPU
tests pass with two buffers. The analysis knows no branch conditions, so a report is a path to look at, not proof: a
write guarded by "the item has a tile" read in a body guarded by "it has two" is reported too, though no run takes
that path.

Run under Triton 3.6 to see what the GPU machine builds (see sass_loop.py for the environment):

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sass_descriptors.py
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loop import disassemble  # noqa: E402  (stubs torch where it is missing, and puts the package on the path)

# (name, compile_sm90 arguments, SPLIT_KEY_BLOCK_DIMS): the builds the package ships at D=64 (its walk in turn, where
# the fault was) and D=128, and the two-buffer build the GPU tests failed on before the first tile was taken alone
CASES = [
    ("D=64 128x128 as shipped", dict(block_q=128, block_kv=128, dim=64), (64, )),
    ("D=64 128x64 causal as shipped", dict(block_q=128, block_kv=64, dim=64, causal=True), (64, )),
    ("D=64 256x256 causal as shipped", dict(block_q=256, block_kv=256, dim=64, causal=True), (64, )),
    ("D=128 128x128 as shipped", dict(block_q=128, block_kv=128, dim=128), (64, )),
    ("D=128 128x64 causal as shipped", dict(block_q=128, block_kv=64, dim=128, causal=True), (64, )),
    ("D=64 256x256 as listed, two Q buffers, rise checked (failed on the GPU before)",
     dict(block_q=256, block_kv=256, dim=64, check_rise=True, claimed=True, q_buffers=2), ()),
    ("D=64 256x256 as listed, one Q buffer, rise checked", dict(block_q=256, block_kv=256, dim=64, check_rise=True,
                                                              claimed=True, q_buffers=1), ()),
]


def _parse(sass: str):
    """(instructions [(address, text)], {label: index}) of an nvdisasm -c listing."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instruction = re.match(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if instruction:
            instructions.append((int(instruction.group(1), 16), instruction.group(2)))
    return instructions, labels


def _opcode(text: str):
    """(guard predicate or None, opcode, operands) of an instruction's text."""
    guarded = re.match(r"(@!?U?P\w+)\s+(.*)", text)
    guard, text = (guarded.group(1), guarded.group(2)) if guarded else (None, text)
    parts = text.split(None, 1)
    return guard, parts[0], parts[1] if len(parts) > 1 else ""


def _successors(instructions, labels) -> list:
    """Each instruction's successors' indices: the next one unless an unconditional branch, exit or return; a branch's
    target. (A call falls through: the callee's writes are not followed.)"""
    successors = []
    for i, (_, text) in enumerate(instructions):
        guard, opcode, operands = _opcode(text)
        following = []
        if opcode.startswith("BRA"):
            target = re.search(r"(\.L_x_\d+)", operands)
            if target:
                following.append(labels[target.group(1)])
            if guard or ".U.ANY" in opcode or ".DIV" in opcode:
                following.append(i + 1)
        elif not opcode.startswith(("EXIT", "RET")) or guard:
            following.append(i + 1)
        successors.append([j for j in following if j < len(instructions)])
    return successors


def _written(text: str) -> list:
    """The uniform registers an instruction writes (its first operand; two for a .64 operation)."""
    _, opcode, operands = _opcode(text)
    first = re.match(r"UR(\d+)\b", operands)
    if not first or opcode.startswith(("HGMMA", "SYNCS")):
        return []
    number = int(first.group(1))
    return [number, number + 1] if ".64" in opcode else [number]


ENTRY = -1  # a reaching "definition": the kernel's entry, where nothing is written yet


def descriptor_reads(sass: str) -> list:
    """For every HGMMA of the listing and each uniform register of its gdesc operand (URn .. URn+3: A's and B's
    descriptors; URn+2 and URn+3 alone, B's, where A comes from registers): (address, the HGMMA's text,
    register number, [the reaching writes' (address, text), or (ENTRY, "") where a path writes none])."""
    instructions, labels = _parse(sass)
    if not instructions:
        return []
    successors = _successors(instructions, labels)
    reaching = [None] * len(instructions)
    reaching[0] = {register: frozenset([ENTRY]) for register in range(256)}
    work = [0]
    while work:
        i = work.pop()
        state = dict(reaching[i])
        for register in _written(instructions[i][1]):
            state[register] = frozenset([i])
        for j in successors[i]:
            if reaching[j] is None:
                reaching[j] = state
                work.append(j)
                continue
            merged, changed = dict(reaching[j]), False
            for register, writes in state.items():
                union = merged.get(register, frozenset()) | writes
                if union != merged.get(register):
                    merged[register], changed = union, True
            if changed:
                reaching[j] = merged
                work.append(j)
    reads = []
    for i, (address, text) in enumerate(instructions):
        operand = re.search(r"gdesc\[UR(\d+)\]", text) if "HGMMA" in text else None
        if not operand or reaching[i] is None:
            continue
        first = int(operand.group(1))
        # A from registers (the P V products): only the pair's second half is read, B's descriptor
        start = first + 2 if re.search(r"HGMMA\S*\s+R\d+, R\d+, gdesc", text) else first
        for register in range(start, first + 4):
            writes = sorted(reaching[i].get(register, ()))
            reads.append((address, text, register,
                          [(ENTRY, "") if w == ENTRY else instructions[w] for w in writes]))
    return reads


def undefined_reads(reads: list) -> list:
    """Those of descriptor_reads' entries that a path reaches with nothing written (ENTRY among their writes)."""
    return [read for read in reads if any(address == ENTRY for address, _ in read[3])]


def _sass_of(arguments: dict, split_dims: tuple) -> str:
    """nvdisasm's listing of forward_ws.compile_sm90(**arguments) with SPLIT_KEY_BLOCK_DIMS split_dims."""
    from blockattn.kernels import forward_ws
    saved = forward_ws.SPLIT_KEY_BLOCK_DIMS
    forward_ws.SPLIT_KEY_BLOCK_DIMS = split_dims
    try:
        kernel = forward_ws.compile_sm90(**arguments)
    finally:
        forward_ws.SPLIT_KEY_BLOCK_DIMS = saved
    return disassemble(kernel.asm["cubin"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sass", help="check this nvdisasm -c listing instead of compiling CASES")
    parser.add_argument("--verbose", action="store_true", help="print each read with no write on some path")
    args = parser.parse_args()
    import triton
    print(f"triton {triton.__version__}")
    listings = [(args.sass, open(args.sass).read())] if args.sass else \
        [(name, _sass_of(arguments, split)) for name, arguments, split in CASES]
    for name, sass in listings:
        reads = descriptor_reads(sass)
        undefined = undefined_reads(reads)
        print(f"{name}: {len(undefined)} of {len(reads)} descriptor register reads with no write on some path")
        if args.verbose:
            for address, text, register, writes in undefined:
                shown = " | ".join("entry" if w == ENTRY else f"{w:#x} {t[:48]}" for w, t in writes)
                print(f"  {address:#07x} {text[:40]} UR{register}: {shown}")


if __name__ == "__main__":
    sys.exit(main())
