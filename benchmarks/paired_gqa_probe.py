"""Does the paired warp-specialized backward finish? Each case runs one backward in its own process under a time
limit (a kernel that never finishes takes its process with it), with backward_ws.PAIRED_GROUPED switched on so that
GQA calls with 64-key blocks take the paired programs; it prints the time to finish or "did not finish", and the
largest relative gap to the Triton backward's gradients.

    python benchmarks/paired_gqa_probe.py            # MHA 128x64 (control), GQA 64x64, GQA 128x64 and variants
    python benchmarks/paired_gqa_probe.py --limit 90
"""

import argparse
import json
import subprocess
import sys
import time

CASES = {  # (B, H, Hkv, S, block, dtype, flags set on backward_ws)
    "MHA 128x64": (1, 4, 4, 1024, (128, 64), "bfloat16", {}),
    "GQA 4/2 64x64": (1, 4, 2, 1024, (64, 64), "bfloat16", {}),
    "GQA 4/2 128x64": (1, 4, 2, 1024, (128, 64), "bfloat16", {}),
    "GQA 4/2 128x64 key order": (1, 4, 2, 1024, (128, 64), "bfloat16", {"ORDERED": False}),
    "GQA 4/2 128x64 2 stages": (1, 4, 2, 1024, (128, 64), "bfloat16", {"PAIRED_STAGES": 2}),
    "GQA 2/1 128x64": (1, 2, 1, 1024, (128, 64), "bfloat16", {}),
}


def one(name: str) -> None:
    """Run case `name` in this process: print a JSON line with the largest relative gradient gap."""
    import torch

    import blockattn
    from blockattn.kernels import backward_ws, tma
    tma.MIN_DESCRIPTOR_WORK = 0  # these sizes would run the Triton kernels otherwise
    calls = []
    run = backward_ws.attention_backward_ws
    backward_ws.attention_backward_ws = lambda *a: (calls.append(a[7:9]), run(*a))[1]
    batch, heads, kv_heads, seq, block, dtype, flags = CASES[name]
    for flag, value in flags.items():
        setattr(backward_ws, flag, value)
    backward_ws.PAIRED_GROUPED = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, dtype)
    q = torch.randn(batch, heads, seq, 128, device="cuda", generator=gen, dtype=dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, seq, 128, device="cuda", generator=gen, dtype=dtype).requires_grad_()
            for _ in range(2))
    keep = torch.rand(batch, heads, seq // block[0], seq // block[1], device="cuda", generator=gen) < 0.4
    out = blockattn.attention(q, k, v, keep, block)
    grad = torch.randn_like(out)
    grads = {}
    for enabled in (False, True):
        backward_ws.ENABLED = enabled
        grads[enabled] = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    torch.cuda.synchronize()
    gap = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads[True], grads[False]))
    print(json.dumps({"gap": gap, "paired calls": len(calls)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a case may take")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child's case
    args = parser.parse_args()
    if args.case:
        one(args.case)
        return
    start = time.perf_counter()
    children = {name: subprocess.Popen([sys.executable, __file__, "--case", name], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True) for name in CASES}
    for name, child in children.items():
        try:
            output, _ = child.communicate(timeout=max(1.0, args.limit - (time.perf_counter() - start)))
            lines = [line for line in output.splitlines() if line.startswith("{")]
            found = json.loads(lines[-1]) if lines else None
            result = (f"gap {found['gap']:.1e}, {found['paired calls']} warp-specialized call(s)" if found
                      else f"failed: {output[-300:]}")
            print(f"{name}: finished by {time.perf_counter() - start:.0f} s, {result}", flush=True)
        except subprocess.TimeoutExpired:
            child.kill()
            print(f"{name}: did not finish in {args.limit:.0f} s", flush=True)


if __name__ == "__main__":
    main()
