"""Triton helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, FP32_PRECISION: tl.constexpr):
    """a @ b (+ acc) in fp32. FP32_PRECISION: None for fp16/bf16 operands; "ieee" or "tf32" for fp32 operands;
    "upcast" for bf16 operands under Triton's interpreter, whose dot multiplies bf16's raw bits: fp32 products
    of bf16 values are exact, so the upcast computes what the GPU's bf16 dot computes."""
    if FP32_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif FP32_PRECISION is None:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision=FP32_PRECISION)


@triton.jit
def int32_to_float(x):
    """int32 -> fp32, exact for |x| < 2**22 (an int8 product of at most 256 columns: 127 * 127 * 256 < 2**22), through
    the float's bits: 1.5 * 2**23 + x is a float with ulp 1, so adding to its bits and subtracting it back takes two
    full-rate instructions where a conversion runs at the GPU's conversion rate (a sixteenth per clock on Hopper)."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def round_to_int8(x):
    """fp32 x in [0, 127] -> int8, rounded to nearest (ties to even) through the float's bits, as int32_to_float
    converts back: 1.5 * 2**23 + x has ulp 1, so its low bits are the rounded x (two full-rate instructions where a
    conversion runs at a sixteenth of the rate)."""
    return ((x + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)


@triton.jit
def round_half_away_to_int8(x):
    """fp32 x in [-127, 127] -> int8 rounded to nearest, halves away from zero (the quantize kernels' rounding,
    which reference.quantize_rows matches): the conversion truncates toward zero, so a signed half is added first."""
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8)


@triton.jit
def to_float8(x, ROUND_FIRST: tl.constexpr):
    """fp32 x -> float8 e4m3 (finite, |x| <= 448). ROUND_FIRST, for Triton's interpreter, whose conversion drops the
    carry when a value rounds up to the next power of two (7.9 -> 4, 124.4 -> 64): round the fp32 mantissa to
    e4m3's 3 bits first (to nearest, ties to even, on the bits, where a carry moves into the exponent), so the
    conversion has nothing left to round in e4m3's normal range."""
    if ROUND_FIRST:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


# The kernels' GATHER_BLOCK_MASK: how the original block mask is read for block shapes no tile nests in (0: it is
# not; the lists are the mask). Where the blocks are at least as large as the tiles on both sides (100x100 blocks,
# a video frame's 1560 tokens, on 64x64 tiles), a tile spans at most two blocks each way, so four flags read once
# per tile decide it. Otherwise, where a key tile lies inside one key block (8x128 blocks on 64-wide tiles), each
# query row has one flag for the whole tile, and where a query tile lies inside one query block, each key has one.
GATHER_ELEMENTS: tl.constexpr = tl.constexpr(1)
GATHER_ROWS: tl.constexpr = tl.constexpr(2)
GATHER_COLUMNS: tl.constexpr = tl.constexpr(3)
GATHER_SPANS: tl.constexpr = tl.constexpr(4)


def gather_mode(block_mask, block_q: int, block_kv: int, mask_block_q: int, mask_block_kv: int) -> int:
    """The kernels' GATHER_BLOCK_MASK for lists at block_q x block_kv (a tile view, aligned to the sequence's start;
    the kernels' tiles nest in it) over a block mask at mask_block_q x mask_block_kv (None: no gathered mask)."""
    if block_mask is None:
        return 0
    if mask_block_q >= block_q and mask_block_kv >= block_kv:
        return GATHER_SPANS.value
    if mask_block_kv % block_kv == 0:
        return GATHER_ROWS.value
    if mask_block_q % block_q == 0:
        return GATHER_COLUMNS.value
    return GATHER_ELEMENTS.value


@triton.constexpr_function
def needs_element_tests(even_kv, is_causal, has_token_mask, gather_block_mask, has_kv_valid):
    """Whether a walk's steps need element_keep at all (the walks' flags of that name); without, a plain loop."""
    return (not even_kv) or is_causal or has_token_mask or gather_block_mask != 0 or has_kv_valid


@triton.jit
def element_keep(q_pos, k_pos, q_first, k_first, seq_q, seq_kv, off_b, off_h,
                 TOKEN_MASK, stride_tb, stride_th, stride_tq, stride_tk,
                 BLOCK_MASK, stride_mb, stride_mh, stride_mq, mask_block_q, mask_block_kv,
                 KV_VALID, stride_vb,
                 EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_TOKEN_MASK: tl.constexpr,
                 GATHER_BLOCK_MASK: tl.constexpr, HAS_KV_VALID: tl.constexpr):
    """Per-element visibility of a tile: q_pos and k_pos are broadcastable index tensors ([BM, 1] with [1, BN],
    or transposed), q_first and k_first the tile's first query and key; the result has the positions' broadcast
    shape. Only the tests the constexpr flags ask for are emitted.

    The block mask itself is applied by the lists; this handles what lies inside a kept block: keys past the
    sequence end, the causal diagonal, a token mask, kv_valid and, for block shapes no tile nests in, the
    original block mask (GATHER_BLOCK_MASK: per element, one flag per query row / per key read at the tile's key /
    query block, or the four flags of the blocks a tile no larger than them spans)."""
    keep = (q_pos >= 0) & (k_pos >= 0)
    in_kv = k_pos < seq_kv
    if not EVEN_KV:
        keep = keep & in_kv
    if IS_CAUSAL:
        keep = keep & (k_pos <= q_pos)
    in_bounds = (q_pos < seq_q) & in_kv
    if HAS_TOKEN_MASK:
        token_ptr = (TOKEN_MASK + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
                     + q_pos.to(tl.int64) * stride_tq + k_pos.to(tl.int64) * stride_tk)
        keep = keep & (tl.load(token_ptr, mask=in_bounds, other=0) != 0)
    if GATHER_BLOCK_MASK != 0:
        mask_base = BLOCK_MASK + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
        if GATHER_BLOCK_MASK == GATHER_ROWS:  # [BM, 1] (or [1, BM]) loads
            flags = tl.load(mask_base + (q_pos // mask_block_q) * stride_mq + k_first // mask_block_kv,
                            mask=q_pos < seq_q, other=0)
        elif GATHER_BLOCK_MASK == GATHER_SPANS:  # four scalar loads: the tile's block and the next ones
            q_block = q_first // mask_block_q
            k_block = k_first // mask_block_kv
            q_next = (q_block + 1) * mask_block_q  # the next query block's first query
            k_next = (k_block + 1) * mask_block_kv
            first = mask_base + q_block * stride_mq + k_block
            q_here = q_first < seq_q  # a tile wholly past the end (its view block holds the end) reads nothing
            k_here = k_first < seq_kv
            flag = tl.load(first, mask=q_here & k_here, other=0)
            flag_k = tl.load(first + 1, mask=q_here & (k_next < seq_kv), other=0)
            flag_q = tl.load(first + stride_mq, mask=(q_next < seq_q) & k_here, other=0)
            flag_qk = tl.load(first + stride_mq + 1, mask=(q_next < seq_q) & (k_next < seq_kv), other=0)
            past_k = k_pos >= k_next
            flags = tl.where(q_pos >= q_next, tl.where(past_k, flag_qk, flag_q), tl.where(past_k, flag_k, flag))
        elif GATHER_BLOCK_MASK == GATHER_COLUMNS:  # [1, BN] (or [BN, 1]) loads
            flags = tl.load(mask_base + (q_first // mask_block_q) * stride_mq + k_pos // mask_block_kv,
                            mask=in_kv, other=0)
        else:
            flags = tl.load(mask_base + (q_pos // mask_block_q) * stride_mq + k_pos // mask_block_kv,
                            mask=in_bounds, other=0)
        keep = keep & (flags != 0)
    if HAS_KV_VALID:
        valid_base = KV_VALID + off_b.to(tl.int64) * stride_vb
        if GATHER_BLOCK_MASK == 0:
            # The lists are the mask's own blocks or key tiles nested in them (api._kernel_inputs), so the key tile
            # lies in one key block: one count, no division per key (a tile past a ragged end still lies in the
            # last block, so the load stays in range).
            k_block = k_first // mask_block_kv
            keep = keep & (k_pos - k_block * mask_block_kv < tl.load(valid_base + k_block))
        else:
            valid = tl.load(valid_base + k_pos // mask_block_kv, mask=in_kv, other=0)
            keep = keep & ((k_pos % mask_block_kv) < valid)
    return keep


@triton.jit
def sequence_span(CU_SEQLENS, off_b, seq_len, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence off_b: read from the int32 offsets [N + 1] of a packed ("thd") batch, or
    (0, seq_len) for a padded one."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + off_b)
        length = tl.load(CU_SEQLENS + off_b + 1) - start
    else:
        start = seq_len * 0
        length = seq_len
    return start, length


@triton.jit
def head_tile(base, off_b, off_h, rows, cols, stride_b, stride_h, stride_s, stride_d):
    """Pointers [R, C] to rows `rows` (int64 sequence positions, a column [R, 1]) and columns `cols` [C] of head
    off_h of batch off_b in a [B, H, S, D] tensor at `base` with those strides."""
    return (base + off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h + rows * stride_s
            + cols[None, :] * stride_d)


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """Load a [R, C] tile, zero where a row (rows_ok [R]) or column (cols_ok [C]) is out of range; a side the
    caller knows is whole (EVEN_*) is not masked, which keeps the inner loops' loads plain."""
    if EVEN_ROWS and EVEN_COLS:
        return tl.load(ptrs)
    elif EVEN_ROWS:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    elif EVEN_COLS:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)


@triton.jit
def load_tile_or_box(desc, off_b, off_h, row, ptrs, rows_ok, cols_ok, EVEN_ROWS: tl.constexpr,
                     EVEN_COLS: tl.constexpr, TMA_LOADS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A [ROWS, COLS] tile: with TMA_LOADS the box at (off_b, off_h, row, 0) of desc, a host descriptor over a
    [B, H, S, D] tensor (rows and columns past its ends read as zeros); otherwise load_tile(ptrs, ...)."""
    if TMA_LOADS:
        tile = desc.load([off_b, off_h, row, 0]).reshape(ROWS, COLS)
    else:
        tile = load_tile(ptrs, rows_ok, cols_ok, EVEN_ROWS, EVEN_COLS)
    return tile


@triton.jit
def batch_head_program():
    """This program's index over batch x heads, which the grid spreads over its axes 1 and 2
    (launch.batch_head_axes: CUDA allows at most 65535 programs along either)."""
    return tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)


@triton.jit
def batch_and_head(num_heads):
    """(off_b, off_h) of this program, for the row-wise kernels (no GQA reordering): batch_head_program split."""
    pid_bh = batch_head_program()
    return pid_bh // num_heads, pid_bh % num_heads


@triton.jit
def query_tile_program(CU_SEQLENS_Q, CU_SEQLENS_KV, seq_q, seq_kv, num_heads, group_size,
                       BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Where a program of a kv-list walk works (grid: query tiles x batch * query heads, launch.batch_head_axes):
    (off_b, off_h, off_hkv, start_m, q_block, q_start, seq_q, kv_start, seq_kv), the last four its sequence's spans
    (sequence_span)."""
    pid_m = tl.program_id(0)
    pid_bh = batch_head_program()
    off_b = pid_bh // num_heads
    # Consecutive programs take different kv heads (head j -> group j % kv_heads, member j // kv_heads), as with
    # MHA; the programs resident at one time then spread over several kv heads' keys instead of crowding one's.
    kv_heads = num_heads // group_size
    slot = pid_bh % num_heads
    off_h = (slot % kv_heads) * group_size + slot // kv_heads
    off_hkv = off_h // group_size
    start_m = pid_m * BLOCK_M
    q_block = start_m // BLOCK_Q
    q_start, seq_q = sequence_span(CU_SEQLENS_Q, off_b, seq_q, IS_VARLEN)
    kv_start, seq_kv = sequence_span(CU_SEQLENS_KV, off_b, seq_kv, IS_VARLEN)
    return off_b, off_h, off_hkv, start_m, q_block, q_start, seq_q, kv_start, seq_kv


@triton.jit
def kv_list_start(KV_COUNT, KV_INDEX, K, V, off_b, off_h, off_hkv, q_block, kv_start,
                  stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
                  stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs):
    """(count, index_row, k_base, v_base): the length of query block q_block's kv list, a pointer to the list,
    and pointers to this (batch, kv head, sequence)'s first key in K and V."""
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh + kv_start.to(tl.int64) * stride_ks
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh + kv_start.to(tl.int64) * stride_vs
    count = tl.load(KV_COUNT + off_b * stride_cb + off_h * stride_ch + q_block)
    index_row = KV_INDEX + off_b.to(tl.int64) * stride_ib + off_h.to(tl.int64) * stride_ih + q_block * stride_iq
    return count, index_row, k_base, v_base


@triton.jit
def kv_list_tiles(it, index_row, block_offset, seq_kv, kv_start, off_b, off_hkv, K_DESC, V_DESC, k_base, v_base,
                  stride_ks, stride_kd, stride_vs, stride_vd, offs_n0, offs_d, offs_dv, d_ok, dv_ok,
                  BLOCK_KV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, EVEN_KV: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Step it of a walk over a kv list (the forward's and the dQ kernel's loop): the key tile's first key start_n,
    its positions offs_n [BN] and its K [BN, BD] and V [BN, BDV] tiles. index_row points at the query block's list,
    whose entries are the blocks plus block_offset (see FULL_TILES_FIRST in forward.py); k_base / v_base at this
    (batch, kv head, sequence)'s first key; K_DESC / V_DESC as in load_tile_or_box."""
    TILES_PER_BLOCK: tl.constexpr = BLOCK_KV // BLOCK_N
    kv_block = tl.load(index_row + it // TILES_PER_BLOCK) - block_offset
    start_n = kv_block * BLOCK_KV + (it % TILES_PER_BLOCK) * BLOCK_N
    offs_n = start_n + offs_n0
    n_ok = offs_n < seq_kv
    k = load_tile_or_box(K_DESC, off_b, off_hkv, kv_start + start_n,
                         k_base + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd,
                         n_ok, d_ok, EVEN_KV, HEAD_DIM == BLOCK_D, TMA_LOADS, BLOCK_N, BLOCK_D)
    v = load_tile_or_box(V_DESC, off_b, off_hkv, kv_start + start_n,
                         v_base + offs_n[:, None].to(tl.int64) * stride_vs + offs_dv[None, :] * stride_vd,
                         n_ok, dv_ok, EVEN_KV, HEAD_DIM_V == BLOCK_DV, TMA_LOADS, BLOCK_N, BLOCK_DV)
    return start_n, offs_n, k, v


@triton.jit
def first_tested_kv_block(start_m, seq_kv, BLOCK_KV: tl.constexpr, EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For a query tile whose first row is start_m, the lowest kv block whose elements need a test when the only
    tests are the causal diagonal and the sequence's end (an ascending kv list holds such blocks at its end):
    block kb crosses the diagonal iff its last key, (kb + 1) * BLOCK_KV - 1, lies past start_m; without EVEN_KV,
    every block from seq_kv // BLOCK_KV on holds keys past the end (a packed batch's lists, made at the longest
    length, may list blocks wholly past a shorter sequence's end). Past every block when neither applies."""
    pivot = seq_kv // BLOCK_KV + 1
    if IS_CAUSAL:
        pivot = tl.minimum(pivot, (start_m + 1) // BLOCK_KV)
    if not EVEN_KV:
        pivot = tl.minimum(pivot, seq_kv // BLOCK_KV)
    return pivot


@triton.jit
def untested_steps(index_row, count, start_m, seq_kv, BLOCK_KV: tl.constexpr, TILES_PER_BLOCK: tl.constexpr,
                   EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """How many steps of a split walk over a kv list (SPLIT_WALK) run without element tests: those before the
    first listed block at or after first_tested_kv_block."""
    pivot = first_tested_kv_block(start_m, seq_kv, BLOCK_KV, EVEN_KV, IS_CAUSAL)
    return first_entry_at_or_after(index_row, count, pivot) * TILES_PER_BLOCK


@triton.jit
def kv_walk_split(index_row, count, start_m, seq_kv, BLOCK_KV: tl.constexpr, TILES_PER_BLOCK: tl.constexpr,
                  EVEN_KV: tl.constexpr, IS_CAUSAL: tl.constexpr, FULL_TILES_FIRST: tl.constexpr):
    """(plain, offset) for a kv-list walk split in two (the forward's and the dQ kernel's): steps 0..plain run
    without element tests, the rest tested, their entries stored plus offset. FULL_TILES_FIRST: the lists hold the
    full tiles first, the others plus nk = cdiv(seq_kv, BLOCK_KV) (kernels/README.md); otherwise (SPLIT_WALK)
    untested_steps, offset 0."""
    if FULL_TILES_FIRST:
        offset = tl.cdiv(seq_kv, BLOCK_KV)
        plain = first_entry_at_or_after(index_row, count, offset) * TILES_PER_BLOCK
    else:
        offset = 0
        plain = untested_steps(index_row, count, start_m, seq_kv, BLOCK_KV, TILES_PER_BLOCK, EVEN_KV, IS_CAUSAL)
    return plain, offset


@triton.jit
def first_entry_at_or_after(index_row, count, pivot):
    """Position of the first entry >= pivot in an ascending list of count entries (count if none): a walk that
    starts there and wraps around visits the same blocks in a fixed order, but programs of neighbouring blocks no
    longer read the same tile at the same moment (on dense rows they all did, and queued on one L2 slice)."""
    lo = count * 0
    hi = count
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(index_row + mid) < pivot
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo
