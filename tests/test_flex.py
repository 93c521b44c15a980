"""FlexAttention interop: BlockMask round trips, and FlexAttention and blockattn on one selection both agree with
fp32 SDPA on the same blocks, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import blockattn
from blockattn import flex, masks, select_blocks
from conftest import DEVICE, ON_GPU, expand, qkv, random_keep


def test_block_mask_round_trip(geometry):
    g = geometry
    seq_q, seq_kv = g.seqs
    keep = random_keep(g.batch, g.heads, seq_q, seq_kv, g.block)
    blocks = blockattn.BlockSparsity.from_mask(keep, g.block, seq_q, seq_kv)
    block_mask = flex.to_block_mask(blocks)
    assert tuple(block_mask.seq_lengths) == (seq_q, seq_kv)
    back = flex.from_block_mask(block_mask)
    assert back.block_size == g.block and torch.equal(back.mask, blocks.mask)


def test_from_a_block_mask_made_by_flex():
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    block_mask = create_block_mask(causal, 1, 1, 512, 512, device=DEVICE, BLOCK_SIZE=128)
    assert torch.equal(flex.from_block_mask(block_mask).mask, masks.causal(512, 512, (128, 128), device=DEVICE).mask)


# on the CPU FlexAttention runs eagerly here, by design, and says so once
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_and_blockattn_agree_with_sdpa_on_one_selection():
    seq, block, dtype = (2048, (128, 128), torch.bfloat16) if ON_GPU else (256, (64, 32), torch.float32)
    q, k, v = qkv(1, 4, seq, 64, kv_heads=2, dtype=dtype, seed=11)
    selection = select_blocks(q, k, 0.25, block)
    visible = expand(selection.mask, block, seq, seq)
    grad = torch.randn(q.shape, generator=torch.Generator(device=DEVICE).manual_seed(2), device=DEVICE)

    def run(fn, dtype, backward=True):
        leaves = [t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v)]
        out = fn(*leaves)
        if not backward:
            return [out.detach().float()]
        out.backward(grad.to(out.dtype))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    reference = run(lambda a, b, c: F.scaled_dot_product_attention(a, b.repeat_interleave(2, 1), c.repeat_interleave(2, 1),
                                                                   attn_mask=visible), torch.float32)
    ours = run(lambda a, b, c: blockattn.attention(a, b, c, selection), dtype)
    # FlexAttention has no backward on the CPU, so there only its forward is compared
    theirs = run(lambda a, b, c: flex.attend(a, b, c, selection), dtype, backward=ON_GPU)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for name, want, mine in zip(("out", "dq", "dk", "dv"), reference, ours):
        gap = (mine - want).abs().max().item() / want.abs().max().item()
        assert gap < tolerance, f"blockattn {name}: {gap:.2e} of the scale off fp32 SDPA"
    for name, want, flexes in zip(("out", "dq", "dk", "dv"), reference, theirs):
        gap = (flexes - want).abs().max().item() / want.abs().max().item()
        assert gap < tolerance, f"FlexAttention {name}: {gap:.2e} of the scale off fp32 SDPA"
