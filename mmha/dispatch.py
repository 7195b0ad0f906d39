"""Which kernel variant runs, and with how many sequence splits: one pure function.

The C++ side holds the same constants in ``csrc/kernels/mmha_params.h``;
``tests/test_dispatch.py`` checks that both agree when the extension is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Query heads handled by one block (K/V of a kv head is read once per block).
Q_GROUP_BLOCKS = (1, 2, 4, 8)
MAX_SPLITS = 64
# Warps per block: WARPS everywhere the CUDA-core loop runs; the tensor-core loop also runs
# blocks of any of WARP_CHOICES.
WARPS = 4
WARP_CHOICES = (4, 8, 16)

# --- Thresholds (the only tuning knobs; docs/design.md shows the measurements behind them) ---
# Resident blocks per SM when the caller cannot ask the device (ops.blocks_per_sm does):
# 128-thread blocks of 128-200 registers fit 2-4 per SM.
DEFAULT_BLOCKS_PER_SM = 4
# Fewest keys a split should own: below this the partial write and merge cost more than the
# extra parallelism buys. Blocks of several query heads on the tensor-core loop need more (their
# prologue, partials and merge are per head): B=1 Hkv=8 S=4096 on the H200, 18.6 us at 16 splits
# of 256 keys, 20.2 us at 32 of 128; one head per block does better at 128 (B=1 Hkv=32 S=1024:
# 15.1 us at 8 splits, 16.1 at 4).
MIN_KEYS_PER_SPLIT = 128
MIN_KEYS_PER_SPLIT_GROUPED = 256
# Most keys one block of the CUDA-core loop (fp32 caches, head_dim 256) should walk: one long
# block per (row, head) leaves a tail where a few blocks finish alone (H200, measured when that
# loop still ran fp16 MHA at head_dim 128: B=16 S=8192 525 us in one pass, 505 us in 2 splits;
# B=16 S=32768 1993 vs 1937 us in 8; B=64 S=16384 3910 vs 3873 us in 4).
MAX_KEYS_PER_SPLIT_CUDA_CORES = 4096
# The same for 4-warp tensor-core blocks of one query head: in three split sweeps (H200, time
# relative to one pass) B=64 S=16384 took 0.973 / 0.988 / 0.974 at 8 splits of 2048 keys, B=16
# S=32768 0.995 / 0.996 / 0.976 at 16; at 4096 keys neither gained (0.989 / 1.005 / 0.990, 1.004
# / 1.002 / 0.990), nor did B=16 S=8192 and B=64 S=4096 at 2048 (1.003 / 1.005 / 0.994, 0.997 /
# 0.997 / 1.007). Grouped blocks gain nothing from it (B=16 Hkv=8 S=32768 at 8 splits of 4 warps:
# level with one pass of 16).
MAX_KEYS_PER_SPLIT_ONE_HEAD = 2048
# A small grid of blocks of several query heads on the tensor-core loop is split to fill this
# many blocks per SM, not its full occupancy (4 at head_dim 128; measured when it was 3): fewer,
# longer blocks do better there (H200: B=1 Hkv=8 S=65536 84.6 us at 33 splits vs 87.4 at 49;
# Hkv=4 61.0 vs 65.0 at 64; B=16 Hkv=8 D=64 S=2048 31.6 at 2 vs 32.4 at 5). One head per block
# fills the whole wave (B=1 Hkv=32 S=4096: 30.4 us at 16 splits, 31.0 at 8). A grid that fills
# a wave is judged against the full occupancy.
FILL_BLOCKS_PER_SM_GROUPED = 2
# Wide blocks (tensor-core loop): where a grid of WIDE_WARPS-warp blocks fits the fill above in
# blocks of WIDE_WARPS warps (grouped: one per SM; one query head per block: one wave of them),
# it runs as those, with fewer splits for the same warps per SM: fewer prologues, partials and
# merge inputs (H200, split sweep in docs/design.md: B=1 Hkv=8 S=4096 17.2 us at 16 splits of
# 8 warps vs 19.7 at 16 of 4; B=16 Hkv=8 S=2048 48.6 us in one pass of 8 warps vs 52.9 at 2
# splits of 4; B=16 Hq=Hkv=16 D=64 S=1024 29.9 vs 31.5). A wide block's split keeps at least
# KEYS_PER_WARP keys per warp (two 16-key steps: with one, B=1 Hq=Hkv=32 S=1024 took 16.5 us at
# 8 splits of 8 warps, 15.6 at 4).
WIDE_WARPS = 8
KEYS_PER_WARP = 32
# Grouped wide blocks (one per SM) take DEEP_WARPS warps where each still walks at least
# DEEP_KEYS_PER_WARP keys: level to 2.5 % faster than 8 there in three runs (B=16 Hkv=8 S=2048
# 47.8 vs 49.0 us, S=32768 481.8 vs 483.7, B=1 S=65536 79.8 vs 80.6 at 16 splits), slower with
# one step per warp (B=1 Hkv=8 S=4096 at 16 splits: 18.6 vs 17.2). One head per block keeps 8
# (16 warps was level or up to 3 % slower on the B=1 MHA rows).
DEEP_WARPS = 16
DEEP_KEYS_PER_WARP = 128
# A grid that already fills a wave is split only when that cuts the estimated time (waves per
# unit of work) by at least 10 %: e.g. 512 blocks on a 396-block wave run as 2 waves, the last
# one under a third full; 3 splits make 1536 blocks in 4 nearly full waves (1.33 vs 2).
SPLIT_GAIN = 0.9

VARIANTS = ("auto", "single_pass", "split")


@dataclass(frozen=True)
class Plan:
    """A dispatch decision: ``variant`` is ``"single_pass"`` or ``"split"``; ``warps`` per block."""

    variant: str
    num_splits: int
    warps: int = WARPS


def q_group_block(group: int) -> int:
    """Query heads per block for ``group = num_heads // num_kv_heads`` (mirrors the C++ pick)."""
    for qb in Q_GROUP_BLOCKS:
        if qb >= group:
            return qb
    return Q_GROUP_BLOCKS[-1]


def base_blocks(batch: int, num_heads: int, num_kv_heads: int) -> int:
    """Blocks of an unsplit grid: one per (row, kv head, query-head block)."""
    group = num_heads // num_kv_heads
    return batch * num_kv_heads * math.ceil(group / q_group_block(group))


def uses_tensor_cores(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs its tensor-core loop (mirrors ``kUseTensorCores`` in C++)."""
    return dtype != torch.float32 and head_dim <= 128


def choose_variant(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    dtype: torch.dtype,
    num_sms: int,
    variant: str = "auto",
    blocks_per_sm: int = DEFAULT_BLOCKS_PER_SM,
    wide_blocks_per_sm: int | None = None,
) -> Plan:
    """Pick single pass or split sequence, the split count and warps per block, from shapes alone.

    ``seq_len`` is the longest sequence the step may see: the host-side maximum of the lengths
    (plus the new token) in eager use, or the cache capacity when the step is captured in a CUDA
    graph, so no device value is ever read. ``blocks_per_sm`` is the kernel's occupancy on the
    device (``mmha.ops.blocks_per_sm``), ``wide_blocks_per_sm`` that of ``WIDE_WARPS``-warp blocks
    (default: the same warps per SM). The result depends only on the arguments.

    The base grid has one block per (row, kv head, query-head block). One wave holds
    ``num_sms * blocks_per_sm`` blocks. If the base grid is smaller than a wave, the sequence is
    cut into as many splits as still fit in one wave (a second, partial wave would leave most
    SMs idle at the end); for blocks of several query heads on the tensor-core loop ("grouped")
    that wave is counted at ``FILL_BLOCKS_PER_SM_GROUPED`` blocks per SM at most. If it already
    fills a wave, a partial last wave still idles SMs: the grid is split when that lowers
    ``ceil(blocks * s / wave) / s`` (time in units of one block's work) by at least
    ``1 - SPLIT_GAIN``. Splits never get shorter than ``MIN_KEYS_PER_SPLIT`` keys
    (``MIN_KEYS_PER_SPLIT_GROUPED`` when grouped), and never number more than ``MAX_SPLITS``. On
    the CUDA-core loop a block walks at most ``MAX_KEYS_PER_SPLIT_CUDA_CORES`` keys (more splits
    where needed, up to ``MAX_SPLITS``), a 4-warp tensor-core block of one query head at most
    ``MAX_KEYS_PER_SPLIT_ONE_HEAD``.

    On the tensor-core loop a grid smaller than a wave runs as blocks of ``WIDE_WARPS`` warps
    where those fit the same fill: grouped, a base grid of at most one block per SM, filled to
    one per SM; one query head per block, a base grid of at most one wave of wide blocks, filled
    to that wave. Their splits keep ``max(min keys, KEYS_PER_WARP * WIDE_WARPS)`` keys; grouped
    blocks whose split gives each of ``DEEP_WARPS`` warps ``DEEP_KEYS_PER_WARP`` keys take that
    many warps.

    Worked example: batch 1, 32 query heads, 32 kv heads, head_dim 128, fp16, seq_len 4096, on a
    132-SM H100 where the kernel fits 4 blocks of 4 warps or 2 of 8 per SM. Group 1, so one query
    head per block and a base grid of 1 * 32 * 1 = 32 blocks, inside a wave of 132 * 2 = 264
    8-warp blocks: 264 // 32 = 8 splits fit; 4096 // max(128, 32 * 8) = 16 allows up to 16.
    Result: ``Plan("split", 8, 8)``, a grid of 256 blocks of 8 warps. The kernel gives each
    split ceil(4096 / 8) = 512 keys (a whole number of 16-key warp steps). With 8 kv heads
    (group 4, grouped): 8 base blocks, one per SM gives 132 // 8 = 16 splits, 4096 // 256 = 16
    allows 16: ``Plan("split", 16, 8)`` (256 keys per split, short of 16 * 128 for 16 warps). At
    batch 64 the base grid is 2048 >= 528 blocks of 4 warps, which takes 4 waves, whole: no split
    for the waves, but 4096 // 2048 = 2 for the key cap: ``Plan("split", 2)``.

    ``variant`` forces ``"single_pass"`` (1 split; wide blocks where the rule above would use
    them) or ``"split"`` (at least 2 splits, blocks of 4 warps).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"Unsupported head_dim: {head_dim} (supported: {SUPPORTED_HEAD_DIMS})")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    tensor_cores = uses_tensor_cores(head_dim, dtype)
    grouped = tensor_cores and q_group_block(group) >= 2
    base = base_blocks(batch, num_heads, num_kv_heads)
    num_sms, blocks_per_sm = max(1, num_sms), max(1, blocks_per_sm)
    wave = num_sms * blocks_per_sm
    min_keys = MIN_KEYS_PER_SPLIT_GROUPED if grouped else MIN_KEYS_PER_SPLIT
    if tensor_cores and base < wave and variant != "split":
        if wide_blocks_per_sm is None:
            wide_blocks_per_sm = blocks_per_sm * WARPS // WIDE_WARPS
        wide_fill = num_sms * (1 if grouped else max(1, wide_blocks_per_sm))
        if base <= wide_fill:
            wide_keys = max(min_keys, KEYS_PER_WARP * WIDE_WARPS)
            wide_allowed = max(1, min(MAX_SPLITS, seq_len // wide_keys))
            splits = 1 if variant == "single_pass" else max(1, min(wide_allowed, wide_fill // base))
            deep = grouped and seq_len // splits >= DEEP_WARPS * DEEP_KEYS_PER_WARP
            return Plan("single_pass" if splits == 1 else "split", splits, DEEP_WARPS if deep else WIDE_WARPS)
    if variant == "single_pass":
        return Plan("single_pass", 1)
    allowed = max(1, min(MAX_SPLITS, seq_len // min_keys))
    if base < wave:
        # Fill one wave: as many splits as still fit.
        fill = wave
        if grouped:
            fill = max(1, num_sms) * max(1, min(blocks_per_sm, FILL_BLOCKS_PER_SM_GROUPED))
        splits = max(1, min(allowed, fill // base))
    else:
        splits = 1
        for s in range(2, allowed + 1):
            if wave_cost(base * s, wave) / s < SPLIT_GAIN * wave_cost(base * splits, wave) / splits:
                splits = s
    if not tensor_cores:
        splits = max(splits, min(MAX_SPLITS, -(-seq_len // MAX_KEYS_PER_SPLIT_CUDA_CORES)))
    elif not grouped:
        splits = max(splits, min(MAX_SPLITS, -(-seq_len // MAX_KEYS_PER_SPLIT_ONE_HEAD)))
    if variant == "split":
        return Plan("split", max(2, splits))
    if splits <= 1:
        return Plan("single_pass", 1)
    return Plan("split", splits)


def wave_cost(blocks: int, wave: int) -> int:
    """Waves a grid of ``blocks`` equal blocks takes when ``wave`` run at once."""
    return -(-blocks // wave)
