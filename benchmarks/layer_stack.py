"""Short sequences inside a model: a training step (forward and backward) through a stack of layers, each with one
attention call, for blockattn, FlexAttention (compiled, same block mask) and dense SDPA. B8 H16 S D128 bf16,
d=0.5, 128x128 blocks, as short_host.py.

short_host.py times one attention forward+backward a call. There autograd wakes its device thread for every
backward and the host time of that hand-off is about half the call's (autograd_floor.py). In a model the device
thread runs every layer's backward in one go, so a step pays the hand-off once. This benchmark measures that
setting, per layer:

- "attention": x -> attention(x, k_l, v_l) for l = 1..L, with k_l and v_l leaves that take gradients: nothing but
  attention, so the host's share stays as large as it can be;
- "block": a transformer layer without its MLP: x [B, S, H*D] -> Linear to q, k, v -> attention -> Linear -> + x.

Prints, per stack, implementation and thread (autograd's device thread, the default; or the calling thread with
torch.autograd.set_multithreading_enabled(False)): the step's do_bench time and its host enqueue time, both in ms
per layer.

    python benchmarks/layer_stack.py --seq 1024 2048 --layers 8 --rounds 2
"""

import argparse

import torch
import triton.testing

import blockattn
from blockattn.bench import flex_block_mask

from exp_short import calling_thread, host_ms, short_inputs

HEADS, DIM, BATCH = 16, 128, 8


def attention_fns(blocks):
    """name -> attention(q, k, v) on [B, H, S, D] tensors: blockattn and FlexAttention on blocks, SDPA dense."""
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    flex_mask = flex_block_mask(blocks)
    return {"blockattn": lambda q, k, v: blockattn.attention(q, k, v, blocks),
            "flex": lambda q, k, v: flex(q, k, v, block_mask=flex_mask),
            "sdpa-dense": torch.nn.functional.scaled_dot_product_attention}


def attention_stack(attend, layers: int, seq: int):
    """A training step through `layers` attention calls chained on the query; returns step()."""
    x = torch.randn(BATCH, HEADS, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    kv = [tuple(torch.randn_like(x).requires_grad_(True) for _ in range(2)) for _ in range(layers)]
    leaves = [x] + [t for pair in kv for t in pair]

    def step():
        h = x
        for k, v in kv:
            h = attend(h, k, v)
        return torch.autograd.grad(h, leaves, grad)
    return step


def block_stack(attend, layers: int, seq: int):
    """A training step through `layers` attention blocks (q, k, v projection, attention, output projection,
    residual; no MLP, no norm); returns step()."""
    device, width = torch.device("cuda"), HEADS * DIM
    torch.manual_seed(0)
    options = dict(bias=False, device=device, dtype=torch.bfloat16)
    projections = [(torch.nn.Linear(width, 3 * width, **options), torch.nn.Linear(width, width, **options))
                   for _ in range(layers)]
    x = torch.randn(BATCH, seq, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    leaves = [x] + [linear.weight for pair in projections for linear in pair]

    def step():
        h = x
        for to_qkv, to_out in projections:
            q, k, v = to_qkv(h).view(BATCH, seq, 3, HEADS, DIM).permute(2, 0, 3, 1, 4).unbind(0)
            h = h + to_out(attend(q, k, v).transpose(1, 2).reshape(BATCH, seq, width))
        return torch.autograd.grad(h, leaves, grad)
    return step


STACKS = {"attention": attention_stack, "block": block_stack}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stacks", nargs="+", choices=tuple(STACKS), default=list(STACKS))
    parser.add_argument("--impls", nargs="+", default=["blockattn", "flex", "sdpa-dense"])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, B{BATCH} H{HEADS} D{DIM} bf16, d=0.5 "
          f"(sdpa-dense: every block), {args.layers} layers; ms per layer", flush=True)
    for seq in args.seq:
        _, _, _, blocks, _ = short_inputs(BATCH, HEADS, seq, 0.5)
        fns = attention_fns(blocks)
        steps = {(stack, impl): STACKS[stack](fns[impl], args.layers, seq)
                 for stack in args.stacks for impl in args.impls}
        for round_ in range(args.rounds):
            for (stack, impl), step in steps.items():
                for thread, fn in (("device", step), ("calling", calling_thread(step))):
                    gpu = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / args.layers
                    host = host_ms(fn, calls=20) / args.layers
                    print(f"round {round_} S{seq} {stack} {impl} {thread}-thread: step {gpu:.3f} ms/layer, "
                          f"host enqueue {host:.3f} ms/layer", flush=True)


if __name__ == "__main__":
    main()
