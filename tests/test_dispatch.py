"""choose_variant on a table of cases; its occupancy model; the C++ columns_block is the
dispatcher's (and, on a GPU, the occupancy the dispatcher counts on is what the compiled kernel gets)."""

from pathlib import Path

import pytest
import torch

from mmha import dispatch
from mmha._ext import _C

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
H100 = dispatch.H100
A100 = dispatch.Device(108, 164 * 1024, 163 * 1024)

# (batch, Hq, Hkv, D, seq_len, dtype, device, expected)
CASES = [
    # The docstring's examples: 3 stages of 32 KB let two blocks share an SM; small grids get one
    # item per SM; grids of more than one item per SM 2 stages (16-bit caches, or short items).
    (1, 32, 32, 128, 4096, F16, H100, dispatch.Plan("split", 4, 3, 2)),  # 132 // 32, 16 tiles each
    (1, 32, 8, 128, 4096, F16, H100, dispatch.Plan("split", 16, 3, 2)),  # 132 // 8, 4 tiles each
    (64, 32, 32, 128, 4096, F16, H100, dispatch.Plan("single_pass", 1, 2, 2)),  # 2048 items
    (64, 32, 32, 128, 256, F16, H100, dispatch.Plan("single_pass", 1, 2, 2)),  # 4 tiles per item
    # Splits of at least one 64-key tile.
    (1, 32, 32, 128, 100, F16, H100, dispatch.Plan("split", 2, 3, 2)),
    (1, 32, 32, 128, 64, F16, H100, dispatch.Plan("single_pass", 1, 3, 2)),
    (1, 32, 8, 128, 256, BF16, H100, dispatch.Plan("split", 4, 3, 2)),
    # Long rows on a small grid: one item per SM.
    (1, 32, 32, 128, 65536, F16, H100, dispatch.Plan("split", 4, 3, 2)),
    (1, 32, 4, 128, 65536, F16, H100, dispatch.Plan("split", 33, 3, 2)),  # 132 // 4
    (16, 32, 8, 128, 2048, F16, H100, dispatch.Plan("single_pass", 1, 3, 2)),  # 128 items < 132
    (16, 32, 32, 128, 512, F16, H100, dispatch.Plan("single_pass", 1, 2, 2)),  # 512 items: 2 waves
    # MQA: 4 items of 8 query heads per row; 132 // 4 = 33 splits of 4 tiles, one item per SM.
    (1, 32, 1, 128, 8192, F16, H100, dispatch.Plan("split", 33, 3, 2)),
    # A grid past one wave: 512 items on a 264-item wave are 2 waves, 1.94 full: no split.
    (64, 32, 8, 128, 1024, F16, H100, dispatch.Plan("single_pass", 1, 2, 2)),
    # 300 items: 2 waves, the second 14 % full; 6 splits make 7 nearly full waves (7/6 vs 2).
    (300, 8, 1, 128, 4096, F16, H100, dispatch.Plan("split", 6, 2, 2)),
    # Other head dims: the deepest ring that keeps two blocks per SM (one at 256).
    (16, 32, 8, 64, 2048, F16, H100, dispatch.Plan("single_pass", 1, 6, 2)),
    (16, 32, 8, 256, 2048, F16, H100, dispatch.Plan("single_pass", 1, 3, 1)),  # 128 items, 132 SMs
    (16, 32, 32, 96, 2048, BF16, H100, dispatch.Plan("single_pass", 1, 2, 2)),  # 512 items
    (1, 32, 32, 96, 4096, BF16, H100, dispatch.Plan("split", 4, 4, 2)),  # 128 items: padded V rows
    (16, 16, 16, 64, 1024, F16, H100, dispatch.Plan("single_pass", 1, 2, 2)),  # 256 items
    # A GPU with less shared memory per SM (A100: 164 KB): 108 // 32 = 3 splits, 2 stages.
    (1, 32, 32, 128, 4096, F16, A100, dispatch.Plan("split", 3, 2, 2)),
    # CUDA-core loop (fp32): 3 blocks per SM, splits of >= 128 keys, blocks of <= 4096 keys.
    (1, 32, 32, 128, 1024, F32, H100, dispatch.Plan("split", 8, 2, 3)),
    (16, 32, 32, 256, 32768, F32, H100, dispatch.Plan("split", 8, 2, 3)),
    (64, 32, 32, 128, 4096, F32, H100, dispatch.Plan("split", 3, 2, 3)),  # 6 waves -> 16 / 3
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"B{c[0]}_Hq{c[1]}_Hkv{c[2]}_D{c[3]}_S{c[4]}_{c[5]}_{c[6].num_sms}"
)
def test_choose_variant_table(case):
    b, hq, hkv, d, s, dtype, dev, expected = case
    assert dispatch.choose_variant(b, hq, hkv, d, s, dtype, dev) == expected


def test_occupancy_model():
    assert dispatch.tile_stage_bytes(128, 2, False) == 32768
    assert dispatch.tile_stage_bytes(64, 2, False) == 16384
    assert dispatch.tile_stage_bytes(80, 2, False) == 21504  # V rows of 88 elements, rounded to 1 KB
    # int8: K and V codes and the 64 keys' K and V scales (512 bytes), rounded to 1 KB.
    assert dispatch.tile_stage_bytes(128, 1, True) == 16384 + 1024
    assert dispatch.max_stages(128, 1, H100, token_scales=True) <= dispatch.max_stages(128, 1, H100)
    assert dispatch.max_stages(128, 2, H100) == 6
    assert dispatch.max_stages(256, 2, H100) == 3
    assert dispatch.max_stages(64, 2, H100) == dispatch.MAX_STAGES
    assert [dispatch.tile_blocks_per_sm(128, 2, s, H100, 1) for s in (2, 3, 4, 6)] == [3, 2, 1, 1]
    assert [dispatch.tile_blocks_per_sm(128, 2, s, H100, 8) for s in (2, 3, 4, 6)] == [2, 2, 1, 1]
    assert dispatch.tile_stages(128, 2, H100) == (3, 2)
    assert dispatch.tile_stages(128, 2, H100, 1, 3) == (2, 3)
    assert dispatch.tile_stages(256, 2, H100) == (3, 1)


def test_int8_wide_items_reserve_the_widened_tile():
    """int8 wide items at head dims 64 and 128 keep one tile widened to fp16 (K and V of 64 keys)
    after the stages; other items, head dims and caches reserve nothing there. The ring still
    leaves two blocks per SM at head dim 128."""
    wide = dispatch.WIDE_COLUMNS
    assert dispatch.extra_smem(128, wide, token_scales=True) == 64 * 128 * 2 * 2
    assert dispatch.extra_smem(64, wide, token_scales=True) == 64 * 64 * 2 * 2
    assert dispatch.extra_smem(96, wide, token_scales=True) == 0
    assert dispatch.extra_smem(128, 8, token_scales=True) == 0
    assert dispatch.extra_smem(128, wide) == 0
    with_tile = dispatch.tile_block_smem(128, 1, 3, wide, 2, token_scales=True)
    assert with_tile - dispatch.tile_block_smem(128, 1, 3, 8, 2, token_scales=True) >= 64 * 128 * 4
    stages, blocks = dispatch.tile_stages(128, 1, H100, wide, act_bytes=2, token_scales=True)
    assert blocks == 2 and stages > dispatch.MIN_STAGES
    assert stages < dispatch.tile_stages(128, 1, H100, 8, act_bytes=2, token_scales=True)[0]


def test_wave_cost():
    assert [dispatch.wave_cost(n, 396) for n in (1, 396, 397, 512, 1536)] == [1, 1, 2, 2, 4]


def test_forced_variants():
    assert dispatch.choose_variant(64, 32, 32, 128, 4096, F16, H100, "single_pass").num_splits == 1
    forced = dispatch.choose_variant(64, 32, 32, 128, 4096, F16, H100, "split")
    assert forced.variant == "split" and forced.num_splits >= 2
    assert dispatch.choose_variant(1, 32, 32, 128, 4096, F16, H100, "single_pass") == dispatch.Plan(
        "single_pass", 1, 3, 2
    )
    # Short items: 2 stages in a grid past one item per SM, the deeper ring in a small one.
    assert dispatch.choose_variant(64, 32, 32, 128, 256, F16, H100, "single_pass").stages == 2
    assert dispatch.choose_variant(1, 32, 32, 128, 256, F16, H100, "single_pass").stages == 3
    # Grids past one item per SM: 4 stages over fp8 caches (two tiles per consumer update from
    # four stages on), 2 for short fp8 items and 16-bit one-token steps; tree steps keep theirs.
    fp8 = torch.float8_e4m3fn
    assert dispatch.choose_variant(16, 32, 32, 128, 512, F16, H100, kv_dtype=fp8).stages == 4
    assert dispatch.choose_variant(64, 32, 32, 128, 256, F16, H100, kv_dtype=fp8).stages == 2  # 4 tiles
    assert dispatch.choose_variant(16, 32, 32, 256, 2048, F16, H100, kv_dtype=fp8).stages > 4  # 1 per SM
    assert dispatch.choose_variant(16, 32, 32, 128, 512, F16, H100, tree=True).stages == 3
    # ... but a tree's items of up to TREE_SHORT_ITEM_TILES take 2 (B=1 T=4 4K: 16 splits of 5).
    short_tree = dispatch.choose_variant(1, 32 * 4, 8, 128, 4100, F16, H100, tree=True)
    assert (short_tree.num_splits, short_tree.stages) == (16, 2)
    assert dispatch.choose_variant(1, 32 * 4, 8, 128, 16388, F16, H100, tree=True).stages == 3  # 17 tiles
    assert dispatch.choose_variant(16, 32, 32, 128, 512, F16, H100).stages == 2
    # int8 caches: INT8_DEEP_STAGES where a resident block streams INT8_DEEP_RING_TILES tiles or
    # more of the grid, INT8_SHARED_STAGES where fewer; short one-token items INT8_SHORT_STAGES.
    s8 = torch.int8
    deep = dispatch.choose_variant(16, 32, 8, 128, 32768, F16, H100, kv_dtype=s8)  # 256 tiles a block
    assert (deep.num_splits, deep.stages) == (2, dispatch.INT8_DEEP_STAGES)
    assert dispatch.choose_variant(64, 32, 32, 128, 4096, F16, H100, kv_dtype=s8).stages == 5  # not 6
    few = dispatch.choose_variant(16, 32, 8, 128, 2048, F16, H100, kv_dtype=s8)  # 15.5 tiles a block
    assert (few.num_splits, few.stages) == (2, dispatch.INT8_SHARED_STAGES)
    assert dispatch.choose_variant(1, 32, 8, 128, 65536, F16, H100, kv_dtype=s8).stages == 3  # 31 a block
    assert dispatch.choose_variant(16, 32, 32, 128, 2048, F16, H100, kv_dtype=s8).stages == 5  # 62 a block
    assert (
        dispatch.choose_variant(64, 32, 32, 128, 256, F16, H100, kv_dtype=s8).stages
        == dispatch.INT8_SHORT_STAGES
    )


def test_pure_function_of_its_arguments():
    args = (3, 16, 4, 64, 3000, torch.bfloat16, dispatch.Device(114, 228 * 1024, 227 * 1024))
    assert dispatch.choose_variant(*args) == dispatch.choose_variant(*args)


def test_rejects_bad_arguments():
    with pytest.raises(
        ValueError, match=r"Unsupported head_dim: 72 \(supported: \(32, 64, 80, 96, 128, 256\)\)"
    ):
        dispatch.choose_variant(1, 8, 8, 72, 100, F16)
    with pytest.raises(ValueError, match=r"num_heads \(32\) must be divisible by num_kv_heads \(6\)"):
        dispatch.choose_variant(1, 32, 6, 128, 100, F16)
    with pytest.raises(ValueError, match="variant must be one of"):
        dispatch.choose_variant(1, 8, 8, 128, 100, F16, H100, "fast")
    with pytest.raises(ValueError, match="dtype must be one of"):
        dispatch.choose_variant(1, 8, 8, 128, 100, torch.int8)


def test_q_group_block():
    assert [dispatch.q_group_block(g) for g in (1, 2, 3, 4, 5, 8, 16, 32)] == [1, 2, 4, 4, 8, 8, 8, 8]


@pytest.mark.skipif(_C is None, reason="extension not built")
def test_cpp_columns_block_is_the_dispatchers():
    """The one piece of logic both sides hold (the constants are generated from one table:
    tests/test_generated.py)."""
    for d in dispatch.SUPPORTED_HEAD_DIMS:
        for columns in (1, 2, 3, 4, 5, 8, 9, 31, 32, 64, 127, 128, 256):
            for tree in (False, True):
                for tiles in (False, True):
                    for kv_rows in (1, 8, 63, 64, 512):
                        for epi in (False, True):
                            want = dispatch.columns_block(columns, tree, tiles, d, kv_rows, epi)
                            got = _C.columns_block(columns, tree, tiles, d, kv_rows, epi)
                            assert got == want, (columns, tree, tiles, d, kv_rows, epi)


def test_columns_block_of_tree_steps():
    # One-token steps and the CUDA-core loop keep query-head blocks; trees of many columns go wide.
    assert dispatch.columns_block(256, tree=False) == 8
    assert dispatch.columns_block(256, tree=True, tiles=False) == 8
    assert dispatch.columns_block(31, tree=True, kv_rows=512) == 8
    assert dispatch.columns_block(32, tree=True, kv_rows=64) == dispatch.WIDE_COLUMNS
    assert dispatch.columns_block(64, tree=True, kv_rows=8) == 8  # too few wide items: narrow
    assert dispatch.columns_block(128, tree=True, kv_rows=1) == dispatch.WIDE_COLUMNS
    assert dispatch.columns_block(256, tree=True, head_dim=256) == 8
    assert dispatch.columns_block(1, epilogue=True) == 1  # the epilogue's kernels: 1, 4 or 8 columns
    assert dispatch.columns_block(1, tiles=False, epilogue=True) == dispatch.EPILOGUE_COLUMNS
    assert dispatch.columns_block(2, epilogue=True) == dispatch.EPILOGUE_GROUP_COLUMNS == 4
    assert dispatch.columns_block(4, epilogue=True) == 4
    assert dispatch.columns_block(4, tiles=False, epilogue=True) == dispatch.EPILOGUE_COLUMNS
    assert dispatch.columns_block(5, epilogue=True) == dispatch.EPILOGUE_COLUMNS
    assert dispatch.columns_block(256, tree=True, kv_rows=512, epilogue=True) == dispatch.EPILOGUE_COLUMNS
    # A tree plan of T = 64 nodes at G = 4 counts 4 wide items per (row, kv head) and fills
    # every resident block where the context holds splits of WIDE_MIN_SPLIT_TILES tiles.
    plan = dispatch.choose_variant(1, 32 * 64, 8, 128, 16384 + 64, F16, H100, tree=True)
    narrow = dispatch.choose_variant(1, 32 * 64, 8, 128, 16384 + 64, F16, H100)
    assert H100.num_sms < plan.num_splits * 8 * 4 <= H100.num_sms * plan.blocks_per_sm
    assert narrow.num_splits == 1  # 8 * 32 narrow items already fill the SMs


@pytest.mark.parametrize(
    ("seq_len", "int8", "splits"),
    [(1024 + 64, False, 4), (1984, False, 4), (2048, False, 4), (4096 + 64, False, 4), (16384 + 64, False, 8),
     (1024 + 64, True, 4), (4096 + 64, True, 8), (16384 + 64, True, 8)],
)  # fmt: skip
def test_wide_items_splits_keep_their_tiles(seq_len, int8, splits):
    # Wide items pay their q build per item and a split's merge: a split holds WIDE_MIN_SPLIT_TILES
    # tiles or more, and past one item per SM WIDE_DOUBLED_SPLIT_TILES (int8: _INT8); narrow items
    # of the same rows still split to fill the resident blocks.
    kv = torch.int8 if int8 else None
    plan = dispatch.choose_variant(1, 32 * 64, 8, 128, seq_len, F16, H100, tree=True, kv_dtype=kv)
    assert plan.num_splits == splits
    tiles = -(-seq_len // dispatch.TILE_KEYS)
    assert tiles // plan.num_splits >= dispatch.WIDE_MIN_SPLIT_TILES
    doubled = dispatch.WIDE_DOUBLED_SPLIT_TILES_INT8 if int8 else dispatch.WIDE_DOUBLED_SPLIT_TILES
    assert plan.num_splits * 32 <= H100.num_sms or tiles // plan.num_splits >= doubled
    if int8:
        assert plan.stages == dispatch.WIDE_INT8_STAGES  # the widened tile's ring
    forced = dispatch.choose_variant(1, 32 * 64, 8, 128, seq_len, F16, H100, "split", kv_dtype=kv, tree=True)
    assert forced.num_splits == max(2, splits)  # a forced split still splits
    narrow = dispatch.choose_variant(1, 32 * 16, 8, 128, seq_len, F16, H100, tree=True)
    assert dispatch.columns_block(64, True, True, 128, 8) == 8  # T = 16: 64 narrow items
    assert narrow.num_splits == H100.num_sms * narrow.blocks_per_sm // 64 == 4


@pytest.mark.parametrize(
    ("context", "splits"), [(60, 1), (64, 1), (192, 2), (1024, 9), (2048, 16), (4096, 16), (16384, 16)]
)
def test_narrow_tree_items_split_into_at_most_half_their_tiles(context, splits):
    # B=1 Hq=32 Hkv=8 T=4: 16 narrow items of 8 columns, at most ceil(tiles / 2) splits. One-tile
    # splits would fill the resident blocks, but each split builds its q rows and merges 4x a
    # one-token item's partials.
    seq_len = context + 4
    plan = dispatch.choose_variant(1, 32 * 4, 8, 128, seq_len, F16, H100, tree=True)
    assert plan.num_splits == splits
    tiles = -(-seq_len // dispatch.TILE_KEYS)
    assert plan.num_splits <= -(-tiles // dispatch.TREE_MIN_SPLIT_TILES)
    # The one-token step of the same shape still splits down to one tile.
    one = dispatch.choose_variant(1, 32, 8, 128, 1024 + 1, F16, H100)
    assert one.num_splits == 16


@pytest.mark.parametrize(
    ("nodes", "context", "kv", "plan"),
    [
        (4, 1024, F16, (8, 2)),  # 9 splits of 1-2 tiles would put 144 items on 132 SMs
        (4, 2048, F16, (8, 2)),  # 16 of 2-3
        (4, 1024, torch.int8, (9, 2)),  # int8 keeps its splits
        (4, 512, F16, (5, 2)),  # already one item per SM; 2 stages, not 3
        (4, 4096, F16, (16, 2)),  # splits of 4-5 tiles: kept
        (16, 1024, F16, (4, 2)),
    ],
)
def test_fused_tree_items_of_few_tiles_keep_one_item_per_sm(nodes, context, kv, plan):
    # B=1 Hq=32 Hkv=8: trees of up to FUSED_TREE_NODES nodes are checked and their nodes built in
    # every split; splits of at most FUSED_SHORT_SPLIT_TILES tiles keep one item per SM, and short
    # items two stages.
    keys = context + nodes
    got = dispatch.choose_variant(1, 32 * nodes, 8, 128, keys, F16, H100, kv_dtype=kv, tree=True, nodes=nodes)
    assert (got.num_splits, got.stages) == plan
    for each in (F16, torch.int8, dispatch.FP8):
        assert dispatch.fused_tree(nodes, dispatch.columns_block(32 * nodes // 8, True, kv_rows=8), each)
    # Not fused: int4 caches, epilogues, and trees past FUSED_TREE_NODES (the tree's check and append
    # run once, before the attention launch): the plan of a tree step whose node count is not given.
    assert not dispatch.fused_tree(nodes, 8, dispatch.INT4_CODES)
    assert not dispatch.fused_tree(nodes, 8, F16, epilogue=True)
    assert not dispatch.fused_tree(dispatch.FUSED_TREE_NODES + 1, 8, F16)
    assert not dispatch.fused_tree(1, 8, F16)
    seed = dispatch.choose_variant(4, 54, 1, 64, 1024 + 54, F16, H100, tree=True, nodes=54)
    assert seed == dispatch.choose_variant(4, 54, 1, 64, 1024 + 54, F16, H100, tree=True)
    assert seed.num_splits == 9


@pytest.mark.parametrize(("context", "splits"), [(1024, 1), (4096, 1), (8192, 1), (16384, 2)])
def test_wide_items_that_fill_the_sms_split_only_when_long(context, splits):
    # B=16 T=16: 128 wide items, one per SM; a second split (two blocks an SM, and a merge) only
    # where each split keeps WIDE_SHARED_SPLIT_TILES tiles.
    assert dispatch.base_blocks(16, 32 * 16, 8, dispatch.WIDE_COLUMNS) == 128 <= H100.num_sms
    plan = dispatch.choose_variant(16, 32 * 16, 8, 128, context + 16, F16, H100, tree=True)
    assert plan.num_splits == splits
    tiles = -(-(context + 16) // dispatch.TILE_KEYS)
    assert splits == 1 or tiles // splits >= dispatch.WIDE_SHARED_SPLIT_TILES


@pytest.mark.parametrize(
    ("batch", "nodes", "context", "paired"),
    [
        (16, 64, 16384, True),   # 512 items of 256 tiles
        (16, 64, 4096, True),    # 512 items of 64 tiles
        (16, 64, 1024, False),   # 16 tiles an item: the q builds are not hidden
        (32, 32, 8192, True),    # two column blocks: one pair a (row, kv head)
        (16, 32, 8192, False),   # 256 items: short of two blocks on each of 132 SMs
        (16, 16, 16384, False),  # one column block a (row, kv head): nothing to pair
        (1, 64, 16384, False),   # 32 items: under two blocks an SM at any split
        (16, 4, 16384, False),   # narrow items
    ],
)
def test_wide_items_pair_where_the_grid_is_full_and_long(batch, nodes, context, paired):
    # pair_wide_items: two column blocks or more, an unpaired grid of two blocks an SM, splits of
    # WIDE_PAIR_MIN_TILES tiles (H200, `python -m mmha.bench --tree`: B=16 T=64 4K / 16K faster,
    # 1K and the B=1 rows slower).
    keys = context + nodes
    plan = dispatch.choose_variant(batch, 32 * nodes, 8, 128, keys, F16, H100, tree=True)
    got = dispatch.pair_wide_items(batch, 32, 8, nodes, 128, keys, plan.num_splits, H100.num_sms)
    assert got == paired
    assert not dispatch.pair_wide_items(batch, 32, 8, nodes, 128, keys, plan.num_splits, H100.num_sms, tiles=False)


@pytest.mark.skipif(_C is None or not torch.cuda.is_available(), reason="needs a GPU and the extension")
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("head_dim", dispatch.SUPPORTED_HEAD_DIMS)
def test_planned_occupancy_is_what_the_kernel_gets(dtype, head_dim):
    from mmha import ops

    dev = ops.device_spec(torch.cuda.current_device())
    code = {F16: 0, BF16: 1}[dtype]
    sources = (1, 2) if head_dim % 64 == 0 and torch.cuda.get_device_capability()[0] >= 9 else (1,)
    wide = (dispatch.WIDE_COLUMNS,) if head_dim <= dispatch.WIDE_MAX_HEAD_DIM else ()
    for qb in dispatch.Q_GROUP_BLOCKS + wide:
        stages, blocks = dispatch.tile_stages(head_dim, 2, dev, qb)
        for source in sources:
            got = _C.blocks_per_sm(code, head_dim, qb, stages, source)
            assert got >= blocks, (qb, source, got, blocks)
            # The deepest ring the operator accepts still launches.
            assert (
                _C.blocks_per_sm(code, head_dim, qb, dispatch.max_stages(head_dim, 2, dev, qb), source) >= 1
            )


def test_every_dtype_and_head_dim_has_an_instantiation_file():
    root = Path(__file__).parent.parent / "csrc" / "kernels" / "instantiations"
    for name in ("fp16", "bf16", "fp32"):
        for d in dispatch.SUPPORTED_HEAD_DIMS:
            text = (root / f"decode_{name}_hd{d}.cu").read_text()
            for qb in dispatch.Q_GROUP_BLOCKS:
                assert f", {d}, {qb}>(" in text
            if name != "fp32" and d <= dispatch.WIDE_MAX_HEAD_DIM:
                wide = (root / f"decode_wide_{name}_hd{d}.cu").read_text()
                assert f", {d}, {dispatch.WIDE_COLUMNS}>(" in wide
