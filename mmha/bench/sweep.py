"""``python -m mmha.bench.sweep``: mmha on the canonical rows at many split counts and stage
counts, under the decode timing, next to the dispatcher's pick. The dispatcher's thresholds are
checked against its table (docs/design.md quotes it).

Plans read ``SxT``: S splits, T stages (``SxT cp``: with the cp.async tile source where the
plan would use bulk tensor copies). Each row times every split count at the dispatcher's stages
and every stage count at the dispatcher's splits and in one pass, and the cp.async source at the dispatcher's
plan, after checking the dispatcher's plan against the fp32 reference. ``--tree``: the tree
benchmark's rows (``mmha.bench.tree``, fp16) at the dispatcher's split count and every stage
count up to its own, in rounds of alternating order (``timing.decode_us_rounds``), each stage
count's output checked against the reference; ``--splits``: also these split counts, each at two
stages and at the dispatcher's; ``--stages``: also these stage counts at each of those split
counts; ``--only B,CTX,T``: those tree rows only. ``--int8``: each row's
int8-cache twin after it, at int8's own plans (ring depths of its smaller stages); with
``--tree``, each Llama-shaped tree row's. ``--int4``: each canonical row's int4-cache twin
(``mmha.int4``; the cp.async source, its stages and residual area). ``--plans SxT ...``:
the canonical rows also at these plans, e.g. ``4x6``: 4 splits over a ring of 6 stages, whose
shared memory leaves one block per SM, so a grid of more items than SMs takes them from the work
counter as its blocks free up.

    python -m mmha.bench.sweep --out DIR [--dtype fp16] [--rows 0 3 12] [--extras] [--plans 4x6 8x6]
        [--int8] [--int4]
    python -m mmha.bench.sweep --tree --out DIR [--only 1,1024,4 1,4096,4] [--splits 4 8 16 32] [--stages 3]
        [--int8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .. import dispatch, ops
from . import timing
from .methods import mmha_fn, plan_str
from .problems import CANONICAL, TOLERANCE, Config, layer_problems

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64)
# Rows off the canonical grid (B, Hq, Hkv, D, S): head_dims 64 and 256, the benchmark's extra rows
# (its small-head rows: B * S = 16K at Hq = Hkv = 16, D = 64).
EXTRAS = (
    (16, 32, 8, 64, 2048),
    (1, 32, 32, 64, 4096),
    (16, 32, 32, 64, 2048),
    (32, 16, 16, 64, 512),
    (16, 16, 16, 64, 1024),
    (8, 16, 16, 64, 2048),
    (4, 16, 16, 64, 4096),
    (2, 16, 16, 64, 8192),
    (1, 16, 16, 64, 16384),
    (16, 32, 8, 256, 2048),
)


def parse_plan(text: str) -> tuple[int, int]:
    """``SxT`` (``4x6``) as (splits, stages), each within what the kernels take."""
    try:
        splits, stages = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--plans takes SxT (splits x stages, e.g. 4x6), got {text!r}") from None
    if not 1 <= splits <= dispatch.MAX_SPLITS or not dispatch.MIN_STAGES <= stages <= dispatch.MAX_STAGES:
        raise ValueError(
            f"--plans {text}: splits in [1, {dispatch.MAX_SPLITS}] and stages in "
            f"[{dispatch.MIN_STAGES}, {dispatch.MAX_STAGES}]"
        )
    return splits, stages


def candidates(
    cfg: Config, plan: dispatch.Plan, extra: tuple[tuple[int, int], ...] = ()
) -> list[tuple[dispatch.Plan, str]]:
    """(plan, tile source) pairs to time on this row, the dispatcher's own pick first; ``extra``:
    (splits, stages) pairs besides (those past the row's tiles or the block's shared memory left out)."""
    dev = ops.device_spec(torch.cuda.current_device())
    tiles = -(-cfg.seq_len // dispatch.TILE_KEYS)
    out = [(plan, "auto")]
    for s in SPLITS:
        if s <= tiles:
            out.append(
                (
                    dispatch.Plan("single_pass" if s == 1 else "split", s, plan.stages, plan.blocks_per_sm),
                    "auto",
                )
            )
    # The stages' bytes are the cache's (int8: with their token scales; int4: its own layout and
    # residual area), the static arrays' the activations'.
    ring = dict(act_bytes=cfg.elem, token_scales=cfg.kv == "int8", int4=cfg.kv == "int4")
    most = dispatch.max_stages(cfg.head_dim, cfg.kv_elem, dev, **ring)
    for splits in sorted({1, plan.num_splits}):
        for st in range(dispatch.MIN_STAGES, most + 1):
            bps = dispatch.tile_blocks_per_sm(cfg.head_dim, cfg.kv_elem, st, dev, **ring)
            out.append((dispatch.Plan("single_pass" if splits == 1 else "split", splits, st, bps), "auto"))
    for splits, st in extra:
        if splits <= tiles and st <= most:
            bps = dispatch.tile_blocks_per_sm(cfg.head_dim, cfg.kv_elem, st, dev, **ring)
            out.append((dispatch.Plan("single_pass" if splits == 1 else "split", splits, st, bps), "auto"))
    if cfg.head_dim % 64 == 0 and torch.cuda.get_device_capability()[0] >= 9 and cfg.kv != "int4":
        out.append((plan, "cp_async"))
    return list(dict.fromkeys(out))


def name(plan: dispatch.Plan, source: str) -> str:
    return plan_str(plan) + (" cp" if source == "cp_async" else "")


def sweep_row(cfg: Config, extra: tuple[tuple[int, int], ...] = ()) -> dict:
    probs = layer_problems(cfg, "mmha")
    plan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
                        cfg.torch_dtype, kv_dtype=cfg.kv_torch_dtype)  # fmt: skip
    err = probs[0].error(mmha_fn(probs[0], plan)())
    assert err <= TOLERANCE[cfg.dtype], f"{cfg.label}: plan {plan_str(plan)} error {err:.3g}"
    times = {}
    for cand, source in candidates(cfg, plan, extra):
        times[name(cand, source)] = timing.decode_us([mmha_fn(p, cand, source) for p in probs], replays=15)[
            "us"
        ]
    # The plan once more, last: the first timing of a row may still carry warm-up effects.
    again = timing.decode_us([mmha_fn(p, plan) for p in probs], replays=15)["us"]
    times[plan_str(plan)] = min(times[plan_str(plan)], again)
    del probs
    torch.cuda.empty_cache()
    best = min(times, key=times.get)
    return {
        "row": cfg.label, "kv_mb": cfg.kv_bytes / 1e6, "layers": cfg.layers, "plan": plan_str(plan),
        "plan_us": times[plan_str(plan)], "best": best, "best_us": times[best], "times_us": times,
    }  # fmt: skip


def tree_plans(
    plan: dispatch.Plan, splits: tuple[int, ...] = (), stages: tuple[int, ...] = ()
) -> list[dispatch.Plan]:
    """The plans a tree row is timed at: the dispatcher's split count at every stage count from
    MIN_STAGES to its own and at each of ``stages``, then each of ``splits`` (not the dispatcher's)
    at MIN_STAGES, at the dispatcher's stages and at each of ``stages``."""
    own = sorted(set(range(dispatch.MIN_STAGES, plan.stages + 1)) | set(stages))
    out = [dispatch.Plan(plan.variant, plan.num_splits, st, plan.blocks_per_sm) for st in own]
    for s in splits:
        if s == plan.num_splits:
            continue
        for st in sorted({dispatch.MIN_STAGES, plan.stages, *stages}):
            out.append(dispatch.Plan("single_pass" if s == 1 else "split", s, st, plan.blocks_per_sm))
    return out


def sweep_tree_row(row, splits: tuple[int, ...] = (), stages: tuple[int, ...] = ()) -> dict:
    """One tree row (``mmha.bench.tree.Row``) at the plans of ``tree_plans``."""
    from . import tree as tree_bench

    layers = [tree_bench.Layer(row, seed=i) for i in range(row.layers)]
    ref = tree_bench.reference_out(layers[0])
    plan = tree_bench.plan_of(row)
    ws = tree_bench.workspace_for(row)  # one for every plan and layer: a large row's plans fit the GPU
    methods = {}
    for each in tree_plans(plan, splits, stages):
        name = plan_str(each)
        fns = [tree_bench.mmha_fn(layer, each.num_splits, each.stages, ws) for layer in layers]
        err = tree_bench.error(fns[0](), layers[0], ref)
        assert err <= TOLERANCE["fp16"], f"tree row {row}: plan {name} error {err:.3g}"
        methods[name] = fns
    got = timing.decode_us_rounds(methods, rounds=4)
    del layers, methods, ws
    torch.cuda.empty_cache()
    times = {name: r["us"] for name, r in got.items()}
    best = min(times, key=times.get)
    label = (f"tree B={row.batch} Hq={row.num_heads} Hkv={row.num_kv_heads} D={row.head_dim} "
             f"ctx={row.context} T={row.nodes} {row.shape}{' int8' if row.kv else ''}")  # fmt: skip
    return {
        "row": label, "kv_mb": row.kv_bytes / 1e6, "layers": row.layers, "plan": plan_str(plan),
        "plan_us": times[plan_str(plan)], "best": best, "best_us": times[best], "times_us": times,
    }  # fmt: skip


def render(results: list[dict]) -> str:
    from tabulate import tabulate

    body = []
    for r in results:
        top = sorted(r["times_us"].items(), key=lambda kv: kv[1])[:4]
        body.append([r["row"], f"{r['kv_mb']:.0f}", r["plan"], f"{r['plan_us']:.1f}", r["best"],
                     f"{r['best_us']:.1f}", f"{r['plan_us'] / r['best_us']:.3f}",
                     ", ".join(f"{k}: {v:.1f}" for k, v in top)])  # fmt: skip
    cols = [
        "row",
        "KV MB",
        "plan",
        "plan us",
        "best",
        "best us",
        "plan/best",
        "fastest four (splits x stages: us)",
    ]
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmha.bench.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--rows", type=int, nargs="*", help="indices into the canonical grid (default: all)")
    p.add_argument("--no-canonical", action="store_true", help="only the extra rows")
    p.add_argument("--extras", action="store_true", help="add head_dim 64 and 256 rows")
    p.add_argument(
        "--tree", action="store_true", help="the tree benchmark's rows: stage counts at the plan's splits"
    )
    p.add_argument("--splits", type=int, nargs="*", default=[], help="--tree: also these split counts")
    p.add_argument("--stages", type=int, nargs="*", default=[], help="--tree: also these stage counts")
    p.add_argument("--only", nargs="+", metavar="B,CTX,T", help="--tree: rows of these batch, context, nodes")
    p.add_argument("--int8", action="store_true",
                   help="each row's int8-cache twin too (--tree: each Llama-shaped row's)")  # fmt: skip
    p.add_argument("--int4", action="store_true", help="each canonical row's int4-cache twin too")
    p.add_argument("--plans", nargs="+", default=[], metavar="SxT",
                   help="the canonical rows also at these plans (splits x stages, e.g. 4x6)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("sweep_out"))
    args = p.parse_args(argv)
    if (args.splits or args.only or args.stages) and not args.tree:
        p.error("--splits, --stages and --only apply to --tree")
    if args.plans and args.tree:
        p.error("--plans applies to the canonical rows (--tree takes --splits)")
    if args.int4 and args.tree:
        p.error("--int4 applies to the canonical rows (int4 caches take no tree steps on the GPU)")
    try:
        extra = tuple(parse_plan(t) for t in args.plans)
    except ValueError as exc:
        p.error(str(exc))
    if args.tree:
        from .tree import rows as tree_rows
        from .tree import select

        try:
            picked = select(tree_rows(int8=args.int8), args.only)
        except ValueError as exc:
            p.error(str(exc))
        if any(s < 1 or s > dispatch.MAX_SPLITS for s in args.splits):
            p.error(f"--splits takes counts in [1, {dispatch.MAX_SPLITS}], got {args.splits}")
        if any(st < dispatch.MIN_STAGES or st > dispatch.MAX_STAGES for st in args.stages):
            p.error(f"--stages takes counts in [{dispatch.MIN_STAGES}, {dispatch.MAX_STAGES}], got {args.stages}")
    if not torch.cuda.is_available():
        print("mmha.bench.sweep: no CUDA GPU here")
        return 0
    if args.tree:
        results = []
        for row in picked:
            results.append(sweep_tree_row(row, tuple(args.splits), tuple(args.stages)))
            r = results[-1]
            line = (
                f"{r['row']}: plan {r['plan']} {r['plan_us']:.1f} us, best {r['best']} {r['best_us']:.1f} us"
            )
            print(line, file=sys.stderr, flush=True)
        return write(results, args.out)
    grid = [] if args.no_canonical else [CANONICAL[i] for i in args.rows] if args.rows else CANONICAL
    cfgs = [Config(g, b, 32, hkv, 128, s, args.dtype) for g, b, hkv, s in grid]
    if args.extras:
        cfgs += [Config("extra", b, hq, hkv, d, s, args.dtype) for b, hq, hkv, d, s in EXTRAS]
    if args.int8:  # each row's int8 twin after it (int8's plans: its own stages and splits)
        cfgs = [c for each in cfgs for c in (each, each.same_shape("int8"))]
    if args.int4:  # each 16-bit row's int4 twin after it (head dim 128 rows: the format's kernels)
        cfgs = [c for each in cfgs for c in (each, *(() if each.kv else (each.same_shape("int4"),)))]
    results = []
    for cfg in cfgs:
        results.append(sweep_row(cfg, extra))
        print(f"{cfg.label}: plan {results[-1]['plan']} {results[-1]['plan_us']:.1f} us, best "
              f"{results[-1]['best']} {results[-1]['best_us']:.1f} us",
              file=sys.stderr, flush=True)  # fmt: skip
    return write(results, args.out)


def write(results: list[dict], out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    text = render(results)
    (out / "sweep.json").write_text(json.dumps(results, indent=1))
    (out / "sweep.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
