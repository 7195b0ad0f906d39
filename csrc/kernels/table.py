"""The one table of what the kernels and the Python package share: supported shapes, the tile
loop's constants, status bits, row modes, the shared-memory model and the workspace layout.

``csrc/kernels/generate.py`` writes ``csrc/kernels/constants.h`` (``kCamelCase`` constants and
``constexpr`` functions) and ``mmha/_constants.py`` (``UPPER_CASE`` constants and functions) from
it, and the kernel instantiations from its head dims and query-group blocks; nothing else holds
these values. Formulas are Python expressions over integers (``+ - * // %``, comparisons,
``a if c else b``, ``max``) that the generator writes in both languages; a name in a formula is
a parameter, an earlier local, a constant or an earlier function.
"""

# (name, value or expression over earlier names, comment). Tuples become arrays.
CONSTANTS = [
    (
        "SUPPORTED_HEAD_DIMS",
        (32, 64, 80, 96, 128, 256),
        "head dims with kernels (others are refused naming these)",
    ),
    (
        "Q_GROUP_BLOCKS",
        (1, 2, 4, 8),
        "query heads of one kv head per item: a group of G heads in blocks of the smallest >= G (8 past 8), "
        "so K/V is read once per group for G <= 8",
    ),
    ("MAX_SPLITS", 64, "sequence splits at most: the merge keeps one weight per split in shared memory"),
    ("CONSUMER_WARPS", 4, "tile loop: warps that compute; each takes 16 keys of a tile (the M of m16n8k16)"),
    ("TILE_KEYS", "16 * CONSUMER_WARPS", "keys of one tile-loop stage"),
    (
        "TILE_THREADS",
        "(CONSUMER_WARPS + 2) * 32",
        "a tile-loop block: consumers, one producer, one stager warp",
    ),
    ("MIN_STAGES", 2, "tile loop: fewest shared-memory stages"),
    ("MAX_STAGES", 8, "tile loop: most shared-memory stages"),
    (
        "WIDE_COLUMNS",
        "16 * CONSUMER_WARPS",
        "tree steps: query columns of a wide item (16 per consumer warp, every warp takes all keys of "
        "a tile)",
    ),
    ("WIDE_MIN_COLUMNS", 32, "tree steps: wide items from this many columns per kv head on"),
    ("WIDE_MAX_HEAD_DIM", 128, "tree steps: wide items up to this head dim (their registers)"),
    (
        "WIDE_ALWAYS_COLUMNS",
        128,
        "below this many columns, wide items only where a step has WIDE_MIN_ITEMS of them: a small grid of "
        "wide items needs many splits, whose merge costs more than narrow items' repeated reads (H100, "
        "decode timing, B=1 Hq=32 Hkv=8 T=16: 79 against 43 us at 1K, 114 against 62 at 4K; at B=16 wide "
        "items win, 114 against 134 and 179 against 310)",
    ),
    ("WIDE_MIN_ITEMS", 64, "see WIDE_ALWAYS_COLUMNS"),
    ("ITEM_SLOTS_BYTES", 256, "static shared memory of the two item slots' items, scales and barriers"),
    (
        "Q_ROW_PAD",
        4,
        "floats after each row of a narrow item's q in shared memory (rows stay 16-byte aligned): rows of a "
        "multiple of 32 floats put one dim of every column in one bank, where the consumers read 8 columns' "
        "dims at once; 8 would clear the 16-bit caches' reads fully but leaves a fused tree of 16 nodes at "
        "head dim 128 over fp16 (three stages, two blocks an SM) 112 bytes short",
    ),
    (
        "WARP_BUFFER_VALUES",
        512,
        "items of at most this many values (query heads x head dim) combine their consumer warps' "
        "accumulators through a buffer per warp (one barrier) rather than warp by warp",
    ),
    (
        "EPILOGUE_COLUMNS",
        8,
        "a step with an output epilogue runs kernels compiled with it, for items of this many columns, and "
        "of 1 and EPILOGUE_GROUP_COLUMNS on the tile loop (8 columns for one query head cost 8-17 % on short "
        "rows, for groups of 2-4 heads 2.5-5 % on the B=16 / 64 GQA rows)",
    ),
    ("EPILOGUE_GROUP_COLUMNS", 4, "see EPILOGUE_COLUMNS"),
    ("SIMT_WARPS", 4, "the CUDA-core loop (fp32 caches): warps of a block, each walking its own keys"),
    ("SIMT_THREADS", "SIMT_WARPS * 32", "the CUDA-core loop's block"),
    ("FP8_MAX", 448, "largest finite e4m3 value: fp8 caches and outputs saturate to +-FP8_MAX"),
    (
        "TOKEN_SCALE_BYTES",
        "2 * TILE_KEYS * 4",
        "an int8 cache's tile-loop stage: the K and V scales (fp32) of its TILE_KEYS tokens, after K and V",
    ),
    ("INT4_GROUP", 64, "an int4 cache's K tokens sharing a channel's scale and zero point (mmha/int4.py): one tile"),
    ("INT4_CHANNELS", 32, "an int4 cache's channels per 16-byte chunk (two codes a byte); its head dims are multiples"),
    ("INT4_RESIDUAL", 128, "an int4 cache's 16-bit K slots per (row, kv head): the partial group and a tree's nodes"),
    ("MAX_TREE_NODES", 64, "nodes of a tree step at most: a node's ancestors are one 64-bit mask"),
    (
        "FUSED_TREE_NODES",
        16,
        "tree steps of at most this many nodes (parents' width) on narrow items check and append the tree in "
        "the attention kernel itself (one launch), where its node area leaves the blocks per SM as they are "
        "(H200: 4 nodes 0.86-0.94x the two launches' time; 16 nodes at B=1 1K / 4K 0.76-0.82x)",
    ),
    ("STATUS_LENGTH", 1, "status flag: a length outside the cache (nothing written, NaN output)"),
    ("STATUS_SCALE", 2, "status flag: an fp8 scale not finite and positive"),
    ("STATUS_TREE", 4, "status flag: a tree step's parents or node count broke mmha.tree's rules"),
    ("STATUS_PAGES", 8, "status flag: a block table named a block outside the pool"),
    ("ROW_IDLE", 0, "row mode: takes no part (nothing read or written, zero output, lse -inf)"),
    ("ROW_STEP", 1, "row mode: appends the new token at slot lengths[b] and attends up to it"),
    ("ROW_ATTEND", 2, "row mode: attends to slots before lengths[b] only, writes nothing"),
    (
        "TILE_SOURCE_AUTO",
        0,
        "tile_source: bulk tensor copies where the GPU and head dim allow, else cp.async",
    ),
    ("TILE_SOURCE_CP_ASYNC", 1, "tile_source: 16-byte cp.async by the producer warp (sm_80 and newer)"),
    ("TILE_SOURCE_TMA", 2, "tile_source: Hopper bulk tensor copies (sm_90, V rows of whole 128-byte lines)"),
]

# (name, [(parameter, type)], return type, [(local, expression)], result expression, comment).
# Types: "int", "int64" or "bool".
FUNCTIONS = [
    (
        "v_whole_lines",
        [("head_dim", "int"), ("elem_bytes", "int")],
        "bool",
        [],
        "head_dim * elem_bytes % 128 == 0",
        "whether a V row of the cache is a whole number of 128-byte lines: then bulk tensor copies bring V "
        "as boxes of one line per key with the 128-byte swizzle; otherwise V rows in shared memory are "
        "padded by 16 bytes",
    ),
    (
        "tile_stage_bytes",
        [("head_dim", "int"), ("elem_bytes", "int"), ("token_scales", "bool")],
        "int",
        [
            ("k", "TILE_KEYS * head_dim * elem_bytes"),
            ("pitch", "head_dim if v_whole_lines(head_dim, elem_bytes) else head_dim + 16 // elem_bytes"),
            ("v", "TILE_KEYS * pitch * elem_bytes"),
            ("scales", "TOKEN_SCALE_BYTES if token_scales else 0"),
        ],
        "(k + v + scales + 1023) // 1024 * 1024",
        "shared memory of one tile-loop stage (K and V of TILE_KEYS keys of elem_bytes each, and an int8 "
        "cache's token scales), 1024-byte aligned",
    ),
    (
        "int4_v_swizzle",
        [("head_dim", "int")],
        "int",
        [("row", "head_dim // 2")],
        "row if row == 32 else row if row == 64 else row if row == 128 else 0",
        "the swizzle span (bytes) of an int4 stage's V rows (head_dim / 2 bytes each, unpadded): rows of 32, "
        "64 or 128 bytes swizzled as bulk tensor copies land them (16-byte units XORed by address bits 7 on), "
        "so the 8 rows of a unit column fall in 8 bank groups; rows of 16 or 48 bytes (an odd number of "
        "units) do so unswizzled (0)",
    ),
    (
        "int4_stage_bytes",
        [("head_dim", "int")],
        "int",
        [
            ("k", "TILE_KEYS * head_dim // 2"),
            ("v", "TILE_KEYS * head_dim // 2"),
            ("scales", "4 * head_dim + 4 * TILE_KEYS"),
        ],
        "(k + v + scales + 1023) // 1024 * 1024",
        "shared memory of one tile-loop stage of an int4 cache: K codes in 16-byte chunks of 32 channels, V "
        "rows of head_dim / 2 bytes (swizzled: int4_v_swizzle), the K group's scales and zero "
        "points (fp16 [head_dim] each) and the keys' V scales and zero points (fp16 [TILE_KEYS] each), "
        "1024-byte aligned",
    ),
    (
        "int4_residual_bytes",
        [("head_dim", "int")],
        "int",
        [],
        "TILE_KEYS * (2 * head_dim + 16) + 11 * head_dim + 16",
        "an int4 cache's item holding the row's last K group: that group as fp16 keys (rows padded by 16 bytes), "
        "after the stages; then the new token (k in the activations' dtype, v codes, v's scale and zero point)",
    ),
    (
        "tile_static_smem",
        [("head_dim", "int"), ("elem_bytes", "int"), ("qb", "int")],
        "int",
        [
            ("wide_staging", "CONSUMER_WARPS * 16 * (head_dim + 8) * 2"),
            (
                "wide",
                "wide_staging + CONSUMER_WARPS * 16 * 4 + 3 * 8 * 8 + 16 + 8 * 64"
                " + ITEM_SLOTS_BYTES + 320",
            ),
            (
                "warp_buffers",
                "CONSUMER_WARPS * qb * head_dim * 4 if qb * head_dim <= WARP_BUFFER_VALUES else 0",
            ),
            ("epilogue_channels", "3 * head_dim * 4 if qb == 1 else 0"),
            (
                "narrow",
                "qb * (head_dim + Q_ROW_PAD) * 4 + 2 * head_dim * elem_bytes + 2 * (qb + 2) * head_dim * elem_bytes"
                " + qb * 64 * 4 + 2 * CONSUMER_WARPS * qb * 4 + (qb + 1) * 4 + 3 * 8 * 8 + 16 + 8 * 64"
                " + ITEM_SLOTS_BYTES + warp_buffers + epilogue_channels + 256",
            ),
        ],
        "wide if qb == WIDE_COLUMNS else narrow",
        "a bound on the tile kernel's static shared memory at qb query columns per item (elem_bytes: the "
        "activations'), so that host and dispatcher size stages without asking the compiled kernel (22.1 KB "
        "against 21.8 compiled at 8 heads of head_dim 256). Narrow items: q in fp32 (then the combine's "
        "buffer), the new token's k and v, two staging slots of raw q, k and v, merge weights (MAX_SPLITS), "
        "per-warp max and sum, the q/k norms' scales, ring and staging barriers, tile headers, the item slots, "
        "warp buffers, a one-column item's epilogue channels (shift, smooth, scale), alignment. Wide items: q "
        "staging, the q norm's scales, barriers, headers, the item slots, alignment (compiled at head dim 128, "
        "sm_90a: 18,944 bytes, the paired kernel 18,960; 256 bytes of alignment here left it 48-64 short)",
    ),
    (
        "wide_widened_bytes",
        [("head_dim", "int"), ("token_scales", "bool"), ("qb", "int")],
        "int",
        [("tile", "TILE_KEYS * head_dim * 4")],
        "((tile if head_dim % 64 == 0 else 0) if token_scales else 0) if qb == WIDE_COLUMNS else 0",
        "an int8 cache's wide items at head dims 64 and 128: one tile's K and V widened to fp16 after the "
        "stages, the warpgroup's operands (reserved on every GPU; used where the kernel multiplies with wgmma)",
    ),
    (
        "tile_smem_bytes",
        [("head_dim", "int"), ("elem_bytes", "int"), ("token_scales", "bool"), ("stages", "int")],
        "int",
        [],
        "stages * tile_stage_bytes(head_dim, elem_bytes, token_scales) + 1024",
        "dynamic shared memory of a tile-loop block: its stages and slack to align them to 1024 bytes",
    ),
    (
        "work_counter",
        [("batch", "int64"), ("nodes", "int64"), ("heads", "int64")],
        "int64",
        [],
        "batch * nodes * heads",
        "workspace counters (int32 units): merge arrivals [B * T * Hq] first, then the tile loop's work "
        "counter [2] at this offset",
    ),
    (
        "tree_anc",
        [("batch", "int64"), ("nodes", "int64"), ("heads", "int64")],
        "int64",
        [],
        "(batch * nodes * heads + 2 + 1) // 2 * 2",
        "a tree step's ancestor masks [2 * B * T] (8-byte aligned) after the work counter",
    ),
    (
        "tree_depth",
        [("batch", "int64"), ("nodes", "int64"), ("heads", "int64")],
        "int64",
        [],
        "tree_anc(batch, nodes, heads) + 2 * batch * nodes",
        "then node depths [B * T]",
    ),
    (
        "tree_rows",
        [("batch", "int64"), ("nodes", "int64"), ("heads", "int64")],
        "int64",
        [],
        "tree_depth(batch, nodes, heads) + batch * nodes",
        "then each row's node count [B]",
    ),
    (
        "workspace_counters",
        [("batch", "int64"), ("nodes", "int64"), ("heads", "int64")],
        "int64",
        [],
        "tree_rows(batch, nodes, heads) + batch",
        "int32 counters a step of `nodes` query rows per row needs (a one-token step uses the first "
        "B * Hq + 2)",
    ),
    (
        "workspace_partials",
        [
            ("batch", "int64"),
            ("nodes", "int64"),
            ("heads", "int64"),
            ("splits", "int64"),
            ("head_dim", "int64"),
        ],
        "int64",
        [],
        "batch * nodes * heads * splits * (head_dim + 2) if splits > 1 else 0",
        "fp32 split partials: acc [B * T, Hq, splits, D], then (max, sum) [B * T, Hq, splits, 2]",
    ),
]

# Kernel instantiations (csrc/kernels/instantiations): (file name, qkv type, cache type).
DTYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}
KINDS = [(name, ctype, ctype) for name, ctype in DTYPES.items()] + [
    ("fp16_e4m3", "__half", "e4m3"),
    ("bf16_e4m3", "__nv_bfloat16", "e4m3"),
    ("fp16_s8", "__half", "s8"),
    ("bf16_s8", "__nv_bfloat16", "s8"),
    ("fp16_u4", "__half", "u4"),
    ("bf16_u4", "__nv_bfloat16", "u4"),
]
# Kernel sets that also have lean units (csrc/kernels/lean_kernels.h: the kernels of calls without
# pages, score modifiers, row modes, q/k norms or the epilogue, their code left out: one-token
# steps, and small trees in the fused twin): decode_<set>_hd<D>_lean.cu.
LEAN_KINDS = ("fp16", "bf16", "fp16_s8", "bf16_s8")
# Cache types without the wide items of tree steps (fp32: the CUDA-core loop).
NO_WIDE = ("float", "u4")
# Cache types whose head dims are whole 16-byte chunks of codes (int4: multiples of INT4_CHANNELS).
CHUNKED = ("u4",)
