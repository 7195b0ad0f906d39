"""How a decode step runs: single pass or split sequence, the split count, and the tile loop's
stages. One pure function of the shapes and of the device's numbers (``Device``); it asks
nothing of the extension or the GPU, so ``mmha.ops`` calls it and it never calls back.

The sizes it shares with the kernels (head dims, query-group blocks, the tile loop's constants,
the shared-memory model) come from ``mmha._constants``, generated with ``csrc/kernels/constants.h``
from one table (``csrc/kernels/table.py``); the thresholds below are the dispatcher's own.
``columns_block`` mirrors the C++ function of that name (the GPU tests compare them).

Worked example (``choose_variant``): batch 1, 32 query heads, 32 kv heads, head_dim 128, fp16,
seq_len 4096, on an H100 (132 SMs, 228 KB of shared memory per SM, 227 KB per block). A stage is
K and V of 64 keys: 2 * 64 * 128 * 2 = 32 KB. Six stages fit one block (6 * 32 + 1 + 4 = 197 KB
with the 4 KB of static arrays of one query head per block), but two blocks per SM need 3:
(3 * 32 + 1 + 4 + 1) * 2 = 204 KB <= 228 KB. So the wave is 132 * 2 = 264 items. One query head
per kv head: a base grid of 1 * 32 * 1 = 32 items; 132 // 32 = 4 splits give one per SM, and
4096 / 64 = 64 tiles allow them: ``Plan("split", 4, 3, 2)``, 128 items of 16 tiles (1024 keys)
each. With 8 kv heads (4 query heads per block): 8 base items, 132 // 8 = 16 splits of 4 tiles,
one per SM, so the ring stays at 3 stages: ``Plan("split", 16, 3, 2)``. At batch 64 the base
grid is 2048 >= 132 items: 7.76 waves, whole enough (8 waves / 1 split vs 16 / 2), two items per
SM at a time, so the ring takes 2 stages: ``Plan("single_pass", 1, 2, 2)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ._constants import (  # noqa: F401  (re-exported: the dispatcher's view of the kernels)
    EPILOGUE_COLUMNS,
    EPILOGUE_GROUP_COLUMNS,
    FUSED_TREE_NODES,
    ITEM_SLOTS_BYTES,
    MAX_SPLITS,
    MAX_STAGES,
    MIN_STAGES,
    Q_GROUP_BLOCKS,
    SUPPORTED_HEAD_DIMS,
    TILE_KEYS,
    TILE_THREADS,
    WARP_BUFFER_VALUES,
    WIDE_ALWAYS_COLUMNS,
    WIDE_COLUMNS,
    WIDE_MAX_HEAD_DIM,
    WIDE_MIN_COLUMNS,
    WIDE_MIN_ITEMS,
    int4_residual_bytes,
    int4_stage_bytes,
    tile_stage_bytes,
    tile_static_smem,
    v_whole_lines,
    wide_widened_bytes,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Cache dtypes besides the activations' own: fp8 e4m3 under fp16 / bf16 activations.
FP8 = torch.float8_e4m3fn
FP8_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
# The dispatcher's name for an int4 cache (mmha.int4): its codes' dtype, two a byte.
INT4_CODES = torch.uint8
# Shared memory the GPU reserves per resident block (sm_80 and newer).
SMEM_RESERVED_PER_BLOCK = 1024

# --- Thresholds (the only tuning knobs; docs/design.md shows the measurements behind them) ---
# Tile-loop blocks per SM the stages are sized for: two at head_dim <= 128 (one block's item
# epilogue overlaps the other's stream; the registers allow no more: 160-168 per thread, and the
# 12 warps of two blocks are 3 per SM sub-partition of 16384), one at 256 (~250 per thread).
TILE_BLOCKS_PER_SM = 2
TILE_BLOCKS_PER_SM_HD256 = 1
# Grids past one item per SM (two blocks share each SM) take SHARED_STAGES stages over 16-bit
# caches, and over fp8 caches when their items are at most SHORT_ITEM_TILES tiles: four stages
# per SM between two blocks keep enough in flight (H100, 2026-11-26, canonical grid: the 21 16-bit
# rows this moved ran 0.967-0.994x their time at 3 stages (head dim 128) or 6 (head dim 64),
# docs/data/ab_two_stages_h100.md; H200, the first such rule, for short items: B=64 Hkv=32
# S=256, 4 tiles per item, 74.1 us at 2 stages against 76.1 at 3). Longer fp8 items take
# SHARED_STAGES_FP8, the fewest at which a consumer pairs tiles (H100, 2026-11-26, decode timing,
# head dim 128, two runs each, 4 stages against 6: B=64 Hkv=32 S=1024 189.1 / 188.3 against
# 193.8 / 194.5 us, B=16 Hkv=32 S=2048 97.6 / 97.3 against 99.2 / 99.5, B=64 Hkv=8 S=1024
# 55.0 / 54.8 against 55.7 / 55.5, B=1 Hkv=32 S=16384 52.7 / 52.5 against 53.2 / 53.5; 2 or 3
# stages, unpaired, in between). Tree steps keep the deepest ring unless their items are short
# (TREE_SHORT_ITEM_TILES below; H100, 2026-11-26, `python -m mmha.bench.sweep --tree`,
# docs/data/sweep_tree_h100.json: the plan within 1.3 % of the fastest stage count on every tree
# row but the T=4 rows at 16K, 0.2-3.7 % from 2 stages over three runs, one way and the other;
# B=4 Hq=Hkv=1 D=64 T=54 at 16K 35.9 us at 5 stages against 39.5 at 2), and grids of one item per SM keep it
# (B=1 Hkv=8 S=4096, 16 splits of 4 tiles: 14.5 us at 3 stages, 14.9 at 2; B=1 Hkv=32 S=1024:
# 12.7 against 12.8).
SHORT_ITEM_TILES = 4
SHARED_STAGES = 2
SHARED_STAGES_FP8 = 4
# int8 caches (their stages hold the keys' token scales too) past one item per SM, items longer
# than SHORT_ITEM_TILES: where a resident block streams at least INT8_DEEP_RING_TILES of the
# grid's tiles, INT8_DEEP_STAGES (or the deepest ring that keeps two blocks per SM, if fewer);
# where it streams fewer, INT8_SHARED_STAGES. H200, 2026-11-29, `python -m mmha.bench.sweep
# --int8`, decode timing, head dim 128, against the 4 stages they had (docs/data/sweep_int8_h200.json):
# B=16 Hkv=8 S=32768, 256 tiles a block, 261.1 / 265.4 us at 5 against 270.9 / 270.3; B=64
# Hkv=32 S=1024 162.5 / 169.9 against 169.1 / 173.7; B=64 Hkv=32 S=4096 544.7 / 552.4 against
# 553.9 / 560.0 (6 stages: 536.7 / 542.7, but 6 loses on B=1 Hkv=32 S=65536: 139.6 against
# 137.5 at 5, and on B=64 Hkv=32 S=1024); B=16 Hkv=32 S=2048, 62 tiles a block, 80.0 against
# 81.9. Fewer tiles a block: B=16 Hkv=8 S=2048, 15.5, 27.7 / 28.7 at 3 against 29.5 / 30.2;
# B=1 Hkv=8 S=65536 (33 splits) 45.3 against 47.0; B=64 Hkv=8 S=1024 49.4 against 50.8; B=16
# Hkv=32 S=512 30.1 against 30.6; B=1 Hkv=32 S=16384 44.6 against 44.8.
INT8_DEEP_RING_TILES = 48
INT8_DEEP_STAGES = 5
INT8_SHARED_STAGES = 3
# int8 one-token items of at most SHORT_ITEM_TILES tiles past one item per SM: INT8_SHORT_STAGES
# (their stages are half a 16-bit one's, so four cost what two do there). H200, 2026-11-30,
# `python -m mmha.bench.sweep --int8` (docs/data/sweep_int8_misses_h200.json): B=64 Hkv=32 S=256,
# 4 tiles an item, 58.1 us at 4 against 63.3 at 2 (3: 60.5, 5: 59.2, 6: 60.6).
INT8_SHORT_STAGES = 4
# The CUDA-core loop (fp32 caches): resident 128-thread blocks per SM (96-148 registers, up to
# 24 KB of static shared memory), and the fewest keys a split of it should own.
SIMT_BLOCKS_PER_SM = 3
MIN_KEYS_PER_SPLIT_SIMT = 128
# Most keys one block of the CUDA-core loop should walk: one long block per (row, head) leaves
# a tail where a few blocks finish alone (H200: B=16 S=8192 525 us in one pass, 505 us in 2 splits).
MAX_KEYS_PER_SPLIT_SIMT = 4096
# A grid that already fills a wave is split only when that cuts the estimated time (waves per
# unit of work) by at least 10 %: e.g. 512 blocks on a 396-block wave run as 2 waves, the last
# one under a third full; 3 splits make 1536 blocks in 4 nearly full waves (1.33 vs 2).
SPLIT_GAIN = 0.9
# A tree step's wide item (``WIDE_COLUMNS`` columns) builds its q rows (~10 us before its first
# tile on the B=1 and B=16 T=64 1K timelines) and a split one merges, so its splits keep at least
# WIDE_MIN_SPLIT_TILES tiles. Splits that put a second block on some SMs (those blocks then share
# the SM's tensor cores) keep WIDE_DOUBLED_SPLIT_TILES tiles (int8, whose tiles cost the consumers
# more than their bytes: WIDE_DOUBLED_SPLIT_TILES_INT8), else stop at one item per SM; and a grid
# that already holds an item per SM is split (to fill the second block of each SM) only into
# splits of WIDE_SHARED_SPLIT_TILES tiles or more. H200, decode timing, Hq=32 Hkv=8, `python -m
# mmha.bench.sweep --tree --int8 --splits ...` on merge_wide (split_merge.cuh), in
# docs/data/sweep_tree_wide_merge_h200.json: B=1 T=64 1K 30.2 us at 4 splits, 35.2 at 8, 37.6 at 1;
# int8 54.7 at 4, 56.5 at 8, 73.6 at 1; 4K (its 4 x 4 form) 45.5 at 4, 49.8 at 8, int8 72.4 at 8,
# 77.2 at 4. Before it (docs/data/sweep_tree_wide_h200.json): B=1 T=64 16K 86.3 at 8 (32 tiles, 256
# items), 104.5 at 4; B=16 T=16 (128 items) 1K 47.6 at 1, 63.9 at 2; 4K 99.9 at 1, 116.2 at 2 (32
# tiles); 16K 308.7 at 2 (128 tiles), 328.9 at 1.
WIDE_MIN_SPLIT_TILES = 4
WIDE_DOUBLED_SPLIT_TILES = 16
WIDE_DOUBLED_SPLIT_TILES_INT8 = 8
WIDE_SHARED_SPLIT_TILES = 128
# int8 wide items (each tile widened in shared memory before the warpgroup's products) take
# WIDE_INT8_STAGES (the same file, before merge_wide): B=1 T=64 1K 62.1 us at 4 x 2 against 63.6 at
# 4 x 3, 4K 77.2 at 8 x 2 against 80.0 at 8 x 3; B=16 T=64 1K (the 4 x 4 form's run) 162.5 at 1 x 2 against
# 169.0 at 1 x 3.
WIDE_INT8_STAGES = 2
# A narrow tree item (fewer columns than a wide one) splits into at most ceil(tiles /
# TREE_MIN_SPLIT_TILES): each split builds its columns' q rows and writes a partial per column (T
# times a one-token item's), so a grid of one-tile splits costs more than the stream it shares.
# H200, 2026-11-29, decode timing, `python -m mmha.bench.sweep --tree` (splits x stages): B=1 Hq=32
# Hkv=8 T=4 1K (17 tiles) 16x2 13.8 / 13.8 us (the plan before), 9x2 13.4 / 13.3, 8x2 13.2-13.5,
# 4x2 14.5; the seed's B=4 Hq=Hkv=1 D=64 T=54 1K 9x2 16.1, 8x2 16.5 (so the ceiling, not the
# floor); 4K T=4 (65 tiles) 16x2 17.6 (kept), 13x2 18.2.
TREE_MIN_SPLIT_TILES = 2
# A fused tree step's narrow items (at most FUSED_TREE_NODES nodes, ``fused_tree``) check the tree
# and build its nodes' K/V in every split. Where the plan would give them at most
# FUSED_SHORT_SPLIT_TILES tiles a split past one item per SM, they keep one item per SM (16-bit
# caches; int8's tiles cost the consumers more, so its items keep the parallel splits, and fp8's,
# unmeasured, with them); and items of at most TREE_SHORT_ITEM_TILES tiles run on SHARED_STAGES
# stages whatever the grid. H200, 2026-12-03, decode timing, `python -m mmha.bench.sweep --tree`
# (three sweeps, docs/data/sweep_tree_fused_splits_h200.md), B=1 Hq=32 Hkv=8: T=4 1K (17 tiles) 9x2
# 12.2-12.3 us, 8x2 11.9-12.0, 8x3 12.0-12.2, 6x2 11.9-12.0, 6x3 12.1; int8 9x2 14.1-14.2, 8x2
# 13.9, 6x5 14.2; T=4 2K (33 tiles) 16x2 14.4, 8x2 13.4-13.5, but int8 16x2 14.9-15.2 against 8x2
# 15.6; T=4 512 5x3 11.2, 5x2 11.1, 3x3 12.4, int8 5x5 13.4, 5x2 13.0-13.4; T=2 1K 9x2 11.1, 9x3
# 11.1; T=8 1K 8x2 14.1-14.2, 4x2 14.1, 6x2 13.6-13.7; the two-launch seed tree (T=54) keeps 9x2
# (15.8 against 16.1 at 6x2).
FUSED_SHORT_SPLIT_TILES = 2
# Where two blocks share an SM, a tree step's items of at most TREE_SHORT_ITEM_TILES tiles take
# SHARED_STAGES stages (as other steps' items of SHORT_ITEM_TILES do)
# (H200, 2026-11-29, decode timing, `python -m mmha.bench.sweep --tree`, two runs each: B=1 Hq=32
# Hkv=8 T=4 4K, 16 splits of 5 tiles, 17.5 / 17.5 us at 2 stages against 18.2 / 18.2 at 3, its
# int8 twin 25.7 at 2 against 26.2 at 5; T=16 1K, 4 splits of 5, 23.2 / 23.2 against 23.4 / 23.4;
# items of 17 tiles and more keep the deeper ring: T=16 4K 34.9-35.1 either way, T=4 16K 32.2 /
# 32.7 at 3 against 32.8 / 33.2 at 2).
TREE_SHORT_ITEM_TILES = 5

VARIANTS = ("auto", "single_pass", "split")


@dataclass(frozen=True)
class Device:
    """The numbers of a GPU that dispatch depends on."""

    num_sms: int
    smem_per_sm: int  # bytes of shared memory per SM
    smem_per_block: int  # bytes one block may opt in to

    @classmethod
    def of(cls, props) -> Device:
        """From ``torch.cuda.get_device_properties(i)``."""
        return cls(props.multi_processor_count, props.shared_memory_per_multiprocessor,
                   props.shared_memory_per_block_optin)  # fmt: skip


# H100 SXM and H200: 132 SMs, 228 KB of shared memory per SM, 227 KB per block.
H100 = Device(132, 228 * 1024, 227 * 1024)
# What a cache on the reference path (no GPU) plans for: one SM of that kind.
ONE_SM = dataclasses.replace(H100, num_sms=1)


@dataclass(frozen=True)
class Plan:
    """A dispatch decision: ``variant`` is ``"single_pass"`` or ``"split"``; ``stages`` of the tile
    loop (unused by the CUDA-core loop) and the resident blocks per SM the plan counts on."""

    variant: str
    num_splits: int
    stages: int = MIN_STAGES
    blocks_per_sm: int = TILE_BLOCKS_PER_SM


def q_group_block(group: int) -> int:
    """Query heads per block for ``group = num_heads // num_kv_heads`` (mirrors the C++ pick)."""
    for qb in Q_GROUP_BLOCKS:
        if qb >= group:
            return qb
    return Q_GROUP_BLOCKS[-1]


def columns_block(
    columns: int, tree: bool = False, tiles: bool = True, head_dim: int = 128, kv_rows: int = 1,
    epilogue: bool = False,
) -> int:  # fmt: skip
    """Query columns per work item for ``columns`` columns per (row, kv head) (mirrors the C++
    ``columns_block``): ``q_group_block``, or ``WIDE_COLUMNS`` for a tree step of two or more
    nodes on the tile loop with at least ``WIDE_MIN_COLUMNS`` columns, ``head_dim <=
    WIDE_MAX_HEAD_DIM``, and either ``WIDE_ALWAYS_COLUMNS`` columns or ``WIDE_MIN_ITEMS`` wide
    items over its ``kv_rows`` (rows x kv heads); with an output epilogue ``EPILOGUE_COLUMNS``, or
    on the tile loop 1 for one column and ``EPILOGUE_GROUP_COLUMNS`` for up to that many."""
    if epilogue:
        if tiles and columns == 1:
            return 1
        return EPILOGUE_GROUP_COLUMNS if tiles and columns <= EPILOGUE_GROUP_COLUMNS else EPILOGUE_COLUMNS
    blocks = -(-columns // WIDE_COLUMNS)
    enough = columns >= WIDE_ALWAYS_COLUMNS or kv_rows * blocks >= WIDE_MIN_ITEMS
    if tree and tiles and head_dim <= WIDE_MAX_HEAD_DIM and columns >= WIDE_MIN_COLUMNS and enough:
        return WIDE_COLUMNS
    return q_group_block(columns)


# A tree step's wide items two to a block (``pair_wide_items``): two consumer warpgroups over one
# ring, so a kv head's column blocks read each tile together (the C++ pairs_wide_items says where the
# kernels can: 16-bit caches at head dims 64 and 128 on sm_90). Paired where the unpaired grid puts
# two blocks on every SM and a split streams WIDE_PAIR_MIN_TILES tiles or more. H200, 2026-12-01,
# decode timing, `bench/ab_trees.sh --tree` (the paired kernel, its warpgroups taking turns, against
# one item a block): B=16 Hq=32 Hkv=8 T=64 16K 0.917-0.934, 4K 0.936-0.945. Where the rule leaves
# them unpaired (an earlier paired form, 2026-11-30): 1K (16 tiles) 1.019-1.026 and the B=1 rows (at
# most 256 items) 1.04-1.18: where both warpgroups build their q at the same time, nothing on the SM
# multiplies, and a small grid on one block an SM leaves SMs idle.
WIDE_PAIR_MIN_TILES = 64


def pair_wide_items(
    batch: int, num_heads: int, num_kv_heads: int, nodes: int, head_dim: int, seq_len: int, splits: int,
    sms: int, tiles: bool = True, epilogue: bool = False,
) -> bool:  # fmt: skip
    """Whether a tree step's wide items run two to a block (``WIDE_PAIR_MIN_TILES``): they are
    wide, a (row, kv head) holds two or more column blocks, the unpaired grid of ``splits`` splits
    fills two blocks on each of ``sms`` SMs, and each split holds ``WIDE_PAIR_MIN_TILES`` tiles of
    ``seq_len`` keys."""
    columns = num_heads // num_kv_heads * nodes
    if nodes < 2 or columns_block(columns, True, tiles, head_dim, batch * num_kv_heads, epilogue) != WIDE_COLUMNS:
        return False
    groups = -(-columns // WIDE_COLUMNS)
    return (
        groups >= 2
        and batch * num_kv_heads * groups * splits >= 2 * sms
        and -(-seq_len // TILE_KEYS) // splits >= WIDE_PAIR_MIN_TILES
    )


def base_blocks(batch: int, num_heads: int, num_kv_heads: int, qb: int | None = None) -> int:
    """Blocks of an unsplit grid: one per (row, kv head, query-head block of ``qb``)."""
    group = num_heads // num_kv_heads
    return batch * num_kv_heads * math.ceil(group / (qb or q_group_block(group)))


def uses_tensor_cores(kv_dtype: torch.dtype) -> bool:
    """Whether the kernel runs its tile loop for caches of ``kv_dtype`` (mirrors
    ``uses_tensor_cores`` in C++)."""
    return kv_dtype != torch.float32


def check_kv_dtype(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Caches hold the activations' dtype, fp8 e4m3 under fp16 / bf16 activations, int8 (codes
    with per-token scales; the kernel takes them under fp16 / bf16 activations) or int4 codes
    (``INT4_CODES``, under fp16 / bf16 activations)."""
    if kv_dtype in (dtype, torch.int8):
        return
    if kv_dtype == INT4_CODES:
        if dtype not in FP8_ACTIVATION_DTYPES:
            raise ValueError(f"dtype must be float16 or bfloat16 with an int4 cache, got {dtype}")
        return
    if kv_dtype != FP8:
        raise ValueError(
            f"kv_dtype must be {dtype} (the activations' dtype), {FP8} or torch.int8, got {kv_dtype}"
        )
    if dtype not in FP8_ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16 with an fp8 ({FP8}) cache, got {dtype}")


# In the functions below elem_bytes is the cache element's size (stages), act_bytes the
# activations' (static arrays: staged q and new token; defaults to elem_bytes), token_scales
# whether the stages also hold their keys' scales (int8 caches) and int4 whether the cache is an
# int4 one (stages of its own layout, and its residual area after them).


def stage_bytes(head_dim: int, elem_bytes: int, token_scales: bool = False, int4: bool = False) -> int:
    """One stage of the tile loop's ring."""
    return int4_stage_bytes(head_dim) if int4 else tile_stage_bytes(head_dim, elem_bytes, token_scales)


def extra_smem(head_dim: int, qb: int, token_scales: bool = False, int4: bool = False) -> int:
    """Dynamic shared memory of a tile-loop block past its stages (mirrors ``cache_extra_bytes``):
    an int4 cache's residual area, an int8 cache's widened tile on wide items."""
    return int4_residual_bytes(head_dim) if int4 else wide_widened_bytes(head_dim, token_scales, qb)


def tile_block_smem(
    head_dim: int, elem_bytes: int, stages: int, qb: int = 8, act_bytes: int | None = None,
    token_scales: bool = False, int4: bool = False,
) -> int:  # fmt: skip
    """Shared memory of one tile-loop block, at most: stages, alignment slack, static arrays."""
    static = tile_static_smem(head_dim, act_bytes or elem_bytes, qb)
    extra = extra_smem(head_dim, qb, token_scales, int4)
    return stages * stage_bytes(head_dim, elem_bytes, token_scales, int4) + 1024 + static + extra


def tile_blocks_per_sm(
    head_dim: int, elem_bytes: int, stages: int, device: Device, qb: int = 8, act_bytes: int | None = None,
    token_scales: bool = False, int4: bool = False,
) -> int:  # fmt: skip
    """Tile-loop blocks with ``stages`` stages that fit one SM's shared memory."""
    smem = tile_block_smem(head_dim, elem_bytes, stages, qb, act_bytes, token_scales, int4)
    if smem > device.smem_per_block:
        return 0
    return device.smem_per_sm // (smem + SMEM_RESERVED_PER_BLOCK)


def max_stages(
    head_dim: int, elem_bytes: int, device: Device, qb: int = 8, act_bytes: int | None = None,
    token_scales: bool = False, int4: bool = False,
) -> int:  # fmt: skip
    """Most stages one block of this head dim may take (what the operator accepts)."""
    fixed = 1024 + tile_static_smem(head_dim, act_bytes or elem_bytes, qb)
    fixed += extra_smem(head_dim, qb, token_scales, int4)
    stage = stage_bytes(head_dim, elem_bytes, token_scales, int4)
    return min(MAX_STAGES, (device.smem_per_block - fixed) // stage)


def tile_stages(
    head_dim: int, elem_bytes: int, device: Device, qb: int = 8, target: int | None = None,
    act_bytes: int | None = None, token_scales: bool = False, int4: bool = False,
) -> tuple[int, int]:  # fmt: skip
    """``(stages, blocks per SM)``: the deepest ring that keeps ``target`` blocks per SM (by
    default ``TILE_BLOCKS_PER_SM``, one at head_dim 256)."""
    if target is None:
        target = TILE_BLOCKS_PER_SM if head_dim <= 128 else TILE_BLOCKS_PER_SM_HD256

    def fits(stages: int) -> int:
        return tile_blocks_per_sm(head_dim, elem_bytes, stages, device, qb, act_bytes, token_scales, int4)

    most = max_stages(head_dim, elem_bytes, device, qb, act_bytes, token_scales, int4)
    for stages in range(most, MIN_STAGES - 1, -1):
        if fits(stages) >= target:
            return stages, target
    return MIN_STAGES, max(1, fits(MIN_STAGES))


def wave_cost(blocks: int, wave: int) -> int:
    """Waves a grid of ``blocks`` equal blocks takes when ``wave`` run at once."""
    return -(-blocks // wave)


def wave_splits(base: int, wave: int, allowed: int) -> int:
    """Splits of a grid of ``base`` items that fills a wave: the count that lowers
    ``ceil(items * s / wave) / s`` by at least ``1 - SPLIT_GAIN`` over the last one kept."""
    splits = 1
    for s in range(2, allowed + 1):
        if wave_cost(base * s, wave) / s < SPLIT_GAIN * wave_cost(base * splits, wave) / splits:
            splits = s
    return splits


def keys_read(seq_len: int, window: int | None = None) -> int:
    """Keys a row of ``seq_len`` keys (the new one included) reads with a sliding ``window``: the
    window's keys and the rest of the tile its first key falls in (what dispatch plans for)."""
    if window is None or window <= 0:
        return seq_len
    return min(seq_len, window + TILE_KEYS - 1)


def _check_shapes(variant, head_dim, dtype, kv_dtype, num_heads, num_kv_heads) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"Unsupported head_dim: {head_dim} (supported: {SUPPORTED_HEAD_DIMS})")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    check_kv_dtype(dtype, kv_dtype)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")


def _tile_plan(
    head_dim, elem, act, device, sms, qb, seq_len, tree, token_scales=False, int4=False
) -> tuple[int, int, int, int]:
    """The tile loop's ``(stages, blocks per SM, splits allowed, items that fill the GPU)``.

    Small grids get one item per SM: filling two per SM measured slower (H200, decode timing: B=1
    Hkv=8 S=4096 13.1 us at 16 splits against 15.5 at 33; B=16 Hkv=8 S=2048 39.0 in one pass
    against 41.5 at 2 splits). fp8 tiles cost the consumers as much work for half the bytes, so one
    block's consumers per SM cannot keep up: fp8 grids fill every resident block (H200: B=16 Hkv=8
    S=32768 ran at 61 % of the fp8 floor with one item per SM). Tree steps' items (several nodes'
    columns, each built at its own rotary position and masked on the tree's slots) fill every
    resident block too (H200, decode timing: B=1 Hq=32 Hkv=8 T=16 at 4K 44.6 us at 4 splits
    against 55.5 at 2, at 16K 93.8 against 138.7; T=4 at 16K 48.4 at 16 splits against 55.0 at 8;
    the seed's B=4 T=54 at 16K 46.8 at 8 splits against 67.5 at 4)."""
    stages, blocks_per_sm = tile_stages(
        head_dim, elem, device, qb, act_bytes=act, token_scales=token_scales, int4=int4
    )
    if tree and token_scales and qb == WIDE_COLUMNS:  # int8 wide items: WIDE_INT8_STAGES
        stages = min(stages, WIDE_INT8_STAGES)
    allowed = max(1, min(MAX_SPLITS, -(-seq_len // TILE_KEYS)))
    fill = sms * (blocks_per_sm if elem == 1 or tree else 1)
    return stages, blocks_per_sm, allowed, fill


def _shared_stages(
    stages: int, tiles_per_item: int, elem: int, tree: bool, token_scales: bool = False, block_tiles: int = 0
) -> int:
    """The ring of a grid where two blocks share each SM (``SHARED_STAGES``, ``SHARED_STAGES_FP8``;
    an int8 cache's ``INT8_SHORT_STAGES`` over short one-token items, ``INT8_DEEP_STAGES`` where a
    resident block streams ``INT8_DEEP_RING_TILES`` of the grid's tiles or more, ``block_tiles``,
    else ``INT8_SHARED_STAGES``)."""
    short = TREE_SHORT_ITEM_TILES if tree else SHORT_ITEM_TILES
    if token_scales and not tree and tiles_per_item <= short:
        return min(stages, INT8_SHORT_STAGES)
    if tiles_per_item <= short or (elem == 2 and not tree):
        return min(stages, SHARED_STAGES)
    if token_scales and not tree:
        return min(stages, INT8_DEEP_STAGES if block_tiles >= INT8_DEEP_RING_TILES else INT8_SHARED_STAGES)
    if elem == 1 and not tree:
        return min(stages, SHARED_STAGES_FP8)
    return stages


def _loop_plan(tiles, head_dim, elem, dtype, kv_dtype, device, sms, qb, seq_len, tree) -> tuple[int, int, int, int]:
    """``(stages, blocks per SM, splits allowed, items that fill the GPU)``: the tile loop's
    (``_tile_plan``), or the CUDA-core loop's (``SIMT_BLOCKS_PER_SM``, splits of
    ``MIN_KEYS_PER_SPLIT_SIMT`` keys)."""
    if tiles:
        act = torch.empty((), dtype=dtype).element_size()
        return _tile_plan(
            head_dim, elem, act, device, sms, qb, seq_len, tree, token_scales=kv_dtype == torch.int8,
            int4=kv_dtype == INT4_CODES,
        )  # fmt: skip
    allowed = max(1, min(MAX_SPLITS, seq_len // MIN_KEYS_PER_SPLIT_SIMT))
    return MIN_STAGES, SIMT_BLOCKS_PER_SM, allowed, sms * SIMT_BLOCKS_PER_SM


def _grid_stages(stages, shared, base, splits, grains, sms, blocks_per_sm, elem, tree, kv_dtype, fused) -> int:
    """The ring of the planned grid: ``_shared_stages`` where two blocks share an SM (``shared``),
    else ``SHARED_STAGES`` for a fused tree's items of at most ``TREE_SHORT_ITEM_TILES`` tiles."""
    if shared:
        block_tiles = base * grains // (sms * blocks_per_sm)
        return _shared_stages(stages, -(-grains // splits), elem, tree, kv_dtype == torch.int8, block_tiles)
    if fused and -(-grains // splits) <= TREE_SHORT_ITEM_TILES:
        return min(stages, SHARED_STAGES)
    return stages


def fused_tree(nodes: int, qb: int, kv_dtype: torch.dtype, epilogue: bool = False) -> bool:
    """Whether a tree step of ``nodes`` nodes on items of ``qb`` columns is checked and appended in
    the attention launch itself (mirrors the C++ ``kFusedTrees`` and ``launch_fused_tree``'s node
    count): narrow items of two or more columns over a 16-bit, fp8 or int8 cache, no epilogue."""
    return (
        1 < nodes <= FUSED_TREE_NODES and 1 < qb != WIDE_COLUMNS and not epilogue
        and uses_tensor_cores(kv_dtype) and kv_dtype != INT4_CODES
    )  # fmt: skip


def _tree_splits_allowed(allowed: int, grains: int, wide: bool) -> int:
    """The most splits a tree step's items of ``grains`` tiles take: a wide item's splits hold
    ``WIDE_MIN_SPLIT_TILES`` tiles, a narrow item's ``TREE_MIN_SPLIT_TILES`` on average."""
    if wide:
        return max(1, min(allowed, grains // WIDE_MIN_SPLIT_TILES))
    return max(1, min(allowed, -(-grains // TREE_MIN_SPLIT_TILES)))


def _fused_short_splits(base: int, sms: int, splits: int, grains: int, elem: int) -> int:
    """The planned ``splits`` of ``base`` fused tree items of ``grains`` tiles: cut to one item per
    SM where each split would hold at most ``FUSED_SHORT_SPLIT_TILES`` tiles past it (caches of
    ``elem`` = 2 bytes a value only), else as they are."""
    if elem != 2 or base * splits <= sms or grains // splits > FUSED_SHORT_SPLIT_TILES:
        return splits
    return max(1, min(splits, sms // base))


def _wide_shared_splits(base: int, sms: int, splits: int, grains: int, int8: bool) -> int:
    """The planned ``splits`` of ``base`` wide items of ``grains`` tiles, where they put two blocks
    on some SMs: kept if each split holds ``WIDE_SHARED_SPLIT_TILES`` tiles (a grid of more than
    half an item per SM already) or ``WIDE_DOUBLED_SPLIT_TILES`` (``_INT8``), else cut to the most
    that keep one item per SM (at least 1); splits that keep one item per SM stay as they are."""
    if splits == 1 or base * splits <= sms:
        return splits
    need = (
        WIDE_SHARED_SPLIT_TILES
        if 2 * base > sms
        else WIDE_DOUBLED_SPLIT_TILES_INT8
        if int8
        else WIDE_DOUBLED_SPLIT_TILES
    )
    if grains // splits >= need:
        return splits
    return max(1, min(splits, sms // base))


def choose_variant(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    dtype: torch.dtype,
    device: Device = H100,
    variant: str = "auto",
    kv_dtype: torch.dtype | None = None,
    tree: bool = False,
    epilogue: bool = False,
    nodes: int = 0,
) -> Plan:
    """Pick single pass or split sequence, the split count and the stages, from shapes alone
    (the module docstring works an example by hand).

    ``seq_len`` is the longest sequence the step may see: the host-side maximum of the lengths
    (plus the new token) in eager use, or the cache capacity when the step is captured in a CUDA
    graph, so no device value is ever read. The result depends only on the arguments.

    Tile loop (fp16 / bf16 / fp8 caches): the step is cut into items, one per (row, kv head,
    query-head block, split), walked by a grid of resident blocks. The ring gets the most stages
    that still let ``TILE_BLOCKS_PER_SM`` blocks share an SM (one at head_dim 256), so a wave
    holds ``num_sms * blocks_per_sm`` items; grids of more than one item per SM take fewer
    (``_shared_stages``). If the base grid (one item per row, kv head and query-head block) has
    fewer items than fill the GPU (``_tile_plan``), the sequence is cut into as many splits as
    fill it, at most one per tile of ``TILE_KEYS`` keys. Otherwise a partial last wave still idles
    SMs: the sequence is split when that lowers ``ceil(items * s / wave) / s`` by at least ``1 -
    SPLIT_GAIN``. A tree step's wide items split into no fewer than ``WIDE_MIN_SPLIT_TILES``
    tiles, past one item per SM into ``WIDE_DOUBLED_SPLIT_TILES`` (``_INT8``) or, where the unsplit
    grid holds over half an item per SM, ``WIDE_SHARED_SPLIT_TILES``; its narrow items into at
    most ``ceil(tiles / TREE_MIN_SPLIT_TILES)`` splits. Never more than
    ``MAX_SPLITS`` splits; the kernel cuts a row of n tiles into splits of ``n // s`` or
    ``n // s + 1`` tiles. CUDA-core loop (fp32), one block per item:
    ``SIMT_BLOCKS_PER_SM`` blocks per SM, a grid smaller than a wave split to fill it, splits of
    ``MIN_KEYS_PER_SPLIT_SIMT`` to ``MAX_KEYS_PER_SPLIT_SIMT`` keys.

    ``variant`` forces ``"single_pass"`` (1 split) or ``"split"`` (at least 2 splits);
    ``kv_dtype``: the caches' dtype (default ``dtype``); ``tree``: a tree step of two or more
    nodes, whose ``num_heads`` counts (node, head) columns (``Hq * T``; wide items from
    ``WIDE_MIN_COLUMNS`` columns per kv head, ``columns_block``); ``epilogue``: the step has an
    output epilogue (items of 1, ``EPILOGUE_GROUP_COLUMNS`` or ``EPILOGUE_COLUMNS`` columns);
    ``nodes``: a tree step's node count where the caller knows it (0: not given; 2 or more is a
    tree step, as ``tree``), so that a fused tree's short items (``fused_tree``) keep one item per SM
    (``FUSED_SHORT_SPLIT_TILES``) and two stages.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    tree = tree or nodes > 1
    _check_shapes(variant, head_dim, dtype, kv_dtype, num_heads, num_kv_heads)
    seq_len = max(1, seq_len)
    sms = max(1, device.num_sms)
    tiles = uses_tensor_cores(kv_dtype)
    qb = columns_block(num_heads // num_kv_heads, tree, tiles, head_dim, batch * num_kv_heads, epilogue)
    base = base_blocks(batch, num_heads, num_kv_heads, qb)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    stages, blocks_per_sm, allowed, fill = _loop_plan(tiles, head_dim, elem, dtype, kv_dtype, device, sms, qb,
                                                      seq_len, tree)  # fmt: skip
    grains = -(-seq_len // TILE_KEYS)
    wide = tiles and qb == WIDE_COLUMNS and not epilogue
    if tree and tiles:
        allowed = _tree_splits_allowed(allowed, grains, wide)
    if variant == "single_pass":
        splits = 1
    elif base < fill:
        splits = max(1, min(allowed, fill // base))
    else:
        splits = wave_splits(base, sms * blocks_per_sm, allowed)
    splits = _wide_shared_splits(base, sms, splits, grains, kv_dtype == torch.int8) if wide else splits
    fused = fused_tree(nodes, qb, kv_dtype, epilogue)
    if fused and variant == "auto":
        splits = _fused_short_splits(base, sms, splits, grains, elem)
    shared = tiles and head_dim <= 128 and base * splits > sms  # two blocks share an SM
    stages = _grid_stages(stages, shared, base, splits, grains, sms, blocks_per_sm, elem, tree, kv_dtype, fused)
    if not tiles and variant != "single_pass":
        splits = max(splits, min(MAX_SPLITS, -(-seq_len // MAX_KEYS_PER_SPLIT_SIMT)))
    if variant == "split":
        splits = max(2, splits)
    return Plan("single_pass" if splits == 1 else "split", splits, stages, blocks_per_sm)
