"""Does the paired warp-specialized backward finish? Each case runs one backward in its own process under a time
limit (a kernel that never finishes takes its process with it); it prints the time to finish or "did not finish",
and the largest relative gap to the Triton backward's gradients. Before the twenty-sixth session's fix (one walk per
consumer over the group's heads, kernels/README.md "Paired programs") the GQA 128x64 cases with masks per head did
not finish.

    python benchmarks/paired_gqa_probe.py            # MHA 128x64 (control), GQA at 64x64 and 128x64, variants
    python benchmarks/paired_gqa_probe.py --limit 90
"""

import argparse
import json
import subprocess
import sys
import time

CASES = {  # (B, H, Hkv, S, D, block, density, one mask for all heads, flags set on backward_ws)
    "MHA 128x64": (1, 4, 4, 1024, 128, (128, 64), 0.4, False, {}),
    # the oracle tests that passed had 64x64 blocks with one mask for all heads (D=128) or D=64
    "GQA 4/2 64x64": (1, 4, 2, 1024, 128, (64, 64), 0.4, False, {}),
    "GQA 4/2 64x64 one mask": (1, 4, 2, 1024, 128, (64, 64), 0.4, True, {}),
    "GQA 4/2 128x64": (1, 4, 2, 1024, 128, (128, 64), 0.4, False, {}),
    "GQA 4/2 128x64 one mask": (1, 4, 2, 1024, 128, (128, 64), 0.4, True, {}),
    "GQA 4/2 128x64 D64": (1, 4, 2, 1024, 64, (128, 64), 0.4, False, {}),
    # every block kept: both walks of a program equally long, so no walk's rest runs alone
    "GQA 4/2 128x64 dense": (1, 4, 2, 1024, 128, (128, 64), 1.0, False, {}),
    "GQA 4/2 128x64 key order": (1, 4, 2, 1024, 128, (128, 64), 0.4, False, {"ORDERED": False}),
    "GQA 4/2 128x64 2 stages": (1, 4, 2, 1024, 128, (128, 64), 0.4, False, {"PAIRED_STAGES": 2}),
    "GQA 2/1 128x64": (1, 2, 1, 1024, 128, (128, 64), 0.4, False, {}),
    "GQA 4/2 128x64 S256": (1, 4, 2, 256, 128, (128, 64), 1.0, False, {}),
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
    batch, heads, kv_heads, seq, dim, block, density, one_mask, flags = CASES[name]
    for flag, value in flags.items():
        setattr(backward_ws, flag, value)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(batch, heads, seq, dim, device="cuda", generator=gen, dtype=dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, seq, dim, device="cuda", generator=gen, dtype=dtype).requires_grad_()
            for _ in range(2))
    mask_heads = 1 if one_mask else heads
    keep = torch.rand(batch, mask_heads, seq // block[0], seq // block[1], device="cuda", generator=gen) < density
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
            elapsed = time.perf_counter() - start
            if found:
                print(f"{name}: finished by {elapsed:.0f} s, gap {found['gap']:.1e}, {found['paired calls']} "
                      "warp-specialized call(s)", flush=True)
            else:
                last = (output.strip().splitlines() or [""])[-1]
                print(f"{name}: failed by {elapsed:.0f} s: {last[:200]}", flush=True)
        except subprocess.TimeoutExpired:
            child.kill()
            print(f"{name}: did not finish in {args.limit:.0f} s", flush=True)


if __name__ == "__main__":
    main()
