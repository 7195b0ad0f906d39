"""Launch mmha (or a peer) on a few benchmark rows, as dispatched, for Nsight Compute
(bench/profile.sh).

Each row: B,Hq,Hkv,D,S (fp16; ``--kv fp8|int8|int4`` for those caches), optionally with @SPLITSxSTAGES
to force a plan. Every row is checked against the fp32 reference first, then launched ``--iters``
times inside an NVTX range named "mmha" (or "peer" with ``--peer NAME``, an SDPA peer of
mmha.bench such as sdpa_cudnn), so ``ncu --nvtx --nvtx-include mmha/`` catches only those
launches. ``--mod window|softcap|alibi|sinks``
runs mmha with that score modifier as ``python -m mmha.bench --mods`` does (Hq 32, D 128, the
dispatcher's plan; checked against ``mmha.reference.attend``). ``--epilogue`` runs each row with
the int8 output epilogue of ``python -m mmha.bench --epilogue`` (its plan, checked against the
epilogue of the plain output: at most one int8 step apart). ``--tree``: the rows are the tree
benchmark's, B,CTX,T[@SPLITSxSTAGES] (``mmha.bench.tree``, binary trees, fp16), one tree step
each, checked against ``mmha.reference.decode_tree``.
"""

from __future__ import annotations

import argparse

import torch

from mmha import ops
from mmha.bench.methods import make_fn, method_context, row_of_spec
from mmha.bench.problems import TOLERANCE, Config, Problem


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("rows", nargs="+", help="B,Hq,Hkv,D,S[@SPLITSxSTAGES]")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--kv", default="", choices=["", "fp8", "int8", "int4"], help="the caches' format")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--peer", default=None, help="run this peer instead (sdpa_cudnn, ...)")
    p.add_argument("--mod", default=None, choices=["window", "softcap", "alibi", "sinks"])
    p.add_argument("--epilogue", action="store_true", help="with the int8 output epilogue")
    p.add_argument("--tree", action="store_true", help="rows are tree steps: B,CTX,T[@SPLITSxSTAGES]")
    args = p.parse_args()
    if args.mod:
        return with_modifier(args)
    if args.tree:
        return tree_steps(args)
    for spec in args.rows:
        cfg, plan, forced = row_of_spec(spec, args.dtype, "profile", args.kv)
        method = args.peer or "mmha"
        with method_context(method):
            prob = Problem(cfg, "sdpa" if args.peer else "mmha")
            fn = make_fn(method, prob, plan)
            err = prob.error(fn())
            assert err < TOLERANCE[args.dtype], f"{spec}: max error {err}"
            if args.epilogue:
                fn, plan = with_epilogue(cfg, prob, fn, forced)
            launch_in_range(fn, args.iters, "peer" if args.peer else "mmha")
        print(f"{spec} plan={plan.num_splits}x{plan.stages} max_err={err:.2e}", flush=True)


def launch_in_range(fn, iters: int, name: str = "mmha") -> None:
    """``iters`` calls of ``fn`` inside the NVTX range ``name`` (what ncu --nvtx-include catches)."""
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def with_epilogue(cfg: Config, prob: Problem, plain, forced: bool):
    """The row's call through the int8 epilogue of ``mmha.bench.epilogue`` (its plan unless one
    is forced), checked against the epilogue of the plain output."""
    from mmha.bench import epilogue
    from mmha.bench.methods import mmha_fn

    assert not forced, "--epilogue takes the dispatcher's plan"
    plan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
                        cfg.torch_dtype, epilogue=True)  # fmt: skip
    epi = epilogue.make_epilogue(cfg.num_heads * cfg.head_dim, 0)
    fn = mmha_fn(prob, plan, "auto", epilogue=epi)
    want = epi.apply(plain().clone(), cfg.torch_dtype)
    steps = int((fn().int() - want.int()).abs().max())
    assert steps <= 1, f"epilogue: {steps} int8 steps from the plain output's epilogue"
    return fn, plan


def tree_steps(args) -> None:
    from mmha.bench import tree

    for spec in args.rows:
        row, splits, stages = tree.spec_row(spec, args.kv)
        layer = tree.Layer(row, seed=0)
        ref = tree.reference_out(layer)
        fn = tree.mmha_fn(layer, splits, stages)
        err = tree.error(fn(), layer, ref)
        assert err < TOLERANCE["fp16"], f"tree {spec}: max error {err}"
        launch_in_range(fn, args.iters)
        kv = f" kv={row.kv}" if row.kv else ""
        print(f"tree {spec} {row.shape}{kv} max_err={err:.2e}", flush=True)


def with_modifier(args) -> None:
    from mmha.bench import mods

    m = mods.mods_of(args.mod)
    for spec in args.rows:
        b, hq, hkv, d, s = (int(x) for x in spec.partition("@")[0].split(","))
        assert (hq, d) == (mods.HQ, mods.D), f"{spec}: --mod rows have Hq {mods.HQ} and D {mods.D}"
        layer = mods.Layer(b, hkv, s, seed=0)
        fn = mods.mmha_fn(layer, m)
        err = mods.error(fn(), layer, m)
        assert err < TOLERANCE["fp16"], f"{spec} {args.mod}: max error {err}"
        launch_in_range(fn, args.iters)
        print(f"{spec} {args.mod} max_err={err:.2e}", flush=True)


if __name__ == "__main__":
    main()
