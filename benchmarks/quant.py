"""The quantized forwards (quant="int8", "int8-fp8", "int8-int8") against blockattn's bf16 forward and
FlexAttention on the same block mask, and their accuracy against exact attention.

1. Speed, B1 H24 S32768 bf16, blocks 128x128, densities 1 / 0.5 / 0.25 / 0.1 at D=128 and 0.25 at D=64: forward ms
   and effective TFLOP/s (4 * B * H * S^2 * D * density; the quantized times include quantizing q and k, and v for
   int8-fp8 and int8-int8), and the int8 quantization alone (the keys' mean and two quantize_rows passes).
2. Accuracy, B1 H8 S4096 D128, density 0.5, keys with a shared offset (as real keys carry): relative error of out
   against fp64 attention on the unquantized inputs, for bf16 and each scheme.

    python benchmarks/quant.py            # on the GPU
"""

import argparse
import dataclasses

import torch

from blockattn import BlockSparsity, attention
from blockattn.bench import Case, _flops, _inputs, _runners, _time_ms, block_mask
from blockattn.kernels.quant import quantize_rows


SCHEMES = ("int8", "int8-fp8", "int8-int8")


def speed(device, densities, dims):
    names = ("bf16",) + SCHEMES + ("flex",)
    print("| D | density | " + " | ".join(f"{n} ms (TFLOP/s)" for n in names) + " | "
          + " | ".join(f"{s} vs {base}" for base in ("bf16", "flex") for s in SCHEMES) + " | quantize q, k ms |")
    print("| --- " * (2 + len(names) + 2 * len(SCHEMES) + 1) + "|")
    for dim, density in [(d, p) for d in dims for p in (densities if d == 128 else (0.25,))]:
        case = Case(dim=dim, density=density)
        keep = block_mask(case, device)
        runners = _runners(case, keep, device)
        blocks = BlockSparsity.from_mask(keep, case.block, case.seq, case.seq)
        q, k, v = _inputs(case, device, requires_grad=False)
        flops = _flops(case, blocks.density())
        times = {"bf16": _time_ms(lambda: attention(q, k, v, blocks))}
        for scheme in SCHEMES:
            times[scheme] = _time_ms(lambda: attention(q, k, v, blocks, quant=scheme))
        flex = runners["flex"][0]
        times["flex"] = _time_ms(lambda: flex(q, k, v)) if callable(flex) else float("nan")

        def quantize():
            mean = k.mean(2, dtype=torch.float32)
            quantize_rows(k, mean, subtract_mean=True, dot_mean=False)
            quantize_rows(q, mean, subtract_mean=False, dot_mean=True)
        quant_ms = _time_ms(quantize)
        cells = [f"{times[n]:.3f} ({flops / times[n] / 1e9:.0f})" for n in names]
        ratios = [f"{times[base] / times[n]:.2f}x" for base in ("bf16", "flex") for n in SCHEMES]
        print(f"| {dim} | {density:g} | {' | '.join(cells)} | {' | '.join(ratios)} | {quant_ms:.3f} |", flush=True)


def accuracy(device):
    case = Case(heads=8, kv_heads=8, seq=4096, density=0.5)
    keep = block_mask(case, device)
    q, k, v = _inputs(case, device, requires_grad=False)
    gen = torch.Generator(device=device).manual_seed(3)
    k = (k.float() + 4 * torch.randn(case.dim, generator=gen, device=device)).to(k.dtype)
    visible = keep.repeat_interleave(case.block[0], -2).repeat_interleave(case.block[1], -1)
    scores = q.double() @ k.double().transpose(-1, -2) * case.dim ** -0.5
    want = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v.double()
    for name, quant in (("bf16", None),) + tuple((scheme, scheme) for scheme in SCHEMES):
        out = attention(q, k, v, keep, case.block, quant=quant)
        err = ((out.double() - want).norm() / want.norm()).item()
        print(f"accuracy {case.label} keys offset: {name} relative error {err:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, dataclasses.replace(Case()).label)
    accuracy(device)
    speed(device, args.densities, args.dims)


if __name__ == "__main__":
    main()
