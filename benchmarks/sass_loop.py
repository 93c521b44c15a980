"""Offline look at a kernel's innermost loop in sm_90 SASS: registers, stack (spills) and the instruction mix per
iteration, for the package's three kernels compiled ahead of time, with no GPU. The launch-time specialization
is imitated: pointers and non-unit integers divisible by 16, unit strides as constants, group size 1.

Triton's compiler is used as installed; to see what the H200 machine (Triton 3.6) builds, run it under a
Triton 3.6 environment without torch (torch is stubbed out when it cannot be imported):

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy
    /tmp/t36/bin/python benchmarks/sass_loop.py --kernel dkdv --dq-mode kernel --tma --tile 64,64,4,2
"""

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile
import types


def _stub_torch():
    """The kernels' modules import torch for their launchers; compiling a kernel does not need it."""
    class Anything(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything(name)

        def __call__(self, *args, **kwargs):
            return Anything("call")
    for name in ("torch", "torch.library", "torch.nn", "torch.nn.functional", "torch.autograd", "torch.compiler",
                 "torch.distributed"):
        sys.modules[name] = Anything(name)


try:
    import torch  # noqa: F401
except ImportError:
    _stub_torch()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blockattn.kernels import autotune, backward, forward  # noqa: E402

KERNELS = {"fwd": forward.attention_fwd_kernel, "dq": backward.attention_bwd_dq_kernel,
           "dkdv": backward.attention_bwd_dkdv_kernel}
FLOAT_POINTERS = {"Q", "K", "V", "DO", "DK", "DV", "DQ", "Out"}
FP32_POINTERS = {"Lse", "Lse2", "Delta", "DQ_ACC", "Q_SCALE", "Q_ROW_DOT", "K_SCALE", "V_SCALE", "KEY_NORMS"}
UNHINTED = {"num_heads", "kv_heads", "mask_block_q", "mask_block_kv", "stride_vvb", "seq_bucket"}
SHOWN = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "IMAD", "IADD3", "LDGSTS", "UTMALDG", "REDG",
         "LDS", "STS", "BAR", "SHFL", "LDL", "STL")


def compile_kernel(kernel, tile, dim, tma, dq_mode, quant=None, flags=None):
    """triton.compile of kernel for sm_90 on a contiguous bf16 [B, H, S, dim] case with whole 128x128 blocks;
    flags: constexpr values to set instead (e.g. {"GATHER_BLOCK_MASK": 4, "FULL_TILES_FIRST": True, "FIXED_OFFSETS":
    True})."""
    block_m, block_n, warps, stages = tile
    values = dict(BLOCK_Q=128, BLOCK_KV=128, HEAD_DIM=dim, HEAD_DIM_V=dim, BLOCK_D=dim, BLOCK_DV=dim, EVEN_Q=True,
                  EVEN_KV=True, IS_CAUSAL=False, HAS_TOKEN_MASK=False, GATHER_BLOCK_MASK=False, HAS_KV_VALID=False,
                  FP32_PRECISION=None, IS_VARLEN=False, DQ_MODE=dq_mode, TMA_LOADS=tma, BLOCK_M=block_m,
                  BLOCK_N=block_n, group_size=1, SPLIT_WALK=False, FULL_TILES_FIRST=False, QUANT_QK=quant is not None,
                  QUANT_PV=forward.PV_FORMATS.get(quant), FIXED_OFFSETS=False)
    values.update(flags or {})
    pointer_types = dict.fromkeys(FLOAT_POINTERS, "*bf16")
    if quant is not None:  # the forward's q and k in int8, V in the scheme's P @ V format
        pointer_types.update(Q="*i8", K="*i8", V={"fp8": "*fp8e4nv", "int8": "*i8"}.get(values["QUANT_PV"], "*bf16"))
    boxes = {"K_DESC": block_n, "V_DESC": block_n, "Q_DESC": block_m, "DO_DESC": block_m}
    signature, constants = {}, {}
    for param in kernel.params:
        name = param.name
        if name in values:
            signature[name], constants[name] = "constexpr", values[name]
        elif name in boxes:
            element = "i8" if quant is not None and name == "K_DESC" else "bf16"
            signature[name] = f"tensordesc<{element}[1,1,{boxes[name]},{dim}]>" if tma else "*fp32"
        elif name == "DQ_DESC" or name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name in FLOAT_POINTERS:
            signature[name] = pointer_types[name]
        elif name.isupper() or name[0].isupper():
            signature[name] = "*i32"
        elif name in ("scale", "scale_log2"):
            signature[name] = "fp32"
        elif name.startswith("stride_") and (name.endswith("d") or name == "stride_ls"):
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if signature[p.name] not in ("constexpr", "fp32") and not signature[p.name].startswith("tensordesc")
             and p.name not in UNHINTED}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, **autotune.COMPILE_OPTIONS))


def _tool(name, cubin_path, *flags):
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return subprocess.run([path, *flags, cubin_path], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of a compiled kernel (its asm["cubin"]), with the control flow's labels (-c)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return _tool("nvdisasm", f.name, "-c")


def loops(sass: str) -> list:
    """Every span of nvdisasm's lines from a label to a conditional branch back to it (a loop's step), as
    (the label's line number, the span's lines), in SASS order."""
    lines = sass.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    spans = []
    for i, line in enumerate(lines):
        branch = re.search(r"@!?P\d\s+BRA `\((\.L_x_\d+)\)", line)
        if branch and labels.get(branch.group(1), i) < i:
            spans.append((labels[branch.group(1)], lines[labels[branch.group(1)]:i + 1]))
    return spans


def innermost_loop(sass: str) -> list:
    """The shortest span from a label to a conditional branch back to it that holds a tensor-core instruction."""
    spans = [body for _, body in loops(sass) if any("HGMMA" in b for b in body)]
    return min(spans, key=len) if spans else []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="fwd")
    parser.add_argument("--tile", default="128,64,4,2", help="BLOCK_M,BLOCK_N,num_warps,num_stages")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tma", action="store_true", help="tiles through tensor descriptors")
    parser.add_argument("--dq-mode", default="kernel", choices=backward.DQ_MODES)
    parser.add_argument("--quant", choices=tuple(forward.PV_FORMATS) + ("int8",), default=None,
                        help="the forward's quantized variant (K and V by pointers: give no --tma for int8-fp8 and "
                             "int8-int8)")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                        help="a kernel constexpr to set, e.g. --set GATHER_BLOCK_MASK=4 --set FULL_TILES_FIRST=True")
    parser.add_argument("--all-ops", action="store_true",
                        help="also list every opcode in the loop, most frequent first")
    args = parser.parse_args()
    tile = tuple(int(x) for x in args.tile.split(","))
    flags = {name: ast.literal_eval(value) for name, value in (item.split("=", 1) for item in args.set)}
    compiled = compile_kernel(KERNELS[args.kernel], tile, args.dim, args.tma, args.dq_mode, args.quant, flags)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = re.search(r"REG:(\d+).*?STACK:(\d+)", _tool("cuobjdump", cubin, "--dump-resource-usage"))
        loop = innermost_loop(_tool("nvdisasm", cubin, "-c"))
    ops = collections.Counter(m.group(1) for m in (re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
                                                   for line in loop) if m)
    print(f"triton {triton.__version__}, {args.kernel} tile {args.tile} D={args.dim} tma={args.tma}"
          f"{' dq_mode=' + args.dq_mode if args.kernel == 'dkdv' else ''}"
          f"{' quant=' + args.quant if args.quant else ''}: registers {usage.group(1)}, "
          f"stack {usage.group(2)} bytes; innermost loop {sum(ops.values())} instructions per iteration per warp:")
    print("  " + ", ".join(f"{name} {ops[name]}" for name in SHOWN if ops[name]))
    if args.all_ops:
        print("  all: " + ", ".join(f"{name} {n}" for name, n in ops.most_common()))


if __name__ == "__main__":
    main()
