"""The warp-specialized forward for Hopper, written in Gluon: FlashAttention-3's structure over blockattn's kv lists.

One program takes a 128-row query tile of one (batch, head). A loader warp reads the tile's two 64-row halves of Q
and then each kept key tile's K and V into a ring of shared-memory stages through TMA; two consumer warpgroups each
own one half, with their scores and accumulator in registers (wgmma). Each consumer issues a key tile's Q K^T
together with the previous tile's P V and computes the softmax of the new scores before it waits for that P V (in
source order: ptxas moves that wait above the exponentials, which measured no slower than keeping it below them;
kernels/README.md, "The warp-specialized forward"). That is the D=128 loop; at D=64 each consumer walks 256-key
tiles and runs its products and softmax in turn (TILE_KEYS, OVERLAPPED), and after the first tile keeps each row's
exponent offset where a bound on its scores allows (FIXED_OFFSET_DIMS). Measured on the H200 at B1 H24 S32768
D128, density 0.25, 128x128 blocks: 5.33 ms against about 6.1 ms for the Triton forward and 7.82 ms for
FlexAttention (BENCHMARKS.md, fifteenth session; the figures move by up to 7% with what ran just before, through the
GPU's power limit).

It covers the plain walk and the causal one: no other element tests (no token mask, kv_valid, gathered block
mask, sequence end inside a key tile), bf16 or fp16, head dim 128 or 64 (HEAD_DIMS), blocks whose
query side holds whole 128-row tiles. Under is_causal the key tiles from the first block that reaches past the
program's first row on take the test key <= query, and the longest lists run first.
`plan()` says whether a call qualifies; forward.attention_forward runs the Triton forward otherwise. Triton's
interpreter cannot run Gluon, so on the CPU the tests compile this kernel for sm_90 without running it; the GPU
tests run it against the fp64 oracle.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import autotune, launch, replay
from .bounds import BF16_HEADROOM, FP16_HEADROOM, KEY_NORM_PARTS, RISE_LIMIT, key_norm_parts

# A TMA copy from global into shared memory: async_load from Triton 3.9 on, where the older name raises; Triton 3.6
# has only async_copy_global_to_shared (same arguments: descriptor, coordinates, barrier, destination).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# and from shared memory to global: async_store, or async_copy_shared_to_global (descriptor, coordinates, source)
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

# A partition's threads' barrier: gl.barrier from Triton 3.8 on, gl.thread_barrier before
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# Whether attention_forward may take this kernel (benchmarks switch it off to time the Triton forward).
ENABLED = True
# Whether each consumer writes its rows of out through the TMA unit, staged in its half of Q's shared memory (free
# once its last score product is done), rather than by pointer stores from the accumulator's layout, which
# Nsight Compute counts as twice the sectors they need. Off until measured in more rounds: 1.6-1.8% faster at d=0.1
# with either one timed first, but 1.5-4.8% slower at d=0.5 in three of four comparisons (thirty-fifth session); in
# the thirty-sixth's two orders no slower at d=0.5 (0.2-0.7% faster, geometric mean), and at d=0.1 the one timed
# second won by 2-8% either way (BENCHMARKS.md; `benchmarks/ws_forward.py --o-through-tma`).
O_THROUGH_TMA = False
# Query rows per consumer warpgroup (4 warps x 16 rows of a wgmma) and per program (two consumers).
CONSUMER_ROWS = 64
TILE_Q = 2 * CONSUMER_ROWS
HEAD_DIM = 128
# Head dims (D = Dv) calls may take the kernel with. At 64 (208 KiB of shared memory: 3 stages of 256-key tiles) it
# beats the Triton forward by 14-17% / 11-14% / 1-3% at B1 H24 S32k d=0.5 / 0.25 / 0.1 (BENCHMARKS.md, forty-third
# session); shorter, see MIN_KEYS.
HEAD_DIMS = (64, HEAD_DIM)
# Keys per tile of the walk, per head dim. The loader fills a tile with boxes of the largest of (the tile, 128, 64)
# keys that divides the key block (sub tiles), from consecutive list entries or from one block. At D=128: 128 keys;
# the 128x64 design case (d=0.25) ran 5.48 ms with two 64-key sub tiles a tile against 5.89 ms with 64-key tiles
# (and 4 stages), in one process. At D=64: 256 keys, which halves the walk's steps for the same exponentials
# (see OVERLAPPED).
TILE_KEYS = {128: 128, 64: 256}
# Head dims whose kernel, where not causal, walks each listed key block of more than 64 keys as that many 64-key blocks,
# from lists derived once per lists tensor (split_key_blocks: entry e becomes e * parts .. e * parts + parts - 1; they
# take `parts` times the list memory, 12.6 MB more at B1 H24 S32k 128x128) and the kernel runs with 64-key blocks. At
# D=64 the kernel with 64-key blocks ran the same keys 4-7% faster than with 128-key blocks (H100, fifty-sixth session:
# under Nsight Compute, `benchmarks/profile_case.py --dim 64 --density 0.5 --forward-only --block 128 64 --mask-keys
# 128`, 5.92 against 6.16-6.28 ms at 128x128 as listed), with the same instructions in their consumers' loops but not in
# the same order: ptxas (Triton 3.6) starts the fixed loop's exponentials 37 instructions in for the consumer placed
# first in the SASS and 110 for the other with 64-key blocks, 110 and 37 with 128-key blocks (38 and 38 with the 64-key
# sub tiles below; kernels/README.md). The profile differs in stalls (barrier 4.1 against 4.4 and MIO throttle 0.6
# against 0.9 cycles an instruction). Loading 128-key blocks in 64-key sub tiles, the same boxes at the same rows as the
# split lists, did not close it (0.96-1.00x; the fifty-fifth session's NARROW_SUB_TILE_DIMS, removed). Timed in turns
# (`benchmarks/ws_forward_ab.py --setting split-key-blocks --cases design`, H100, B1 H24 S32k bf16): D=64 128x128 1.044x
# / 1.023x / 1.043x as fast at d=0.5 / 0.25 / 0.1, D=128 128x128 d=0.1 0.976x, so not there; causal 0.997x and 0.970x
# (three rounds, `--cases causal`), so not causal. Skewed / uniform at D=64 d=0.25 with it: 0.986 (target 6). Nor
# under the key split (KEY_SPLIT_DIMS), which takes the mask's blocks whole in its 128-key tiles.
SPLIT_KEY_BLOCK_DIMS: tuple = (64, )
# Whether a consumer issues each key tile's Q K^T together with the previous tile's P V, per head dim
# (FlashAttention-3's overlap inside a warpgroup: the softmax of one tile runs under the other's products). At D=64
# with 256-key tiles it would hold two tiles' P in registers and spill; without it each consumer runs its products,
# then its softmax, and the two consumers' turns interleave by themselves. B1 H24 S32k D=64 against 128-key tiles
# overlapped (4 stages): 1.01-1.09x as fast at d=0.5 and 0.25, at par at d=0.1 (forty-second session, BENCHMARKS.md;
# `benchmarks/ws_forward.py --cases d64 --tiles 128,1,4`).
OVERLAPPED = {128: True, 64: False}
# Head dims whose kernel, where not causal, runs four consumer warpgroups instead of two: (HALF, PART) owns query rows
# HALF*64 .. HALF*64+63 and the key tiles PART, PART + 2, ... of the walk, with its own offsets, sums and accumulator,
# which the PART 1 consumer hands to the PART 0 one through shared memory at the end (_hand_over, _merged). Each
# multiprocessor's schedulers then hold four consumer warps instead of two, so that one warp's exponentials run under
# another's products more often; at KEY_SPLIT_REGS registers a thread, which hold a 64-key step's scores but not a
# 128-key one's, a consumer takes each 128-key tile (KEY_SPLIT_TILE_N) in two steps of KEY_SPLIT_STEP_N keys
# (kernels/README.md, "Keys split between consumer pairs"). The experiment (`benchmarks/exp_key_split.py`, H100, B1
# H24 S32k D=64 bf16, 128x128, a program a tile, no rise check) ran 1.16x / 1.05-1.07x / 1.02x / 1.05-1.06x as fast
# as this kernel at d=1 / 0.5 / 0.25 / 0.1 (sixtieth session). Built into the walk (the mask's own key blocks, not
# SPLIT_KEY_BLOCK_DIMS's), it passes its oracle tests on the GPU (tests/test_forward_ws.py, "key_split") but timed in
# turns against two consumers (H100, sixty-second session; `benchmarks/ws_forward_ab.py --setting key-split --cases
# d64`) it ran 0.99-1.04x / 0.99-1.06x / 0.98-1.00x as fast at d=0.5 / 0.25 / 0.1, short of the experiment, and
# 1.04x / 0.97-1.00x / 1.02x in the sixty-third session's run (the loader's list reads moved before its waits,
# benchmarks/patches/loader-rows-before-wait.patch): a gain at d=0.5 only, where the target is met anyway. Off.
KEY_SPLIT_DIMS: tuple = ()
# The same under is_causal: each part's tiles before the walk's first tested one skip the causal test, as with two
# consumers. Off: 0.98x / 1.01x as fast at 128x128 / 128x64 (same run; 1.02x / 1.00x in the sixty-third session's).
KEY_SPLIT_CAUSAL_DIMS: tuple = ()
KEY_SPLIT_TILE_N = 128
KEY_SPLIT_STEP_N = 64
KEY_SPLIT_STAGES = 4
# Registers a consumer thread takes with four consumers: 4 x 128 x 120 + 128 x 24 of the 64K (the loader's warp is
# padded to a warpgroup); the launch bound then 96 (20 warps x 32 x 96 <= 64K).
KEY_SPLIT_REGS = 120
KEY_SPLIT_MAX_REGS = 96
# (Without the overlap, the consumers' score products forced into turns ran 2-11% slower, and a narrow last tile
# (products over its first half where its keys lie there) 1.5-5.5% slower where not causal and no faster causal:
# kernels/README.md, fifty-eighth session; benchmarks/patches/ping-pong-and-narrow-last-tiles.patch.) A walk
# with three copies of the tile's code a consumer instead of five (ten under is_causal), the first tile and the cold
# walk in one loop, ran 0.92-0.98x as fast where not causal and 0.99-1.03x causal, its hot loop the same
# instructions (H100, fifty-ninth session; kernels/README.md, "The compact walk";
# benchmarks/patches/compact-walk.patch).
# Keys (Sk) a call needs, per head dim, to take this kernel; below it the Triton forward runs. At D=64 (forty-second
# session, BENCHMARKS.md; `benchmarks/ws_forward.py --cases d64sizes --no-flex`) the Triton forward ran 16-52% faster
# at B8 S2048 and 0-68% at B8 S4096 (d=0.5 / 0.1), where each query tile walks few key tiles and this kernel's
# fixed cost a program weighs more; from S8192 on this kernel ran 6-11% faster at d=0.5 and the Triton forward 5-23%
# at d=0.1 (even at S32k). The density is not known on the host without reading the lists, so Sk decides.
MIN_KEYS = {64: 8192}
# Head dims whose walk keeps each row's exponent offset fixed after its first key tile: then the later tiles take no
# row maxima and no rescale of the accumulator (_walk_in_turn, _walk_overlapped; kernels/README.md, "Fixed offsets").
# They stay where a bound shows that no later score exceeds them by more than bounds.FIXED_HEADROOM (log2 units), or
# for the dtypes in RISE_CHECKED_DTYPES wherever every row of a warpgroup has a key in its first tile. D=64: 1.04-1.09x
# as fast at d=0.5 and 0.25, 1.00-1.03x at d=0.1 (BENCHMARKS.md, forty-third session). D=128 (forty-sixth session,
# `benchmarks/ws_forward.py --cases design --fixed-offsets`, B1 H24 S32k): 128x64 1.18x / 1.10x / 1.10x / 1.08x as
# fast at d=1 / 0.5 / 0.25 / 0.1, 128x128 1.09x / 1.04x at d=1 / 0.5 and 0.99x at 0.25 and 0.1. Never the causal walk
# with the overlap inside a warpgroup (D=128's): compiled by Triton 3.6, the H200 machine's, its consumers spill
# 24-32 bytes with fixed offsets (forty-fourth session, offline; Triton 3.9 spills nothing).
FIXED_OFFSET_DIMS: tuple = (64, 128)
# Dtypes whose fixed offsets need no bound, at the head dims in RISE_CHECKED_DIMS (RISE_CHECKED_CAUSAL_DIMS under
# is_causal): they stay wherever every row of a warpgroup has a key in its first tile, and the rise is checked after
# the walk (CHECK_RISE: a warpgroup whose rows' sums passed 2^bounds.RISE_LIMIT, or whose accumulator overflowed, is
# walked again with running maxima, _walk_again). So these take no pass over k for the key norms, and keep the
# offsets where real data's norms leave the bound too loose. bf16 only could: its P reaches 2^128, while fp16's
# overflows past 65504. Its GPU tests pass, the cold walk again included (tests/test_forward_ws.py, "bound 160"); its
# hot loops are the bounded walk's, instruction for instruction but for order (offline SASS, Triton 3.6).
RISE_CHECKED_DTYPES: tuple = (torch.bfloat16, )
# Head dims where the rise is checked (RISE_CHECKED_DTYPES) when not causal; the others keep the bound, and its pass
# over k (bounds.key_norm_parts: 42-53 us at D=64, B1 H24 S32k, 3% of a d=0.1 forward; H100, fifty-seventh session).
# In turns (`benchmarks/ws_forward_ab.py --setting rise-checked --cases design --rounds 5`, B1 H24 S32k bf16, H100,
# fifty-seventh session, with SPLIT_KEY_BLOCK_DIMS): D=64 checked 1.022x / 1.026x / 1.013x as fast at d=0.5 / 0.25 /
# 0.1 (128x128) and 1.019x / 1.006x / 1.022x (128x64); D=128 128x128 d=0.1 0.988x (1.04x in the fiftieth session, and
# 1.08-1.15x on the H200 where the bound fails, `ws_forward.py --query-scale 8`). Before the split (fiftieth and
# fifty-first sessions) D=64 ran 0.92-1.04x checked: ptxas orders the two builds' fixed loops differently
# (kernels/README.md, "Where the walk in turn waits for V"), so re-time after a change to the loop or to Triton.
RISE_CHECKED_DIMS: tuple = (64, 128)
# The same under is_causal. D=64's causal walk ran 0.96x as fast checked (the fifty-first and fifty-seventh sessions,
# H100), so it keeps the bound; D=128's (overlapped) keeps no fixed offsets at all (FIXED_OFFSET_DIMS).
RISE_CHECKED_CAUSAL_DIMS: tuple = ()
# Ring stages per head dim: as many as Hopper's 227 KiB of shared memory per program allows. At D=128 Q takes 32 KiB
# and a stage 64 KiB (3 stages measured 5.22 ms against 5.88 with 2). At D=64 a 256-key stage is 64 KiB too (2
# stages measured the same in benchmarks/exp_gluon_fwd.py; with 128-key tiles, 4 stages of 32 KiB had run 1-8%
# faster than 3).
STAGES = {128: 3, 64: 3}
# Registers per thread for a consumer warpgroup and for the loader (setmaxnreg; the default partition, the first
# consumer, gets what the 168-register launch bound leaves: 168 * 12 warps = 240 + 240 + 24 per warpgroup).
CONSUMER_REGS = 240
LOADER_REGS = 24
MAX_REGS = 168
# How both warp-specialized kernels launch and compile_sm90 compiles them: 4 warps in the default partition (the
# first consumer warpgroup; the others' warps are set in the kernel), MAX_REGS a thread. One config: nothing to tune.
LAUNCH_OPTIONS = dict(num_warps=4, maxnreg=MAX_REGS)
LAUNCH_CONFIG = triton.Config({}, **LAUNCH_OPTIONS)
# the same with four consumers (KEY_SPLIT_DIMS)
KEY_SPLIT_LAUNCH_OPTIONS = dict(num_warps=4, maxnreg=KEY_SPLIT_MAX_REGS)
# Whether they launch through launch plans (launch.run: later calls of a layout skip Triton's binder and build no
# descriptors). Measured on the H200 machine (benchmarks/host_cost.py, B8 H16, density 0.5): an eager forward +
# backward enqueues in 0.80 ms with plans against 1.22 ms without at S=2048, 0.84 against 1.19 at S=4096; the forward
# launcher 74 against 177 us. Off: Triton's full path each call (a debugging aid, and what host_cost.py compares).
LAUNCH_PLANS = True
# Head dims whose loop takes one exponential in four from a cubic polynomial on the FMA units instead of the special
# function unit (_exp2; kernels/README.md, "Exponentials off the special function unit"). None: at D=64, where the
# loop is bound by its exponentials, it measured 4-10% slower (the extra FMA-pipe instructions cost more than the
# special function unit's share they save).
EMULATED_EXP2_DIMS: tuple = ()
# Head dims whose kernel runs a persistent grid when not causal: one program an SM (or PERSISTENT_PROGRAMS, where
# set: the tests take a few, so that each program walks many items), each taking work items (query tiles of a head)
# in turn, instead of a program an item (kernels/README.md, "The persistent grid"). Measured on an H100 (fifty-first
# session, `benchmarks/ws_forward_ab.py --setting persistent --cases grid skewed`, B1 H24 S32k bf16, in turns), with
# the items in launch order: 1.09x / 1.04x as fast at D=64 d=0.1 (128x128 / 128x64), 1.02x / 1.01x at D=128 d=0.1,
# 1.05x / 1.02x at B8 H16 S2048 / 4096 d=0.5, 0.99-1.05x at d=1, 0.5 and 0.25; but 0.87x (D=128) and 0.84x (D=64)
# on target 6's skewed mask (a tenth of the query blocks keep everything), 20-28% slower than the uniform mask where
# a program a tile is within 2%, and 0.92x / 0.95x causal: a program's share of the items is fixed, and those that
# drew long lists ended late. Since then the programs take the items longest list first (query_tile_order), which
# benchmarks/persistent_sim.py models at +3.9% over the ideal on the skewed mask (launch order +39%, a program a
# tile +6.3%); never timed that way, and off: the claimed items below (+1.0% in the model), on where not causal,
# take precedence.
PERSISTENT_DIMS: tuple = ()
# Head dims whose kernel runs the persistent grid with each program claiming its next item from a counter (an atomic
# add by the loader) as it finishes the last, the items' order longest list first (query_tile_order): work goes to
# the programs that free up, as the hardware hands a program a tile to the first free SM (kernels/README.md, "The
# persistent grid"). Takes precedence over PERSISTENT_DIMS. Measured on an H100 (fifty-third session,
# `benchmarks/ws_forward_ab.py --setting claimed --cases grid skewed causal`, B1 H24 S32k bf16 unless said, against a
# program a tile): 1.07x / 1.06x as fast at D=64 d=0.1 (128x128 / 128x64), 1.02x at D=64 d=0.5, 1.01-1.03x at D=128
# d=1 and 0.1, 1.03x at B8 H16 S2048 / 4096 d=0.5, 1.06x / 1.04x on the skewed mask (D=128 / 64). With the order by
# powers of two (fifty-fourth session, H100, `--cases grid`): 1.10x / 1.05x at D=64 d=0.1, 1.05x at D=128 d=1,
# 1.00x / 1.04x at D=128 d=0.1 (128x128 / 128x64), 1.05x / 1.00x at B8 H16 S2048 / 4096.
CLAIMED_DIMS: tuple = (64, 128)
# The head dims whose is_causal launches claim too. Off: with the items' order a strict sort by list length, each
# causal tile position ran across every head at once, whose keys and values then missed L2, and the same run measured
# 0.65x at B8 H16 S4096 and 0.78-0.83x at D=64. With the order by powers of two since, which keeps a head's tiles
# together, the loss is gone but there is no gain (fifty-fourth session, H100, five rounds in turns: 1.01x / 0.98x at
# D=128 128x128 / 128x64, 0.97x / 0.99x at D=64, 0.955x at B8 H16 S4096).
CLAIMED_CAUSAL_DIMS: tuple = ()
# Head dims whose persistent launches (PERSISTENT_DIMS, CLAIMED_DIMS) hold two Q buffers instead of one, so that the
# loader brings the next item's Q, and then its first key tiles, while the consumers still walk this item, and the
# two consumers need not meet at each item's start (the loader waits for both releases of a buffer, an item later).
# Only D=64 has the shared memory: 16 KiB more on its 208 KiB; D=128's Q and three stages fill the 227 KiB. Never with
# the key split (KEY_SPLIT_DIMS), whose merge buffers hold one item's rows. Measured in turns (sixty-third session,
# `benchmarks/ws_forward_ab.py --setting q-buffers --cases d64`, B1 H24 S32k bf16, H100, claimed items): 1.06x /
# 1.08x as fast at 128x128 d=0.1 and 1.03x / 1.04x at 128x64 d=0.1 (two runs), 0.98-1.02x at d=0.5 and 0.25; with
# CLAIMED_CAUSAL_DIMS on too, 1.04x / 1.03x causal (128x128 / 128x64). Right since the sixty-fifth session: before,
# with the rise checked (RISE_CHECKED_DIMS) and 256-key TMA boxes, ptxas 12.8 (Triton 3.6) kept the first consumer's
# Q descriptors from the preheader of a loop the item never ran, until its first tile was taken alone
# (kernels/README.md, "Two Q buffers"). Off: timed again in turns with that (sixty-fifth session, H100, two runs)
# 1.03x / 1.06x as fast at 128x128 d=0.1 and 1.04x / 1.02x at 128x64, but 0.96x at 128x128 d=0.5 and 0.97x at
# 128x64, 0.97-1.00x at d=0.25: the two-buffer build runs 2-9% slower even at one buffer's timing (cause not found,
# kernels/README.md), and the launcher has no list length to choose by without waiting for the GPU.
Q_BUFFER_DIMS: tuple = ()
# Head dims whose walk in turn with fixed offsets takes its rows' sums of P from the tensor cores instead of adding
# them up: each tile's P times a [TILE_N, 8] tile of ones in shared memory, accumulated across the walk in a [64, 8]
# wgmma accumulator (every column a row's sum of P as rounded for P V), in place of 128 FADDs a thread a 256-key
# tile, for 1/16 more tensor work than P V; a consumer's loop 440 instructions a tile instead of 535 (sm_90 SASS,
# Triton 3.6; kernels/README.md, "Row sums on the tensor cores"). Never with two Q buffers (Q_BUFFER_DIMS), whose
# 16 KiB the tiles of ones leave no room for. Measured in turns (H100, sixty-eighth session, `benchmarks/
# ws_forward_ab.py --setting mma-sums --cases d64 --rounds 5`, B1 H24 S32k D=64 bf16): 1.057x / 1.070x as fast under
# is_causal (128x128 / 128x64; 1.060x in a three-round run before), but 0.982x / 1.001x / 1.008x at d=0.5 / 0.25 /
# 0.1 with 128x128 blocks and 0.984x / 1.006x / 1.014x with 128x64 where not causal: so under is_causal only.
MMA_ROW_SUM_DIMS: tuple = ()
# The same under is_causal.
MMA_ROW_SUM_CAUSAL_DIMS: tuple = (64, )
# Head dims whose persistent launches (PERSISTENT_DIMS, CLAIMED_DIMS) have each consumer give its half of Q back to
# the loader as soon as its walk's last Q K^T is done, before that tile's softmax and P V and the rows' store, rather
# than after them: the loader waits for both halves before it loads the next item's Q and then its first key tiles,
# which so arrive under this item's end instead of after it. Q is not read again: the cold walk again
# (_walk_again) loads its rows by pointer. Never with out through Q's buffer (O_THROUGH_TMA), the key split, or under
# is_causal (_releases_q_early). Off: written in the sixty-ninth session, when no GPU came, so neither its GPU tests
# (tests/test_forward_ws.py -k q_given_back_early) nor its timing (`benchmarks/ws_forward_ab.py --setting
# early-release --cases items`) have run; kernels/README.md, "Q given back early".
EARLY_Q_RELEASE_DIMS: tuple = ()
PERSISTENT_PROGRAMS: Optional[int] = None

_ROWS = gl.constexpr(CONSUMER_ROWS)
# 2^x for four fp32 values held by one thread: three by ex2.approx.ftz (what gl.exp2 emits), the fourth as
# p(f) * 2^floor(x) with f = x - floor(x) and p the cubic of kernels/README.md (relative error 8.6e-5). Only full-rate
# FP32 and integer instructions: floor(x) comes from adding 1.5 * 2^23 rounded toward -inf (so the sum's low bits hold
# it), not from FRND / F2I, which issue at the special function unit's quarter rate; shifting the sum's bits left by
# 23 leaves floor(x) << 23 to add to p's exponent. x below -126 (and -inf) gives exactly 0, as ex2 does for -inf.
# Operands are 32-bit registers ($0-$3 out, $4-$7 in).
_EXP2_ASM = gl.constexpr("""{
.reg .b32 x, j, fl, f, p;
.reg .pred tiny;
ex2.approx.ftz.f32 $0, $4;
ex2.approx.ftz.f32 $1, $5;
ex2.approx.ftz.f32 $2, $6;
max.ftz.f32 x, $7, 0fC2FE0000;
add.rm.ftz.f32 j, x, 0f4B400000;
sub.ftz.f32 fl, j, 0f4B400000;
sub.ftz.f32 f, x, fl;
fma.rn.ftz.f32 p, f, 0f3D9DD4CA, 0f3E691C10;
fma.rn.ftz.f32 p, p, f, 0f3F31F328;
fma.rn.ftz.f32 p, p, f, 0f3F800000;
shl.b32 j, j, 23;
add.s32 p, p, j;
setp.lt.ftz.f32 tiny, $7, 0fC2FC0000;
selp.b32 $3, 0, p, tiny;
}""")

_LOG2E = gl.constexpr(1.4426950408889634)
_HEADROOM_BF16 = gl.constexpr(BF16_HEADROOM)
_HEADROOM_FP16 = gl.constexpr(FP16_HEADROOM)
_PARTS = gl.constexpr(KEY_NORM_PARTS)
_SUM_LIMIT = gl.constexpr(2.0 ** RISE_LIMIT)
# Keys a step of _walk_again, the cold walk with running maxima (K^T and V tiles in registers): at 16 neither Triton
# spills in a loop (kernels/README.md, "Fixed offsets"); 64 spilled 120-136 bytes.
_AGAIN_KEYS = gl.constexpr(16)
_STEP_N = gl.constexpr(KEY_SPLIT_STEP_N)


@gluon.jit
def _program(lists, item, BLOCK_Q: gl.constexpr, CAUSAL: gl.constexpr):
    """(off_b, off_h, off_hkv, start_m, index_row, count) of work item `item` (a query tile of one head; _grid_item):
    its place, with the head order of primitives.query_tile_program (consecutive (batch, head) pairs take different
    kv heads), and its kv list (the pointer to its first entry, and its count of key blocks). lists: the kernel's
    lists and counts, as attention_fwd_ws_kernel packs them. CAUSAL: the last query tiles, whose lists are the
    longest, come first, so that the short ones fill the grid's tail."""
    (KV_COUNT, KV_INDEX, heads, group_size, q_tiles, items, ITEM_ORDER, ITEM_COUNTER, stride_cb, stride_ch, stride_ib,
     stride_ih, stride_iq) = lists
    pid_bh = item // q_tiles
    off_b = pid_bh // heads
    kv_heads = heads // group_size
    slot = pid_bh % heads
    off_h = (slot % kv_heads) * group_size + slot // kv_heads
    pid_m = item % q_tiles
    if CAUSAL:
        pid_m = q_tiles - 1 - pid_m
    start_m = pid_m * (2 * _ROWS)
    q_block = start_m // BLOCK_Q
    count = gl.load(KV_COUNT + off_b * stride_cb + off_h * stride_ch + q_block)
    index_row = KV_INDEX + off_b.to(gl.int64) * stride_ib + off_h.to(gl.int64) * stride_ih + q_block * stride_iq
    return off_b, off_h, off_h // group_size, start_m, index_row, count


@gluon.jit
def _turns(lists):
    """How many work items this program of the persistent grid takes: those at positions program_id(0) + turn *
    num_programs(0) below the items' count. (lists: as _program's.)"""
    items = lists[5]
    first = gl.program_id(0)
    step = gl.num_programs(0)
    return (items - first + step - 1) // step


@gluon.jit
def _turn_item(lists, turn):
    """The persistent grid's work item for this program's turn: ITEM_ORDER's entry at position program_id(0) + turn *
    num_programs(0) (query_tile_order: the longest kv lists first), so that each program's turns go from long items
    to short ones and the programs end together. (lists: as _program's.)"""
    return gl.load(lists[6] + gl.program_id(0) + turn * gl.num_programs(0))


@gluon.jit
def _claim(lists):
    """The next position of ITEM_ORDER for this program under CLAIMED, from the launch's counter (ITEM_COUNTER int32
    [1], zero at launch; positions past the items' count mean none is left): one atomic add by the loader warp's
    first lane, its old value passed to the other lanes by a warp reduction (redux.sync), in registers (Triton 3.6
    lowers a scalar atomic's result through a scratch word of shared memory and a warp barrier)."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, lane_layout)
    old = gl.atomic_add(lists[7] + lane * 0, gl.full([32], 1, gl.int32, lane_layout), mask=lane == 0, sem="relaxed")
    return gl.max(gl.where(lane == 0, old, -1), 0)


@gluon.jit
def _q_buffer(ring, turn):
    """(buffer, phase): which of the kernel's Q buffers (Q_BUFFER_DIMS: one or two, each both halves of a query
    tile, q_smem [2 * buffers, 1, 1, 64, D]) holds the program's turn-th item's Q, its barriers q_ready and q_empty
    and its post (item_smem), and the phase of those barriers for that turn. (ring: as the kernel packs it.)"""
    BUFFERS: gl.constexpr = ring[0].shape[0] // 2
    return turn % BUFFERS, (turn // BUFFERS) & 1


@gluon.jit
def _post_item(item_smem, item):
    """The loader warp hands its consumers the item it loads next (or -1: none left) through shared memory; the
    q_ready arrival after it publishes it, and q_empty's wait before it keeps it from overwriting one they still
    read."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    item_smem.store(gl.full([1], item, gl.int32, layout))


@gluon.jit
def _posted_item(item_smem):
    """A consumer warpgroup's read of the item _post_item posted (once q_ready's phase for it has completed)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(item_smem.load(layout), 0)


@gluon.jit
def _grid_item():
    """The work item of this program when each program takes one (PERSISTENT off): its query tile along grid axis
    0 (cdiv(Sq, 128) programs), its (batch, head) pair along axes 1 and 2 (launch.batch_head_axes)."""
    return gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.program_id(2) * gl.num_programs(1))


@gluon.jit
def _first_tested_tile(index_row, count, start_m, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
                       TILE_N: gl.constexpr):
    """The first key tile of the walk that needs the causal test: the one holding the list's first block that
    reaches past the program's first query row (key block start_m // BLOCK_KV or later). Earlier blocks lie wholly
    below the diagonal, and the list is ascending, so the scan goes back from its end over the few crossing ones."""
    crossing = start_m // BLOCK_KV
    entry = count
    scanning = count > 0
    while scanning:
        later = gl.load(index_row + gl.maximum(entry - 1, 0)) >= crossing
        entry = entry - later.to(gl.int32)
        scanning = later & (entry > 0)
    return entry * (BLOCK_KV // SUB_N) // (TILE_N // SUB_N)


@gluon.jit
def _scores_masked(qk, j, tiles, sub_tiles, first_tested, index_row, rows, BLOCK_KV: gl.constexpr,
                   SUB_N: gl.constexpr, CAUSAL: gl.constexpr, MAYBE_LAST: gl.constexpr = True,
                   TILE_N: gl.constexpr = 0, COL0: gl.constexpr = 0):
    """Key tile j's scores qk fp32 [64, TILE_N] with -inf where no key is: the repeated sub tiles that fill out the
    last tile when the sub tiles do not fill it (MAYBE_LAST: only where j may be that tile), and under CAUSAL (from
    first_tested on) the keys past each query row (rows int32 [64]). TILE_N 0: qk's columns; else qk holds the
    tile's columns COL0 .. COL0 + qk.shape[1] - 1 (a step of KEY_SPLIT_DIMS's walk)."""
    KEYS: gl.constexpr = qk.shape[1] if TILE_N == 0 else TILE_N  # the tile's
    cols = gl.arange(0, qk.shape[1], gl.SliceLayout(0, qk.type.layout))
    if COL0 != 0:
        cols = cols + COL0
    filled = sub_tiles % (KEYS // SUB_N)  # sub tiles of the last tile that hold keys of their own (0: all)
    if MAYBE_LAST:
        if filled != 0 and j == tiles - 1:
            qk = gl.where(cols[None, :] >= filled * SUB_N, float("-inf"), qk)
    if CAUSAL:
        if j >= first_tested:
            # each column's key, from its sub tile's list entry (as the loader placed it)
            SUBS_PER_BLOCK: gl.constexpr = BLOCK_KV // SUB_N
            sub = gl.minimum((KEYS // SUB_N) * j + cols // SUB_N, sub_tiles - 1)
            keys = (gl.load(index_row + sub // SUBS_PER_BLOCK) * BLOCK_KV + (sub % SUBS_PER_BLOCK) * SUB_N
                    + cols % SUB_N)
            qk = gl.where(keys[None, :] <= rows[:, None], qk, float("-inf"))
    return qk


@gluon.jit
def _exp_offset(m, CAUSAL: gl.constexpr):
    """The running max m as the exponentials' offset: under CAUSAL a row may have seen no key yet (m = -inf), and
    0 then keeps exp2(-inf - offset) at 0 instead of NaN."""
    if CAUSAL:
        m = gl.where(m == float("-inf"), 0.0, m)
    return m


@gluon.jit
def _online_softmax(qk, m_i, l_i, scale_log2, CAUSAL: gl.constexpr, EMULATE_EXP2: gl.constexpr,
                    FIXED: gl.constexpr, MMA_SUMS: gl.constexpr = False):
    """One key tile's step of the online softmax: (p, alpha, m_new, l_new) for scores qk fp32 [64, TILE_N], the
    running max m_i and sum l_i [64] (log2 units): p = 2^(scaled scores - m_new), alpha = 2^(m_i - m_new), which
    rescales what came before (0 on a row's first tile, m_i = -inf), and l_new = l_i * alpha + the row sums of p.
    FIXED (FIXED_OFFSET_DIMS): the offsets stay, m_new = m_i, and alpha is 1 and not computed (returned as m_i):
    the caller skips the rescale. MMA_SUMS (with FIXED): the caller takes the row sums from the tensor cores, and
    l_i comes back as it went in."""
    if FIXED:
        p = _exp2(qk * scale_log2 - m_i[:, None], EMULATE_EXP2)
        alpha = m_i
        m_new = m_i
        if MMA_SUMS:
            l_new = l_i
        else:
            l_new = l_i + gl.sum(p, 1)
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * scale_log2)
        offset = _exp_offset(m_new, CAUSAL)
        p = _exp2(qk * scale_log2 - offset[:, None], EMULATE_EXP2)
        alpha = gl.exp2(m_i - offset)
        l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _sub_tile(ring, stage, part, SUB_N: gl.constexpr):
    """Rows part*SUB_N .. of stage `stage` of a ring [STAGES, 128, D], as the [1, 1, SUB_N, D] box a TMA fills."""
    tile = ring.index(stage)
    return tile.reshape([1, 1, tile.shape[0], tile.shape[1]]).slice(part * SUB_N, SUB_N, dim=2)


@gluon.jit
def _exp2(x, EMULATE: gl.constexpr):
    """2^x elementwise (fp32, x <= 0 or -inf); EMULATE: one element in four of each thread's by _EXP2_ASM's
    polynomial, taking that share off the special function unit."""
    if EMULATE:
        return gl.inline_asm_elementwise(_EXP2_ASM, "=r,=r,=r,=r,r,r,r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=4)
    else:
        return gl.exp2(x)


@gluon.jit
def _part_tiles(tiles, KEY_SPLIT: gl.constexpr, PART: gl.constexpr):
    """How many of a walk's first `tiles` key tiles are part PART's (PART, PART + KEY_SPLIT, ...: KEY_SPLIT_DIMS,
    KEY_SPLIT_CAUSAL_DIMS); all of them without a split."""
    if KEY_SPLIT > 1:
        tiles = (tiles - PART + KEY_SPLIT - 1) // KEY_SPLIT
    return tiles


@gluon.jit
def _walk_in_turn(walk, start, end, acc, m_i, l_i, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, EMULATE_EXP2: gl.constexpr, FIXED: gl.constexpr,
                  KEY_SPLIT: gl.constexpr = 1, PART: gl.constexpr = 0, MMA_SUMS: gl.constexpr = False,
                  RELEASE_Q: gl.constexpr = False):
    """Key tiles start .. end-1 of a consumer's walk, each one's products and softmax in turn: (acc, m_i, l_i) after
    them, from the accumulator fp32 [64, D] and the rows' offsets and sums [64] before. walk: the consumer's Q tile,
    rings, barriers, zeroed scores and list (as _consumer_item packs them). FIXED: the offsets m_i stay (finite, and no
    score above m_i + headroom: FIXED_OFFSET_DIMS), so a tile takes no row maxima and the accumulator no rescale.
    Under CAUSAL the tiles before the first tested one (first_tested) run in a loop of their own, without the causal
    test (kernels/README.md, "The causal walk split"). KEY_SPLIT (KEY_SPLIT_DIMS, KEY_SPLIT_CAUSAL_DIMS): start and
    end count the part's own tiles, the walk's PART, PART + KEY_SPLIT, ... MMA_SUMS (with FIXED, without KEY_SPLIT;
    MMA_ROW_SUM_DIMS, MMA_ROW_SUM_CAUSAL_DIMS): the rows' sums from the tensor cores, in a [64, 8] accumulator (each
    column the sums) that starts from l_i and is carried through the walk in l_i's place. RELEASE_Q: Q's buffer goes
    back to the loader after the walk's last Q K^T (_tile_in_turn)."""
    row_layout: gl.constexpr = l_i.type.layout
    if MMA_SUMS:
        sums_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, 8, 16])
        l_i = gl.zeros([_ROWS, 8], gl.float32, sums_layout) + gl.convert_layout(
            l_i, gl.SliceLayout(1, sums_layout))[:, None]
    (q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, total, sub_tiles, first_tested, index_row, rows_s,
     scale_log2, base, ones, q_release) = walk
    if CAUSAL:
        middle = gl.minimum(gl.maximum(_part_tiles(first_tested, KEY_SPLIT, PART), start), end)
        acc, m_i, l_i = _tiles_in_turn(walk, start, middle, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                       EMULATE_EXP2, FIXED, False, KEY_SPLIT, PART, MMA_SUMS, RELEASE_Q)
        acc, m_i, l_i = _tiles_in_turn(walk, middle, end, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                       EMULATE_EXP2, FIXED, True, KEY_SPLIT, PART, MMA_SUMS, RELEASE_Q)
    else:
        acc, m_i, l_i = _tiles_in_turn(walk, start, end, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                       EMULATE_EXP2, FIXED, True, KEY_SPLIT, PART, MMA_SUMS, RELEASE_Q)
    if MMA_SUMS:
        l_i = gl.convert_layout(gl.max(l_i, 1), row_layout)
    return acc, m_i, l_i


@gluon.jit
def _tiles_in_turn(walk, start, end, acc, m_i, l_i, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, EMULATE_EXP2: gl.constexpr, FIXED: gl.constexpr,
                   TESTED: gl.constexpr, KEY_SPLIT: gl.constexpr = 1, PART: gl.constexpr = 0,
                   SUMS: gl.constexpr = False, RELEASE_Q: gl.constexpr = False):
    """_walk_in_turn's tiles start .. end-1: all but the last in one loop, the last after it, so that the loop's
    tiles skip the test for the walk's last tile (kernels/README.md, "The last tile peeled off the loop"). TESTED:
    under CAUSAL, the tiles take the causal test (from first_tested on); else none of them needs it. KEY_SPLIT,
    PART, RELEASE_Q: as _walk_in_turn's; SUMS: l_i is the accumulator of the sums (_walk_in_turn's MMA_SUMS)."""
    for j in range(start, end - 1):  # none of these is the walk's last tile (total - 1)
        acc, m_i, l_i = _tile_in_turn(walk, j, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL, EMULATE_EXP2, FIXED,
                                      False, TESTED, KEY_SPLIT, PART, SUMS)
    if end > start:
        acc, m_i, l_i = _tile_in_turn(walk, end - 1, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL, EMULATE_EXP2,
                                      FIXED, True, TESTED, KEY_SPLIT, PART, SUMS, RELEASE_Q)
    return acc, m_i, l_i


@gluon.jit
def _tile_in_turn(walk, j, acc, m_i, l_i, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, EMULATE_EXP2: gl.constexpr, FIXED: gl.constexpr, MAYBE_LAST: gl.constexpr,
                  TESTED: gl.constexpr, KEY_SPLIT: gl.constexpr = 1, PART: gl.constexpr = 0,
                  SUMS: gl.constexpr = False, RELEASE_Q: gl.constexpr = False):
    """Key tile j of a consumer's walk in turn (_walk_in_turn's, whose arguments these are): its products and
    softmax, (acc, m_i, l_i) after it. MAYBE_LAST: j may be the walk's last tile, whose sub tiles past its own
    keys are masked when the sub tiles do not fill it (_scores_masked); else that test is left out. TESTED: as
    _tiles_in_turn's. KEY_SPLIT: j is the part's own j-th tile, the walk's j * KEY_SPLIT + PART. A tile whose keys
    outnumber the scores' columns (s_zero's: under KEY_SPLIT, _STEP_N) goes in steps of that many keys, each step's
    products and softmax in turn, one V wait before the first and one release after the last. SUMS (FIXED, tiles of
    one step): l_i is the sums' [64, 8] accumulator, to which the tile's P times the stage's tile of ones adds.
    RELEASE_Q (MAYBE_LAST, tiles of one step; EARLY_Q_RELEASE_DIMS): if j is the walk's last tile, Q's buffer goes back
    to the loader (q_release) once its Q K^T is done."""
    (q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, total, sub_tiles, first_tested, index_row, rows_s,
     scale_log2, base, ones, q_release) = walk
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    s_layout: gl.constexpr = s_zero.type.layout
    TILE_N: gl.constexpr = k_smem.shape[1]
    STEP_N: gl.constexpr = s_zero.shape[1]
    if KEY_SPLIT > 1:
        j = j * KEY_SPLIT + PART
    stage = (base + j) % STAGES
    phase = ((base + j) // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    # (each build indexes the stage where it did when its SASS was checked: ptxas orders D=64's loop by such things)
    if TILE_N != STEP_N:
        k_tile = k_smem.index(stage)
        v_tile = v_smem.index(stage)
    for step in gl.static_range(TILE_N // STEP_N):
        if TILE_N == STEP_N:
            zeros = s_zero
            k_step = k_smem.index(stage)
        else:
            # the zeros made each step rather than held through the walk: 64 registers at 128 keys, which four
            # consumers lack
            zeros = gl.zeros([_ROWS, STEP_N], gl.float32, s_layout)
            k_step = k_tile.slice(step * STEP_N, STEP_N)
        qk = warpgroup_mma(q, k_step.permute((1, 0)), zeros, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        if RELEASE_Q and MAYBE_LAST:
            gl.static_assert(TILE_N == STEP_N, "Q goes back after a tile's one Q K^T")
            mbarrier.arrive(q_release, count=1, pred=j == total - 1)
        qk = _scores_masked(qk, j, total, sub_tiles, first_tested, index_row, rows_s, BLOCK_KV, SUB_N,
                            CAUSAL and TESTED, MAYBE_LAST, TILE_N, step * STEP_N)
        p, alpha, m_new, l_i = _online_softmax(qk, m_i, l_i, scale_log2, CAUSAL, EMULATE_EXP2, FIXED, SUMS)
        if not FIXED:
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            m_i = m_new
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        # (waiting for V while Q K^T runs instead measured 3-10% slower at D=64: kernels/README.md)
        if step == 0:
            mbarrier.wait(v_ready.index(stage), phase)
        if TILE_N == STEP_N:
            v_step = v_smem.index(stage)
        else:
            v_step = v_tile.slice(step * STEP_N, STEP_N)
        acc = warpgroup_mma(p_op, v_step, acc, is_async=True)
        if SUMS:
            l_i = warpgroup_mma(p_op, ones.index(stage).permute((1, 0)), l_i, is_async=True)
            acc, l_i, p_op = warpgroup_mma_wait(0, deps=(acc, l_i, p_op))
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_empty.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def _walk_overlapped(walk, acc, m_i, l_i, p_prev, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, EMULATE_EXP2: gl.constexpr, FIXED: gl.constexpr):
    """Key tiles 1 .. total-1 of a consumer's walk with the overlap inside the warpgroup: each tile's Q K^T issued
    with the previous tile's P V, whose P (p_prev, the dot operand) comes in from tile 0 and goes out for the last
    tile's P V. (acc, m_i, l_i, p_prev) after them; FIXED and the causal split: as _walk_in_turn's."""
    (q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, total, sub_tiles, first_tested, index_row, rows_s,
     scale_log2, base, ones, q_release) = walk
    if CAUSAL:
        middle = gl.minimum(gl.maximum(first_tested, 1), total)
        acc, m_i, l_i, p_prev = _tiles_overlapped(walk, 1, middle, acc, m_i, l_i, p_prev, BLOCK_KV, SUB_N, STAGES,
                                                  CAUSAL, EMULATE_EXP2, FIXED, False)
        acc, m_i, l_i, p_prev = _tiles_overlapped(walk, middle, total, acc, m_i, l_i, p_prev, BLOCK_KV, SUB_N,
                                                  STAGES, CAUSAL, EMULATE_EXP2, FIXED, True)
    else:
        acc, m_i, l_i, p_prev = _tiles_overlapped(walk, 1, total, acc, m_i, l_i, p_prev, BLOCK_KV, SUB_N, STAGES,
                                                  CAUSAL, EMULATE_EXP2, FIXED, True)
    return acc, m_i, l_i, p_prev


@gluon.jit
def _tiles_overlapped(walk, start, end, acc, m_i, l_i, p_prev, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, EMULATE_EXP2: gl.constexpr, FIXED: gl.constexpr,
                      TESTED: gl.constexpr):
    """_walk_overlapped's tiles start .. end-1 (start >= 1), in one loop. TESTED: as _tiles_in_turn's."""
    (q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, total, sub_tiles, first_tested, index_row, rows_s,
     scale_log2, base, ones, q_release) = walk
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    for j in range(start, end):
        stage = (base + j) % STAGES
        prev = (base + j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), ((base + j) // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((base + j - 1) // STAGES) & 1)
        qk = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
        qk = warpgroup_mma_wait(1, deps=(qk, ))  # this tile's scores; the previous tile's P V may still run
        qk = _scores_masked(qk, j, total, sub_tiles, first_tested, index_row, rows_s, BLOCK_KV, SUB_N,
                            CAUSAL and TESTED)
        p, alpha, m_new, l_i = _online_softmax(qk, m_i, l_i, scale_log2, CAUSAL, EMULATE_EXP2, FIXED)
        p_next = gl.convert_layout(p.to(q.dtype), p_prev.type.layout)
        # p_prev rides through the wait so its registers stay untouched until the product reading them is done
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        if not FIXED:
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            m_i = m_new
        p_prev = p_next
    return acc, m_i, l_i, p_prev


@gluon.jit
def _score_bounds(q, key_norms, scale_log2, layout: gl.constexpr, row_layout: gl.constexpr):
    """Each row's bound on its scaled scores (log2 units; FIXED_OFFSET_DIMS), fp32 [64] in row_layout: scale_log2
    times the row's norm in the Q tile q (shared memory, [64, D], read in layout) times the kv head's largest key
    norm, the maximum of its KEY_NORM_PARTS parts (key_norms: a pointer to them)."""
    parts = gl.arange(0, _PARTS, gl.BlockedLayout([1], [32], [4], [0]))
    key_norm = gl.max(gl.load(key_norms + parts), 0)
    rows = q.load(layout).to(gl.float32)
    return scale_log2 * gl.convert_layout(gl.sqrt(gl.sum(rows * rows, 1)), row_layout) * key_norm


@gluon.jit
def _keeps_offsets(bound, m_i, dtype: gl.constexpr):
    """Whether a warpgroup's rows keep their offsets m_i [64] for the rest of the walk (FIXED_OFFSET_DIMS): no row's
    bound [64] exceeds its offset by more than FIXED_HEADROOM[dtype] (a row with no key yet has m_i = -inf and fails
    it, as NaN does). A scalar: the decision covers the warpgroup, whose products are shared."""
    headroom: gl.constexpr = _HEADROOM_FP16 if dtype == gl.float16 else _HEADROOM_BF16
    return gl.max(bound - m_i, 0) <= headroom


@gluon.jit
def _consumer(shared, HALF: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
              TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
              EMULATE_EXP2: gl.constexpr, O_THROUGH_TMA: gl.constexpr, FIXED_OFFSETS: gl.constexpr,
              CHECK_RISE: gl.constexpr, PERSISTENT: gl.constexpr, CLAIMED: gl.constexpr, KEY_SPLIT: gl.constexpr,
              PART: gl.constexpr, MMA_SUMS: gl.constexpr = False, RELEASE_Q: gl.constexpr = False):
    """A consumer warpgroup: query rows HALF*64 .. HALF*64+63 of its program's work items (_consumer_item), one
    (_grid_item), or under PERSISTENT its turns' items (_turns, _turn_item), or under CLAIMED those its loader
    claims and posts (_posted_item), the ring's stages and the barriers' phases going on from one item to the next.
    (Parameters as _consumer_item's.)"""
    if CLAIMED:
        ring = shared[1]
        base = gl.program_id(0) * 0  # (as below)
        turn = base
        mbarrier.wait(ring[3].index(0), 0)  # q_ready: the loader's first item posted (or -1)
        item = _posted_item(ring[8].index(0))
        while item >= 0:
            base = _consumer_item(shared, item, turn, base, HALF, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL,
                                  OVERLAP, EMULATE_EXP2, O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, KEY_SPLIT, PART,
                                  MMA_SUMS, RELEASE_Q)
            turn += 1
            buffer, phase = _q_buffer(ring, turn)
            mbarrier.wait(ring[3].index(buffer), phase)
            item = _posted_item(ring[8].index(buffer))
    elif PERSISTENT:
        lists = shared[2]
        base = gl.program_id(0) * 0  # ring position of the item's first key tile (the items' before it), int32
        for turn in range(_turns(lists)):
            base = _consumer_item(shared, _turn_item(lists, turn), turn, base, HALF, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N,
                                  STAGES, CAUSAL, OVERLAP, EMULATE_EXP2, O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE,
                                  KEY_SPLIT, PART, MMA_SUMS, RELEASE_Q)
    else:
        _consumer_item(shared, _grid_item(), 0, 0, HALF, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP,
                       EMULATE_EXP2, O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, KEY_SPLIT, PART, MMA_SUMS, RELEASE_Q)


@gluon.jit
def _consumer_item(shared, item, turn, base, HALF: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr,
                   SUB_N: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   OVERLAP: gl.constexpr, EMULATE_EXP2: gl.constexpr, O_THROUGH_TMA: gl.constexpr,
                   FIXED_OFFSETS: gl.constexpr, CHECK_RISE: gl.constexpr, KEY_SPLIT: gl.constexpr = 1,
                   PART: gl.constexpr = 0, MMA_SUMS: gl.constexpr = False, RELEASE_Q: gl.constexpr = False):
    """Query rows HALF*64 .. HALF*64+63 of work item `item` (its turn-th in the program; _program): the online
    softmax over the kv list (CAUSAL: keys up to each row's own position only), then Out [B, H, Sq, D] and Lse
    fp32 [B, H, Sq] (natural log; -inf and zeros for a row with no key). Returns the ring position after its key
    tiles, from base before them. shared: the kernel's arguments and buffers, grouped as attention_fwd_ws_kernel
    packs them. OVERLAP: each key tile's Q K^T issued with the previous tile's P V (see OVERLAPPED). FIXED_OFFSETS:
    see FIXED_OFFSET_DIMS; CHECK_RISE: see RISE_CHECKED_DTYPES. KEY_SPLIT 2 (KEY_SPLIT_DIMS, KEY_SPLIT_CAUSAL_DIMS;
    not OVERLAP): the rows' walk covers the key tiles PART, PART + 2, ... only, and the PART 1 consumer hands its
    offsets, sums and accumulator to the PART 0 one (_hand_over), which merges them with its own (_merged) and stores
    the rows. RELEASE_Q (EARLY_Q_RELEASE_DIMS; not with KEY_SPLIT or O_THROUGH_TMA): the consumer's half of Q goes
    back to the loader once the walk's last Q K^T is done, or at the end where the walk has no tile."""
    descs, ring, lists, outputs, norms, qkv, scale_log2, merge, ones = shared
    Q_DESC = descs[0]
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, item_smem = ring
    KEY_NORMS, stride_nb, stride_nh = norms
    off_b, off_h, off_hkv, start_m, index_row, count = _program(lists, item, BLOCK_Q, CAUSAL)
    PARTS: gl.constexpr = TILE_N // SUB_N
    sub_tiles = count * (BLOCK_KV // SUB_N)
    # key tiles of TILE_N keys, PARTS sub tiles each; the last holds fewer when PARTS does not divide sub_tiles
    total = (sub_tiles + PARTS - 1) // PARTS
    first_tested = total
    if CAUSAL:
        first_tested = _first_tested_tile(index_row, count, start_m, BLOCK_KV, SUB_N, TILE_N)
    dtype: gl.constexpr = Q_DESC.dtype
    HEAD_DIM: gl.constexpr = Q_DESC.block_type.shape[3]

    gl.static_assert(KEY_SPLIT == 1 or not OVERLAP, "a split walk is not overlapped")
    gl.static_assert(not RELEASE_Q or (KEY_SPLIT == 1 and not O_THROUGH_TMA), "Q goes back early from one pair")
    SCORE_N: gl.constexpr = _STEP_N if KEY_SPLIT > 1 else TILE_N  # score columns a product (_tile_in_turn)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, SCORE_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    m_i = gl.full([_ROWS], float("-inf"), gl.float32, row_s)  # running max of scaled scores, log2 units
    l_i = gl.zeros([_ROWS], gl.float32, row_s)
    acc = gl.zeros([_ROWS, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([_ROWS, SCORE_N], gl.float32, s_layout)
    # the tiles this consumer walks: all, or under KEY_SPLIT its part's (PART, PART + KEY_SPLIT, ...)
    mine = _part_tiles(total, KEY_SPLIT, PART)
    first_row = start_m + HALF * _ROWS
    rows_s = first_row + gl.arange(0, _ROWS, row_s)
    buffer, phase = _q_buffer(ring, turn)
    q_slot = 2 * buffer + HALF
    q_box = q_smem.index(q_slot)
    q = q_box.reshape([_ROWS, HEAD_DIM])
    q_empty = q_empty.index(buffer)
    mbarrier.wait(q_ready.index(buffer), phase)
    walk = (q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, total, sub_tiles, first_tested, index_row, rows_s,
            scale_log2, base, ones, q_empty)
    # CHECK_RISE (RISE_CHECKED_DTYPES): the offsets stay wherever every row has a key in the first tile, and the
    # walk's rise is checked after it; else only where the rows' bounds hold the rise
    CHECKED: gl.constexpr = FIXED_OFFSETS and CHECK_RISE
    again = total < 0  # whether the rows' walk rose too far and must be done again (CHECKED), a runtime False here
    if not OVERLAP:
        # products, then softmax, tile by tile (the other consumer's turns fill the gaps)
        if FIXED_OFFSETS:
            if not CHECKED:  # the rows' bounds before the first tile, whose work hides their loads
                bound = _score_bounds(q, KEY_NORMS + off_b * stride_nb + off_hkv * stride_nh, scale_log2, o_layout,
                                      row_s)
            # the first tile alone, not a walk of one (whose empty loop's preheader ptxas 12.8 once kept Q's
            # descriptors in: kernels/README.md, "Two Q buffers"); tested under CAUSAL where it crosses the diagonal
            if mine > 0:
                acc, m_i, l_i = _tile_in_turn(walk, 0, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL, EMULATE_EXP2,
                                              False, True, True, KEY_SPLIT, PART, False, RELEASE_Q)
            # after the first tile, the offsets it leaves
            keep = _all_seen(m_i) if CHECKED else _keeps_offsets(bound, m_i, dtype)
            if keep:
                acc, m_i, l_i = _walk_in_turn(walk, 1, mine, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                              EMULATE_EXP2, True, KEY_SPLIT, PART, MMA_SUMS, RELEASE_Q)
            else:
                acc, m_i, l_i = _walk_in_turn(walk, 1, mine, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                              EMULATE_EXP2, False, KEY_SPLIT, PART, False, RELEASE_Q)
            if CHECKED:  # (whichever walk ran: the running maxima's stay in range on finite inputs)
                again = ~_sums_within(l_i, acc)
        else:
            acc, m_i, l_i = _walk_in_turn(walk, 0, mine, acc, m_i, l_i, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                          EMULATE_EXP2, False, KEY_SPLIT, PART, False, RELEASE_Q)
    elif total > 0:
        if FIXED_OFFSETS and not CHECKED:  # (as in the loop without the overlap, above)
            bound = _score_bounds(q, KEY_NORMS + off_b * stride_nb + off_hkv * stride_nh, scale_log2, o_layout, row_s)
        mbarrier.wait(k_ready.index(base % STAGES), (base // STAGES) & 1)
        qk = warpgroup_mma(q, k_smem.index(base % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        qk = _scores_masked(qk, 0, total, sub_tiles, first_tested, index_row, rows_s, BLOCK_KV, SUB_N, CAUSAL)
        m_i = gl.max(qk, 1) * scale_log2
        p = _exp2(qk * scale_log2 - _exp_offset(m_i, CAUSAL)[:, None], EMULATE_EXP2)
        l_i = gl.sum(p, 1)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        if FIXED_OFFSETS:
            keep = _all_seen(m_i) if CHECKED else _keeps_offsets(bound, m_i, dtype)
            if keep:
                acc, m_i, l_i, p_prev = _walk_overlapped(walk, acc, m_i, l_i, p_prev, BLOCK_KV, SUB_N, STAGES,
                                                         CAUSAL, EMULATE_EXP2, True)
            else:
                acc, m_i, l_i, p_prev = _walk_overlapped(walk, acc, m_i, l_i, p_prev, BLOCK_KV, SUB_N, STAGES,
                                                         CAUSAL, EMULATE_EXP2, False)
        else:
            acc, m_i, l_i, p_prev = _walk_overlapped(walk, acc, m_i, l_i, p_prev, BLOCK_KV, SUB_N, STAGES, CAUSAL,
                                                     EMULATE_EXP2, False)
        if RELEASE_Q:  # the walk's last Q K^T is done
            mbarrier.arrive(q_empty, count=1)
        last = (base + total - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((base + total - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        mbarrier.arrive(kv_empty.index(last), count=1)
        if CHECKED:  # (as above)
            again = ~_sums_within(l_i, acc)

    if KEY_SPLIT > 1 and PART == 1:
        _hand_over(merge, HALF, acc, m_i, l_i, again)
        mbarrier.arrive(q_empty, count=1)
    else:
        if KEY_SPLIT > 1:
            acc, m_i, l_i, again = _merged(merge, HALF, turn, acc, m_i, l_i, again)
        if RELEASE_Q:  # (a walk of no tiles has not given Q back)
            mbarrier.arrive(q_empty, count=1, pred=total == 0)
        if CHECKED:
            if again:  # cold: a score rose more than 2^RISE_LIMIT past its row's offset (kernels/README.md)
                _walk_again(shared, item, HALF, q_slot, BLOCK_Q, BLOCK_KV, CAUSAL, O_THROUGH_TMA, RELEASE_Q)
                if not RELEASE_Q:
                    mbarrier.arrive(q_empty, count=1)
            else:
                _release_and_finish(acc, m_i, l_i, shared, q_box, q_empty, off_b, off_h, first_row, rows_s,
                                    O_THROUGH_TMA, RELEASE_Q)
        else:
            _release_and_finish(acc, m_i, l_i, shared, q_box, q_empty, off_b, off_h, first_row, rows_s,
                                O_THROUGH_TMA, RELEASE_Q)
    return base + total


@gluon.jit
def _hand_over(merge, HALF: gl.constexpr, acc, m_i, l_i, again):
    """A PART 1 consumer's end of a split walk (KEY_SPLIT_DIMS): its rows' accumulator acc fp32 [64, D], offsets and
    sums m_i, l_i [64] and whether its walk must be done again (again, a scalar) into the merge buffers of rows
    HALF, and the PART 0 consumer of those rows told (merged). The buffers are free: the PART 0 consumer read the
    last item's before it released Q (q_empty), which this item's walk waited for."""
    merge_acc, merge_rows, merged = merge
    merge_acc.index(HALF).store(acc)
    merge_rows.index(3 * HALF).store(m_i)
    merge_rows.index(3 * HALF + 1).store(l_i)
    merge_rows.index(3 * HALF + 2).store(gl.zeros_like(l_i) + again.to(gl.float32))
    _barrier()  # every thread's stores before the one arrival
    mbarrier.arrive(merged.index(HALF), count=1)


@gluon.jit
def _merged(merge, HALF: gl.constexpr, turn, acc, m_i, l_i, again):
    """A PART 0 consumer's rows after a split walk (KEY_SPLIT_DIMS): its acc, m_i, l_i (as _hand_over's) merged with
    the PART 1 consumer's, once handed over (merged's phase: the item's turn), each side rescaled to the larger
    offset (0 where neither saw a key, as _exp_offset keeps it); again if either side's walk must be done again."""
    merge_acc, merge_rows, merged = merge
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    mbarrier.wait(merged.index(HALF), turn & 1)
    m_b = merge_rows.index(3 * HALF).load(m_i.type.layout)
    l_b = merge_rows.index(3 * HALF + 1).load(m_i.type.layout)
    again_b = gl.max(merge_rows.index(3 * HALF + 2).load(m_i.type.layout), 0) > 0
    acc_b = merge_acc.index(HALF).load(acc.type.layout)
    m_new = gl.maximum(m_i, m_b)
    offset = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - offset)
    alpha_b = gl.exp2(m_b - offset)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + acc_b * gl.convert_layout(alpha_b, row_o)[:, None]
    return acc, m_new, l_i * alpha + l_b * alpha_b, again | again_b


@gluon.jit
def _release_and_finish(acc, m_i, l_i, shared, q_box, q_empty, off_b, off_h, first_row, rows_s,
                        O_THROUGH_TMA: gl.constexpr, RELEASED: gl.constexpr = False):
    """A consumer's half of Q released to the loader (its buffer's barrier q_empty), and its rows stored (_finish,
    whose other arguments these are): the release first, so that a later item's Q loads while the rows go out,
    unless they go out through Q's buffer (O_THROUGH_TMA); none where the walk has RELEASED it (RELEASE_Q)."""
    if not O_THROUGH_TMA and not RELEASED:
        mbarrier.arrive(q_empty, count=1)
    _finish(acc, m_i, l_i, shared, q_box, off_b, off_h, first_row, rows_s, O_THROUGH_TMA)
    if O_THROUGH_TMA and not RELEASED:
        mbarrier.arrive(q_empty, count=1)


@gluon.jit
def _finish(acc, m_i, l_i, shared, q_box, off_b, off_h, first_row, rows_s, O_THROUGH_TMA: gl.constexpr):
    """A consumer's rows first_row .. first_row+63 of Out and Lse from its walk's accumulator acc [64, D] and its
    rows' offsets and sums m_i, l_i [64] (rows_s: the rows' indices, in m_i's layout): zeros and -inf for a row with
    no key. q_box: its Q tile's buffer in shared memory, [1, 1, 64, D]. (shared: as _consumer's.)"""
    descs, ring, lists, outputs, norms, qkv, scale_log2, merge, ones = shared
    O_DESC = descs[3]
    Out, Lse, seq_q, stride_ob, stride_oh, stride_os, stride_lb, stride_lh = outputs
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) / _LOG2E, float("-inf"))
    if O_THROUGH_TMA:
        # this consumer's half of Q is free (its last score product is done, and nothing loads Q again): the rows go
        # there and out with one TMA copy, which leaves out rows past Sq, instead of 64 scattered stores a thread
        q_box.reshape([_ROWS, acc.shape[1]]).store(out.to(q_box.dtype))
        fence_async_shared()
        tma_store(O_DESC, [off_b, off_h, first_row, 0], q_box)
        tma.store_wait(0)  # before the program's shared memory goes
    else:
        rows_o = first_row + gl.arange(0, _ROWS, row_o)
        cols = gl.arange(0, acc.shape[1], gl.SliceLayout(0, o_layout))
        o_ptrs = (Out + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
                  + rows_o.to(gl.int64)[:, None] * stride_os + cols[None, :])
        gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(rows_o < seq_q)[:, None])
    gl.store(Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows_s, lse,
             mask=rows_s < seq_q)


@gluon.jit
def _all_seen(m_i):
    """Whether every row of a warpgroup has seen a key, its offset m_i [64] finite (CHECKED: the condition for
    keeping the offsets). A scalar over the warpgroup, whose products are shared."""
    return gl.min(((m_i > float("-inf")) & (m_i < float("inf"))).to(gl.int32), 0) > 0


@gluon.jit
def _sums_within(l_i, acc):
    """Whether a walk with fixed offsets stayed in range (CHECKED): every row's sum l_i [64] at most 2^RISE_LIMIT
    (so no P passed it: bf16 reaches 2^128) and its accumulator row acc [64, D] finite; false for NaN too. Rows past
    the sequence's end are zeros of Q, whose scores are 0 and stay in range. A scalar over the warpgroup."""
    row = gl.sum(acc, 1)
    finite = gl.min(((row > float("-inf")) & (row < float("inf"))).to(gl.int32), 0)
    return (gl.min((l_i <= _SUM_LIMIT).to(gl.int32), 0) + finite) == 2


@gluon.jit(noinline=True)
def _walk_again(shared, item, HALF: gl.constexpr, q_slot, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr,
                CAUSAL: gl.constexpr, O_THROUGH_TMA: gl.constexpr, RELEASE_Q: gl.constexpr = False):
    """A consumer's rows walked again with running maxima, and stored, where its walk with fixed offsets rose too far
    (CHECKED): the whole kv list, under CAUSAL with the test key <= query. Cold, and alone: the loader has moved on
    and the ring's stages may still be the other consumer's, so K and V come by pointer loads straight into
    registers for the Ampere products (mma_v2), _AGAIN_KEYS keys a step, and no conversion goes through shared
    memory (none is left). It finds its item's place and list again (_program) rather than keep them through the
    walk, which held no registers for it. Its rows of Q stay in their buffer (q_slot of the kernel's Q buffers) until
    it returns, or under RELEASE_Q, where that buffer may already hold a later item's, come by pointer once. (Other
    parameters as _consumer_item's.)"""
    descs, ring, lists, outputs, norms, qkv, scale_log2, merge, ones = shared
    (Q, K, V, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
     stride_vs) = qkv
    seq_q = outputs[2]
    off_b, off_h, off_hkv, start_m, index_row, count = _program(lists, item, BLOCK_Q, CAUSAL)
    first_row = start_m + HALF * _ROWS
    q_box = ring[0].index(q_slot)
    k_head = K + off_b.to(gl.int64) * stride_kb + off_hkv.to(gl.int64) * stride_kh
    v_head = V + off_b.to(gl.int64) * stride_vb + off_hkv.to(gl.int64) * stride_vh
    HEAD_DIM: gl.constexpr = descs[0].block_type.shape[3]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, mma)
    rows = first_row + gl.arange(0, _ROWS, row)
    if RELEASE_Q:  # Q [64, D] in registers, rows past Sq as zeros (as the TMA box reads them)
        rows_q = first_row + gl.arange(0, _ROWS, gl.SliceLayout(1, a_op))
        dims_q = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, a_op))
        q_head = Q + off_b.to(gl.int64) * stride_qb + off_h.to(gl.int64) * stride_qh
        q_rows = gl.load(q_head + rows_q.to(gl.int64)[:, None] * stride_qs + dims_q[None, :],
                         mask=(rows_q < seq_q)[:, None], other=0.0)
    keys_k = gl.arange(0, _AGAIN_KEYS, gl.SliceLayout(0, b_op))  # K^T [D, keys]: a column a key
    dims_k = gl.arange(0, HEAD_DIM, gl.SliceLayout(1, b_op))
    keys_v = gl.arange(0, _AGAIN_KEYS, gl.SliceLayout(1, b_op))  # V [keys, D]: a row a key
    dims_v = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, b_op))
    keys_s = gl.arange(0, _AGAIN_KEYS, gl.SliceLayout(0, mma))
    m_i = gl.full([_ROWS], float("-inf"), gl.float32, row)
    l_i = gl.zeros([_ROWS], gl.float32, row)
    acc = gl.zeros([_ROWS, HEAD_DIM], gl.float32, mma)
    s_zero = gl.zeros([_ROWS, _AGAIN_KEYS], gl.float32, mma)
    STEPS: gl.constexpr = BLOCK_KV // _AGAIN_KEYS
    for step in range(count * STEPS):
        start = gl.load(index_row + step // STEPS) * BLOCK_KV + (step % STEPS) * _AGAIN_KEYS
        k_t = gl.load(k_head + (start + keys_k).to(gl.int64)[None, :] * stride_ks + dims_k[:, None])
        if RELEASE_Q:
            q_op = q_rows
        else:
            q_op = q_box.reshape([_ROWS, HEAD_DIM]).load(a_op)  # (from shared memory each step: fewer registers held)
        qk = mma_v2(q_op, k_t, s_zero)
        if CAUSAL:
            qk = gl.where((start + keys_s)[None, :] <= rows[:, None], qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * scale_log2)
        offset = _exp_offset(m_new, CAUSAL)
        p = gl.exp2(qk * scale_log2 - offset[:, None])
        alpha = gl.exp2(m_i - offset)
        l_i = l_i * alpha + gl.sum(p, 1)
        v = gl.load(v_head + (start + keys_v).to(gl.int64)[:, None] * stride_vs + dims_v[None, :])
        acc = mma_v2(gl.convert_layout(p.to(v.dtype), a_op), v, acc * alpha[:, None])
        m_i = m_new
    _finish(acc, m_i, l_i, shared, q_box, off_b, off_h, first_row, rows, O_THROUGH_TMA)


@gluon.jit
def _loader(shared, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr, TILE_N: gl.constexpr,
            STAGES: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, CLAIMED: gl.constexpr):
    """One warp: its program's work items' loads (_loader_item), in the consumers' order (_consumer); under CLAIMED
    the items it claims (_claim), each posted to the consumers before its Q loads, then -1 once none is left."""
    if CLAIMED:
        lists = shared[2]
        ring = shared[1]
        base = gl.program_id(0) * 0  # (as _consumer's)
        turn = base
        position = _claim(lists)
        while position < lists[5]:
            # the next claim goes after this item's last loads: its latency hides under the ring's last stages
            base = _loader_item(shared, gl.load(lists[6] + position), turn, base, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N,
                                STAGES, CAUSAL, True)
            position = _claim(lists)
            turn += 1
        buffer, phase = _q_buffer(ring, turn)
        # q_empty: the consumers are done with the post of the item that last had this buffer
        mbarrier.wait(ring[4].index(buffer), phase ^ 1)
        _post_item(ring[8].index(buffer), -1)
        mbarrier.arrive(ring[3].index(buffer), count=1)  # q_ready with no bytes to wait for
    elif PERSISTENT:
        lists = shared[2]
        base = gl.program_id(0) * 0  # (as _consumer's)
        for turn in range(_turns(lists)):
            base = _loader_item(shared, _turn_item(lists, turn), turn, base, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES,
                                CAUSAL, False)
    else:
        _loader_item(shared, _grid_item(), 0, 0, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, False)


@gluon.jit
def _loader_item(shared, item, turn, base, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr, SUB_N: gl.constexpr,
                 TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, POST: gl.constexpr):
    """Work item `item`'s loads (its turn-th in the program): the tile's two halves of Q into its Q buffer
    (_q_buffer) once both consumers have released the buffer's last item's (POST: the item posted to them first,
    _post_item), then each kept key tile's K and V into the ring from position base on, a stage once both consumers
    have released it. Returns the ring position after them. (Parameters as _consumer_item's.)"""
    descs, ring, lists, outputs, norms, qkv, scale_log2, merge, ones = shared
    Q_DESC, K_DESC, V_DESC, O_DESC = descs
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, item_smem = ring
    off_b, off_h, off_hkv, start_m, index_row, count = _program(lists, item, BLOCK_Q, CAUSAL)
    SUBS_PER_BLOCK: gl.constexpr = BLOCK_KV // SUB_N
    PARTS: gl.constexpr = TILE_N // SUB_N
    sub_tiles = count * SUBS_PER_BLOCK
    tiles = (sub_tiles + PARTS - 1) // PARTS
    # a fresh barrier counts as released in the phase before its first: the first item's Q and the first round of
    # stages go at once
    buffer, phase = _q_buffer(ring, turn)
    q_ready = q_ready.index(buffer)
    mbarrier.wait(q_empty.index(buffer), phase ^ 1)
    if POST:
        _post_item(item_smem.index(buffer), item)
    mbarrier.expect(q_ready, 2 * Q_DESC.block_type.nbytes)
    tma_load(Q_DESC, [off_b, off_h, start_m, 0], q_ready, q_smem.index(2 * buffer))
    tma_load(Q_DESC, [off_b, off_h, start_m + _ROWS, 0], q_ready, q_smem.index(2 * buffer + 1))
    for j in range(tiles):
        stage = (base + j) % STAGES
        mbarrier.wait(kv_empty.index(stage), (((base + j) // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), PARTS * K_DESC.block_type.nbytes)
        mbarrier.expect(v_ready.index(stage), PARTS * V_DESC.block_type.nbytes)
        for part in gl.static_range(PARTS):
            sub = gl.minimum(PARTS * j + part, sub_tiles - 1)  # a last tile not filled repeats its last sub tile
            row = gl.load(index_row + sub // SUBS_PER_BLOCK) * BLOCK_KV + (sub % SUBS_PER_BLOCK) * SUB_N
            tma_load(K_DESC, [off_b, off_hkv, row, 0], k_ready.index(stage),
                     _sub_tile(k_smem, stage, part, SUB_N))
            tma_load(V_DESC, [off_b, off_hkv, row, 0], v_ready.index(stage),
                     _sub_tile(v_smem, stage, part, SUB_N))
    return base + tiles


@gluon.jit
def attention_fwd_ws_kernel(Q_DESC, K_DESC, V_DESC, O_DESC, Out, Lse, KV_COUNT, KV_INDEX, KEY_NORMS, scale_log2,
                            seq_q, heads, group_size, q_tiles, items, ITEM_ORDER, ITEM_COUNTER, stride_cb, stride_ch,
                            stride_ib, stride_ih, stride_iq, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                            stride_nb, stride_nh, Q, K, V, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
                            stride_ks, stride_vb, stride_vh, stride_vs, BLOCK_Q: gl.constexpr, BLOCK_KV: gl.constexpr,
                            SUB_N: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, OVERLAP: gl.constexpr = True,
                            EMULATE_EXP2: gl.constexpr = False, O_THROUGH_TMA: gl.constexpr = False,
                            FIXED_OFFSETS: gl.constexpr = False, CHECK_RISE: gl.constexpr = False,
                            PERSISTENT: gl.constexpr = False, CLAIMED: gl.constexpr = False,
                            KEY_SPLIT: gl.constexpr = 1, Q_BUFFERS: gl.constexpr = 1, MMA_SUMS: gl.constexpr = False,
                            RELEASE_Q: gl.constexpr = False):
    """Grid (cdiv(Sq, 128) = q_tiles, launch.batch_head_axes(B, H)), a program a work item (a query tile of a head);
    under PERSISTENT (see PERSISTENT_DIMS) (programs, 1, 1), each taking the items at positions program_id(0) + n *
    programs of ITEM_ORDER int32 [items = q_tiles * B * H] (query_tile_order) in turn, else ITEM_ORDER None; under
    CLAIMED (CLAIMED_DIMS, with PERSISTENT) each taking the next position of ITEM_ORDER from ITEM_COUNTER int32 [1]
    (zero at launch, else None) as it finishes an item.
    Q_DESC / K_DESC / V_DESC: Gluon host descriptors of q [B, H, Sq, D], k and v [B, Hkv, Sk, D] with boxes
    [1, 1, 64, D] / [1, 1, SUB_N, D]; KV_COUNT int32
    [Bm, Hm, nq], KV_INDEX int32 [Bm, Hm, nq, L] (size-1 mask dims with stride 0), every listed block's keys below
    Sk (CAUSAL: the lists of BlockSparsity.causal(), ascending); Out [B, H, Sq, D] (last dim contiguous), Lse
    fp32 [B, H, Sq] (last dim contiguous); O_DESC: when O_THROUGH_TMA, a descriptor of Out with Q_DESC's boxes,
    through which the rows go (else None, and Out's pointer takes them). TILE_N: keys a tile (TILE_KEYS), a
    multiple of SUB_N; OVERLAP: see OVERLAPPED; EMULATE_EXP2: see _exp2.
    FIXED_OFFSETS (see FIXED_OFFSET_DIMS) without CHECK_RISE (RISE_CHECKED_DTYPES): KEY_NORMS fp32 [B, Hkv,
    KEY_NORM_PARTS] (last dim contiguous, key_norm_parts), whose maximum over the parts bounds a kv head's key norms;
    else None. Q, K and V: q, k and v's pointers (strides stride_q* / stride_k* / stride_v*, last dim contiguous),
    which only CHECK_RISE's cold walk again reads (Q and its strides None unless RELEASE_Q). KEY_SPLIT 2
    (KEY_SPLIT_DIMS, KEY_SPLIT_CAUSAL_DIMS): four consumers, a pair of them on each half of the key tiles
    (_consumer_item). Q_BUFFERS 2 (Q_BUFFER_DIMS): two Q buffers, which successive items take in turn (_q_buffer).
    MMA_SUMS (MMA_ROW_SUM_DIMS, MMA_ROW_SUM_CAUSAL_DIMS): the fixed walk's row sums from the tensor cores, P times a
    tile of ones a stage. RELEASE_Q (EARLY_Q_RELEASE_DIMS): each consumer gives its half of Q back after its walk's
    last Q K^T."""
    gl.static_assert(Q_BUFFERS == 1 or KEY_SPLIT == 1, "a split walk's merge buffers hold one item's rows")
    q_smem = gl.allocate_shared_memory(Q_DESC.dtype, [2 * Q_BUFFERS] + Q_DESC.block_type.shape, Q_DESC.layout)
    HEAD_DIM: gl.constexpr = Q_DESC.block_type.shape[3]
    # a stage: one [TILE_N, D] key tile, which the loader fills with TILE_N // SUB_N boxes of SUB_N keys (_sub_tile)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HEAD_DIM], K_DESC.dtype)
    k_smem = gl.allocate_shared_memory(K_DESC.dtype, [STAGES, TILE_N, HEAD_DIM], tile_layout)
    v_smem = gl.allocate_shared_memory(V_DESC.dtype, [STAGES, TILE_N, HEAD_DIM], tile_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # CLAIMED: the item the loader claimed, posted to the consumers (_post_item)
    item_smem = gl.allocate_shared_memory(gl.int32, [Q_BUFFERS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # KEY_SPLIT: what a PART 1 consumer hands the PART 0 one of its rows (_hand_over): accumulator [64, D] and
    # offsets, sums and the again flag [64] per half of the rows, and the barriers that tell it. Without a key
    # split nothing reads them, and buffers that exist anyway stand in, so that the kernel allocates nothing more.
    if KEY_SPLIT > 1:
        merged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        merge = (gl.allocate_shared_memory(gl.float32, [2, _ROWS, HEAD_DIM],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])),
                 gl.allocate_shared_memory(gl.float32, [6, _ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[0])),
                 merged)
    else:
        merge = (item_smem, item_smem, q_ready)
    # MMA_SUMS: a [8, TILE_N] tile of ones a stage, the B operand of the consumers' row sums (MMA_ROW_SUM_DIMS), one
    # a stage so that its address moves with the stage's, as V's does: at one address ptxas holds the 16 loop-invariant
    # descriptors of a 256-key tile in registers and moves them to uniform ones every tile (59 instructions)
    if MMA_SUMS:
        ones = gl.allocate_shared_memory(K_DESC.dtype, [STAGES, 8, TILE_N],
                                         gl.NVMMASharedLayout.get_default_for([8, TILE_N], K_DESC.dtype))
        for i in gl.static_range(STAGES):
            ones.index(i).store(gl.full([8, TILE_N], 1.0, K_DESC.dtype,
                                        gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])))
    else:
        ones = item_smem
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2 * KEY_SPLIT)  # every consumer releases its half of Q
    if KEY_SPLIT > 1:
        mbarrier.init(merge[2].index(0), count=1)
        mbarrier.init(merge[2].index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a stage
    fence_async_shared()
    FIRST: gl.constexpr = 0
    SECOND: gl.constexpr = 1
    # the partitions' arguments, grouped by what reads them: descriptors, the ring and its barriers, the kv lists
    # (_program), out and Lse (_finish), the key norms' bound, and q, k and v by pointer (_walk_again)
    shared = ((Q_DESC, K_DESC, V_DESC, O_DESC),
              (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, item_smem),
              (KV_COUNT, KV_INDEX, heads, group_size, q_tiles, items, ITEM_ORDER, ITEM_COUNTER, stride_cb, stride_ch,
               stride_ib, stride_ih, stride_iq),
              (Out, Lse, seq_q, stride_ob, stride_oh, stride_os, stride_lb, stride_lh),
              (KEY_NORMS, stride_nb, stride_nh),
              (Q, K, V, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
               stride_vs), scale_log2, merge, ones)
    if KEY_SPLIT > 1:
        gl.warp_specialize([
            (_consumer, (shared, FIRST, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP, EMULATE_EXP2,
                         O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, PERSISTENT, CLAIMED, KEY_SPLIT, FIRST, MMA_SUMS,
                         RELEASE_Q)),
            (_consumer, (shared, SECOND, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP, EMULATE_EXP2,
                         O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, PERSISTENT, CLAIMED, KEY_SPLIT, FIRST, MMA_SUMS,
                         RELEASE_Q)),
            (_consumer, (shared, FIRST, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP, EMULATE_EXP2,
                         O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, PERSISTENT, CLAIMED, KEY_SPLIT, SECOND, MMA_SUMS,
                         RELEASE_Q)),
            (_consumer, (shared, SECOND, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP, EMULATE_EXP2,
                         O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, PERSISTENT, CLAIMED, KEY_SPLIT, SECOND, MMA_SUMS,
                         RELEASE_Q)),
            (_loader, (shared, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, PERSISTENT, CLAIMED)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (shared, FIRST, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP, EMULATE_EXP2,
                         O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, PERSISTENT, CLAIMED, KEY_SPLIT, FIRST, MMA_SUMS,
                         RELEASE_Q)),
            (_consumer, (shared, SECOND, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, OVERLAP, EMULATE_EXP2,
                         O_THROUGH_TMA, FIXED_OFFSETS, CHECK_RISE, PERSISTENT, CLAIMED, KEY_SPLIT, FIRST, MMA_SUMS,
                         RELEASE_Q)),
            (_loader, (shared, BLOCK_Q, BLOCK_KV, SUB_N, TILE_N, STAGES, CAUSAL, PERSISTENT, CLAIMED)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


class Plan(NamedTuple):
    """The kernel's sub tile height (keys per TMA box: the largest of the tile, 128 and 64 that divides the key
    block it walks), whether it tests the causal diagonal, its keys a tile (TILE_KEYS) and whether its consumers
    overlap a tile's products with the softmax (OVERLAPPED), whether its rows' offsets may stay fixed
    (FIXED_OFFSET_DIMS), how many 64-key blocks it walks each listed key block as (SPLIT_KEY_BLOCK_DIMS; 1: as
    listed), and how many consumer pairs split the key tiles (KEY_SPLIT_DIMS, KEY_SPLIT_CAUSAL_DIMS; 1: one pair walks
    them all)."""
    sub_n: int
    causal: bool = False
    tile_n: int = 128
    overlap: bool = True
    fixed_offsets: bool = False
    block_parts: int = 1
    key_split: int = 1

    def stages(self, dim: int) -> int:
        """The ring's stages at head dim `dim` (STAGES, or KEY_SPLIT_STAGES under a key split)."""
        return KEY_SPLIT_STAGES if self.key_split > 1 else STAGES[dim]

    def consumer_regs(self) -> int:
        """Registers a consumer thread takes (setmaxnreg)."""
        return KEY_SPLIT_REGS if self.key_split > 1 else CONSUMER_REGS

    def launch_options(self) -> dict:
        """num_warps and the launch's register bound."""
        return KEY_SPLIT_LAUNCH_OPTIONS if self.key_split > 1 else LAUNCH_OPTIONS


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_kv: int, *, is_causal: bool,
         token_mask, block_mask, kv_valid, varlen, quant, min_work: int) -> Optional[Plan]:
    """The plan when this kernel can run the forward of q [B, H, Sq, D], k / v [B, Hkv, Sk, D] over lists at
    (block_q, block_kv), else None (the Triton forward runs): ENABLED, a Hopper GPU (compute capability 9.0, for
    wgmma), and qualifies()."""
    if not ENABLED or q.device.type != "cuda":
        return None
    chosen = qualifies(q, k, v, block_q, block_kv, is_causal=is_causal, token_mask=token_mask, block_mask=block_mask,
                       kv_valid=kv_valid, varlen=varlen, quant=quant, min_work=min_work)
    # the device query last: most calls that decline do so on their arguments, for less host time
    return chosen if chosen is not None and launch.device_capability(q.device) == (9, 0) else None


def qualifies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_kv: int, *, is_causal: bool,
              token_mask, block_mask, kv_valid, varlen, quant, min_work: int) -> Optional[Plan]:
    """plan()'s conditions on the call, whatever the device: no element tests but the causal one (no token_mask,
    block_mask, kv_valid or varlen, Sk a multiple of block_kv); no quant; bf16 or fp16 for all three; D = Dv, one
    of HEAD_DIMS (with a ring depth in STAGES); block_q a multiple of 128 and block_kv of 64; at least min_work of
    dense work (B * H * Sq * Sk * D: below it a call is host-bound, and the Triton forward's launch plans cost
    less host time) and at least MIN_KEYS[D] keys; every tensor's last dim contiguous, its other strides positive
    and with its start 16-byte aligned (TMA's rule). The plan: TILE_KEYS[D] keys a tile, in boxes of the largest of
    those, 128 and 64 that divides block_kv."""
    if any(x is not None for x in (token_mask, block_mask, kv_valid, varlen, quant)):
        return None
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype):
        return None
    batch, heads, seq_q, dim = q.shape
    seq_kv = k.shape[2]
    if dim not in HEAD_DIMS or dim not in STAGES or v.shape[-1] != dim:
        return None
    if block_q % TILE_Q or block_kv % 64 or seq_kv % block_kv:
        return None
    if batch * heads * seq_q * seq_kv * dim < min_work or seq_kv < MIN_KEYS.get(dim, 0):
        return None
    if not all(map(tma_readable, (q, k, v))):
        return None
    return _plan(block_kv, dim, is_causal)


def _plan(block_kv: int, dim: int, causal: bool) -> Plan:
    """The tiling of a call that qualifies: key tiles of TILE_KEYS[dim] keys (KEY_SPLIT_TILE_N under a key split,
    over the mask's own key blocks), sub tiles and key blocks as Plan says."""
    key_split = 2 if dim in (KEY_SPLIT_CAUSAL_DIMS if causal else KEY_SPLIT_DIMS) else 1
    tile_n = KEY_SPLIT_TILE_N if key_split > 1 else TILE_KEYS.get(dim, 128)
    parts = block_kv // 64 if dim in SPLIT_KEY_BLOCK_DIMS and not causal and key_split == 1 else 1
    sub_n = next(n for n in (tile_n, 128, 64) if block_kv // parts % n == 0)
    overlap = OVERLAPPED.get(dim, True) and key_split == 1
    return Plan(sub_n, causal, tile_n, overlap, dim in FIXED_OFFSET_DIMS and not (causal and overlap), parts,
                key_split)


_GL_DTYPES = {torch.bfloat16: ("bf16", gl.bfloat16), torch.float16: ("fp16", gl.float16),
              torch.float32: ("fp32", gl.float32)}


def tma_readable(t: torch.Tensor) -> bool:
    """Whether host_descriptor can describe t: last dim contiguous, start and other strides 16-byte aligned, and no
    stride of 0 (a batch-broadcast tensor passes the 16-byte rule but not the TMA unit)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


def host_descriptor(t: torch.Tensor, rows: int, columns: Optional[int] = None):
    """A Gluon host descriptor of t [B, H, S, D] (bf16, fp16 or fp32) with [1, 1, rows, columns] boxes (columns:
    D by default); rows past S read as zeros and take no writes. The backward's kernel uses it too."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    box = (1, 1, rows, t.shape[-1] if columns is None else columns)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(box), _box_layout(box, t.dtype))


@functools.lru_cache(maxsize=None)
def _box_layout(box: tuple, dtype: torch.dtype):
    """The shared-memory layout of a descriptor's box (immutable; cached, since building it costs ~20 us of host
    time a descriptor and a call builds up to five)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), _GL_DTYPES[dtype][1])


def descriptor_signature(dtype: torch.dtype, rows: int, columns: int = HEAD_DIM) -> str:
    """The compile signature of a host_descriptor argument of dtype with [1, 1, rows, columns] boxes (compile_sm90's,
    here and in the backward's module)."""
    box = (1, 1, rows, columns)
    return f"tensordesc<{_GL_DTYPES[dtype][0]}[{','.join(map(str, box))}],{_box_layout(box, dtype)!r}>"


def attention_forward_ws(q, k, v, kv_count, kv_index, block_q: int, block_kv: int, scale_log2: float, out, lse,
                         chosen: Plan) -> None:
    """Run the kernel into out [B, H, Sq, D] and lse fp32 [B, H, Sq] (plan() said chosen)."""
    from .forward import stride_args  # (forward imports this module lazily: no cycle)
    if chosen.block_parts > 1:
        kv_count, kv_index = cached_split_key_blocks(kv_count, kv_index, chosen.block_parts)
        block_kv //= chosen.block_parts
    batch, heads, seq_q, dim = q.shape
    q_tiles = triton.cdiv(seq_q, TILE_Q)
    items = q_tiles * batch * heads

    def arguments():
        descriptors = dict(Q_DESC=host_descriptor(q, CONSUMER_ROWS), K_DESC=host_descriptor(k, chosen.sub_n),
                           V_DESC=host_descriptor(v, chosen.sub_n))
        static = dict(
            scale_log2=scale_log2, seq_q=seq_q, heads=heads, group_size=heads // k.shape[1], q_tiles=q_tiles,
            items=items,
            # the lists' size-1 batch and head dims broadcast: stride 0
            **stride_args("c", kv_count, "bh"), **stride_args("i", kv_index, "bhq"), **stride_args("o", out, "bhs"),
            **stride_args("l", lse, "bh"), **stride_args("n", key_norms, "bh"), **stride_args("k", k, "bhs"),
            **stride_args("v", v, "bhs"), BLOCK_Q=block_q, BLOCK_KV=block_kv,
            SUB_N=chosen.sub_n, TILE_N=chosen.tile_n, OVERLAP=chosen.overlap, STAGES=chosen.stages(dim),
            CAUSAL=chosen.causal, FIXED_OFFSETS=chosen.fixed_offsets, CONSUMER_REGS=chosen.consumer_regs(),
            LOADER_REGS=LOADER_REGS, KEY_SPLIT=chosen.key_split, **settings,
            **{**stride_args("q", q, "bhs"), **unused})  # (q's strides None where unused)
        # O_DESC only when out goes through the TMA unit; else None: no descriptor to build or encode on relaunches
        if settings["O_THROUGH_TMA"]:
            descriptors["O_DESC"] = host_descriptor(out, CONSUMER_ROWS)
        if settings["PERSISTENT"]:
            programs = PERSISTENT_PROGRAMS or launch.device_properties(q.device).multi_processor_count
            grid = (min(items, programs), 1, 1)
        else:
            grid = (q_tiles, *launch.batch_head_axes(batch, heads))
        return grid, descriptors, static
    # K and V by pointer too (and Q where it goes back early), for the cold walk again with running maxima of a walk
    # whose rise was too large
    tensors = dict(Q_DESC=q, K_DESC=k, V_DESC=v, Out=out, Lse=lse, KV_COUNT=kv_count, KV_INDEX=kv_index, K=k, V=v)
    # the module's settings as this call takes them: constexprs of the kernel, and so part of its launch plan's key
    settings = _settings(chosen, q.dtype, dim)
    unused = _unused_arguments(chosen, settings)
    # the other fixed offsets' bound (FIXED_OFFSET_DIMS): the largest key norms of each kv head's parts, one pass over k
    key_norms = key_norm_parts(k) if "KEY_NORMS" not in unused else None
    if key_norms is not None:
        tensors["KEY_NORMS"] = key_norms
    if settings["O_THROUGH_TMA"]:
        tensors["O_DESC"] = out
    if settings["RELEASE_Q"]:
        tensors["Q"] = q
    if settings["PERSISTENT"]:
        tensors["ITEM_ORDER"] = cached_query_tile_order(kv_count, batch, heads, heads // k.shape[1], block_q, q_tiles,
                                                        chosen.causal)
    if settings["CLAIMED"]:
        # the programs' claims start at 0 each launch (a memset before the kernel; the counter ends past the items)
        tensors["ITEM_COUNTER"] = torch.zeros(1, dtype=torch.int32, device=q.device)
    # (the persistent grid's size is arguments()'s too)
    launch_warp_specialized(attention_fwd_ws_kernel, (block_q, block_kv, scale_log2, chosen, chosen.stages(dim),
                                                      *settings.values(), PERSISTENT_PROGRAMS), tensors, arguments,
                            chosen.launch_options())


def query_tile_order(kv_count: torch.Tensor, batch: int, heads: int, group_size: int, block_q: int,
                     q_tiles: int, causal: bool = False) -> torch.Tensor:
    """int32 [q_tiles * batch * heads]: the persistent grid's work items, numbered as _program takes them (item =
    tile + q_tiles * (b * heads + slot), slot s holding head (s % kv_heads) * group_size + s // kv_heads; causal:
    the tile counted from the last), longest kv list first by powers of two (lists of 2^k to 2^(k+1) - 1 blocks
    together, empty lists last), in that numbering's order within each: a strict sort by length took each tile
    position across every head together under is_causal, whose keys and values then missed L2 (kernels/README.md,
    "The persistent grid"). kv_count int32 [Bm, Hm, nq] (size-1 dims broadcast), a list per block of block_q rows,
    which a 128-row tile takes whole. With the programs taking the items in turn (_turn_item) or as they free up
    (CLAIMED_DIMS), each starts long and ends short, as the hardware's scheduler of a program a tile gets by
    itself."""
    kv_heads = heads // group_size
    slots = torch.arange(heads, device=kv_count.device)
    head_of_slot = (slots % kv_heads) * group_size + slots // kv_heads
    tiles = torch.arange(q_tiles, device=kv_count.device)
    block_of_tile = (tiles.flip(0) if causal else tiles) * TILE_Q // block_q
    counts = kv_count.expand(batch, heads, kv_count.shape[-1])[:, head_of_slot][:, :, block_of_tile]
    scale = torch.where(counts > 0, counts.float().log2().floor(), -1.0)
    return torch.argsort(scale.reshape(-1), descending=True, stable=True).to(torch.int32)


# query_tile_order's results by (kv_count's (id, version), the call's terms) (replay.kept_per_lists)
_QUERY_ORDERS: dict = {}
# split_key_blocks's results by the lists' (id, version) and the parts (replay.kept_per_lists)
_SPLIT_LISTS: dict = {}


def split_key_blocks(kv_count: torch.Tensor, kv_index: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kv lists (int32 kv_count [Bm, Hm, nq], kv_index [Bm, Hm, nq, L]) at key blocks `parts` times smaller:
    (kv_count * parts, kv_index [Bm, Hm, nq, L * parts]) with entry e as the entries e * parts .. e * parts + parts
    - 1, in order, so ascending lists stay ascending (SPLIT_KEY_BLOCK_DIMS)."""
    offsets = torch.arange(parts, device=kv_index.device, dtype=kv_index.dtype)
    return kv_count * parts, (kv_index.unsqueeze(-1) * parts + offsets).flatten(-2)


def cached_split_key_blocks(kv_count: torch.Tensor, kv_index: torch.Tensor,
                            parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """split_key_blocks(kv_count, kv_index, parts), computed once per lists tensors."""
    return replay.kept_per_lists(_SPLIT_LISTS, (kv_count, kv_index), (parts, ),
                                 lambda counts, index: split_key_blocks(counts, index, parts))


def cached_query_tile_order(kv_count: torch.Tensor, batch: int, heads: int, group_size: int, block_q: int,
                            q_tiles: int, causal: bool = False) -> torch.Tensor:
    """query_tile_order(kv_count, ...), computed once per lists tensor and terms."""
    return replay.kept_per_lists(_QUERY_ORDERS, (kv_count, ), (batch, heads, group_size, block_q, q_tiles, causal),
                                 lambda counts: query_tile_order(counts, batch, heads, group_size, block_q, q_tiles,
                                                                 causal))


def _claims(dim: int, causal: bool) -> bool:
    """Whether a launch at head dim `dim` claims its items (CLAIMED_DIMS, or CLAIMED_CAUSAL_DIMS under is_causal)."""
    return dim in (CLAIMED_CAUSAL_DIMS if causal else CLAIMED_DIMS)


def grid_settings(grid: Optional[str]) -> dict:
    """The module's grid settings (PERSISTENT_DIMS, CLAIMED_DIMS, CLAIMED_CAUSAL_DIMS: name -> head dims) that put
    every head dim's launches on one grid, for tests and benchmarks to set: None a program a tile, "turns" the
    persistent grid's programs taking the items in turn (never under is_causal), "claimed" claiming them from a
    counter (causal too)."""
    if grid not in (None, "turns", "claimed"):
        raise ValueError(f"grid must be None, 'turns' or 'claimed', got {grid!r}")
    claimed = HEAD_DIMS if grid == "claimed" else ()
    return dict(PERSISTENT_DIMS=HEAD_DIMS if grid == "turns" else (), CLAIMED_DIMS=claimed,
                CLAIMED_CAUSAL_DIMS=claimed)


def _settings(chosen: Plan, dtype: torch.dtype, dim: int, claimed: Optional[bool] = None) -> dict:
    """The kernel's constexprs that the module's settings decide for a launch of plan `chosen` at dtype and head dim
    `dim` (EMULATED_EXP2_DIMS, O_THROUGH_TMA, RISE_CHECKED_DTYPES, _DIMS and _CAUSAL_DIMS, PERSISTENT_DIMS,
    CLAIMED_DIMS and CLAIMED_CAUSAL_DIMS, Q_BUFFER_DIMS, MMA_ROW_SUM_DIMS and _CAUSAL_DIMS, EARLY_Q_RELEASE_DIMS):
    what attention_forward_ws launches with and compile_sm90 compiles by default. claimed: whether the items are
    claimed (None: as CLAIMED_DIMS or CLAIMED_CAUSAL_DIMS say), which makes the grid persistent."""
    if claimed is None:
        claimed = _claims(dim, chosen.causal)
    persistent = claimed or (dim in PERSISTENT_DIMS and not chosen.causal)
    q_buffers = _q_buffers(chosen, dim, persistent)
    return dict(EMULATE_EXP2=dim in EMULATED_EXP2_DIMS, O_THROUGH_TMA=O_THROUGH_TMA,
                CHECK_RISE=chosen.fixed_offsets and dtype in RISE_CHECKED_DTYPES
                and dim in (RISE_CHECKED_CAUSAL_DIMS if chosen.causal else RISE_CHECKED_DIMS),
                PERSISTENT=persistent, CLAIMED=claimed, Q_BUFFERS=q_buffers, MMA_SUMS=_mma_sums(chosen, dim, q_buffers),
                RELEASE_Q=_releases_q_early(chosen, dim, persistent, O_THROUGH_TMA))


def _releases_q_early(chosen: Plan, dim: int, persistent: bool, o_through_tma: bool) -> bool:
    """Whether a launch of plan `chosen` at head dim `dim` has its consumers give Q back after their walks' last
    Q K^T (EARLY_Q_RELEASE_DIMS): only on a persistent grid, where a next item can load, with one consumer pair, with
    out not going through Q's buffer (o_through_tma), and not under is_causal, whose launches are a program a tile
    (CLAIMED_CAUSAL_DIMS) and whose claimed D=64 build, with it, keeps 104 bytes of stack (Triton 3.9; 88 without)."""
    return (dim in EARLY_Q_RELEASE_DIMS and persistent and chosen.key_split == 1 and not o_through_tma
            and not chosen.causal)


def _mma_sums(chosen: Plan, dim: int, q_buffers: int) -> bool:
    """Whether a launch of plan `chosen` at head dim `dim` with q_buffers Q buffers takes its fixed walk's row sums
    from the tensor cores (MMA_ROW_SUM_DIMS, MMA_ROW_SUM_CAUSAL_DIMS): only the walk in turn of two consumers, and
    with one Q buffer (the tiles of ones, 12 KiB, and a second buffer's 16 KiB: 236 KiB against Hopper's 227)."""
    return (dim in (MMA_ROW_SUM_CAUSAL_DIMS if chosen.causal else MMA_ROW_SUM_DIMS) and chosen.fixed_offsets
            and not chosen.overlap and chosen.key_split == 1 and q_buffers == 1)


def _q_buffers(chosen: Plan, dim: int, persistent: bool) -> int:
    """The kernel's Q buffers for a launch of plan `chosen` at head dim `dim` (Q_BUFFER_DIMS): two only where a
    program takes several items (persistent) and one pair of consumers walks them."""
    return 2 if persistent and chosen.key_split == 1 and dim in Q_BUFFER_DIMS else 1


def _unused_arguments(chosen: Plan, settings: dict) -> dict:
    """{name: None} for the kernel's arguments that a launch of plan `chosen` with `settings` (_settings) leaves out:
    out's descriptor unless O_THROUGH_TMA, the key norms unless a bound keeps the offsets fixed (fixed offsets without
    CHECK_RISE), the items' order off the persistent grid, its counter unless CLAIMED, and q's pointer and strides
    unless RELEASE_Q. The launcher passes them as None and compile_sm90 as constexpr None, so that both build the
    same kernel."""
    taken = dict(O_DESC=settings["O_THROUGH_TMA"], KEY_NORMS=chosen.fixed_offsets and not settings["CHECK_RISE"],
                 ITEM_ORDER=settings["PERSISTENT"], ITEM_COUNTER=settings["CLAIMED"],
                 **dict.fromkeys(("Q", "stride_qb", "stride_qh", "stride_qs"), settings["RELEASE_Q"]))
    return {name: None for name, takes in taken.items() if not takes}


def launch_warp_specialized(kernel_fn, site_key: tuple, tensors: dict,
                            arguments: Callable[[], tuple], options: Optional[dict] = None) -> None:
    """Launch kernel_fn, this module's kernel or backward_ws's, with `options` (num_warps and maxnreg; None:
    LAUNCH_OPTIONS). tensors: every tensor argument by name (a descriptor argument's: the tensor it describes);
    site_key: everything else arguments() depends on; arguments() -> (grid, {descriptor argument: host
    descriptor}, {name: every other argument}). With LAUNCH_PLANS through launch.run, which calls arguments() on a
    plan miss only."""
    options = LAUNCH_OPTIONS if options is None else options
    if LAUNCH_PLANS:
        def spec() -> launch.LaunchSpec:
            grid, descriptors, static = arguments()
            config = LAUNCH_CONFIG if options is LAUNCH_OPTIONS else triton.Config({}, **options)
            return launch.LaunchSpec(grid=lambda meta: grid, configs=[config], tuning_key=(),
                                     static={**descriptors, **static})
        launch.run(kernel_fn, site_key, tensors, spec)
        return
    grid, descriptors, static = arguments()
    plain = {name: t for name, t in tensors.items() if name not in descriptors}
    kernel_fn[grid](**descriptors, **plain, **static, **options)


def compile_sm90(block_q: int, block_kv: int, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                 dim: int = HEAD_DIM, emulate_exp2: Optional[bool] = None, o_through_tma: Optional[bool] = None,
                 fixed_offsets: Optional[bool] = None, check_rise: Optional[bool] = None,
                 persistent: Optional[bool] = None, claimed: Optional[bool] = None, q_buffers: Optional[int] = None):
    """Compile the kernel for sm_90 ahead of time, with no GPU (tests and benchmarks/sass tools): the compiled
    kernel for lists at (block_q, block_kv) and head dim `dim`, with the launch's tile choice (plan()), stages and
    register settings (the key blocks it walks too: SPLIT_KEY_BLOCK_DIMS); emulate_exp2, o_through_tma,
    fixed_offsets, check_rise, persistent and claimed None: as a launch at `dim` and dtype would (EMULATED_EXP2_DIMS,
    O_THROUGH_TMA, FIXED_OFFSET_DIMS, RISE_CHECKED_DTYPES, _DIMS and _CAUSAL_DIMS, PERSISTENT_DIMS, CLAIMED_DIMS
    and CLAIMED_CAUSAL_DIMS).
    Claimed items imply the persistent grid, so persistent decides only where they are not claimed (claimed=False,
    persistent=True: the items in turns). q_buffers None: as Q_BUFFER_DIMS says for the grid; the row sums from the
    tensor cores (MMA_ROW_SUM_DIMS, MMA_ROW_SUM_CAUSAL_DIMS) where the Q buffers leave room for them."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    chosen = _plan(block_kv, dim, causal)
    if fixed_offsets is not None:
        chosen = chosen._replace(fixed_offsets=fixed_offsets)
    sub_n = chosen.sub_n
    block_kv //= chosen.block_parts
    name = _GL_DTYPES[dtype][0]
    settings = _settings(chosen, dtype, dim, claimed)
    overrides = dict(EMULATE_EXP2=emulate_exp2, O_THROUGH_TMA=o_through_tma, CHECK_RISE=check_rise,
                     PERSISTENT=None if settings["CLAIMED"] else persistent)
    settings = {name: overrides[name] if overrides.get(name) is not None else value
                for name, value in settings.items()}
    settings["Q_BUFFERS"] = q_buffers or _q_buffers(chosen, dim, settings["PERSISTENT"])
    settings["MMA_SUMS"] = _mma_sums(chosen, dim, settings["Q_BUFFERS"])
    settings["RELEASE_Q"] = _releases_q_early(chosen, dim, settings["PERSISTENT"], settings["O_THROUGH_TMA"])
    constants = dict(BLOCK_Q=block_q, BLOCK_KV=block_kv, SUB_N=sub_n, TILE_N=chosen.tile_n, OVERLAP=chosen.overlap,
                     STAGES=chosen.stages(dim), CAUSAL=causal, CONSUMER_REGS=chosen.consumer_regs(),
                     LOADER_REGS=LOADER_REGS, FIXED_OFFSETS=chosen.fixed_offsets, KEY_SPLIT=chosen.key_split,
                     **settings, **_unused_arguments(chosen, settings))
    signature = {}
    for param in attention_fwd_ws_kernel.params:
        if param.name in constants:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_DESC"):
            signature[param.name] = descriptor_signature(dtype, CONSUMER_ROWS if param.name in ("Q_DESC", "O_DESC")
                                                         else sub_n, dim)
        else:
            signature[param.name] = {"Out": f"*{name}", "Q": f"*{name}", "K": f"*{name}", "V": f"*{name}",
                                     "Lse": "*fp32", "KV_COUNT": "*i32", "KV_INDEX": "*i32", "ITEM_ORDER": "*i32",
                                     "ITEM_COUNTER": "*i32", "KEY_NORMS": "*fp32",
                                     "scale_log2": "fp32"}.get(param.name, "i32")
    source = GluonASTSource(attention_fwd_ws_kernel, signature, constants)
    # with the options every launch passes (autotune.COMPILE_OPTIONS), so that what compiles here is what runs
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(chosen.launch_options(), **autotune.COMPILE_OPTIONS))
