"""Launch mmha on a few benchmark rows, as dispatched, for Nsight Compute (bench/profile.sh).

Each row: B,Hq,Hkv,D,S (fp16). Every row is checked against the fp32 reference first, then
launched ``--iters`` times so ncu can pick one launch per row. With ``--peer NAME`` (an SDPA
backend of mmha.bench, e.g. sdpa_cudnn) that peer runs instead, its ``--iters`` launches inside
an NVTX range named "peer" (profile with ``ncu --nvtx --nvtx-include peer/``), so the set-up
kernels before it are not caught.
"""

from __future__ import annotations

import argparse

import torch

from mmha import ops
from mmha.bench import TOLERANCE, Config, Problem, backend_context, mmha_fn, sdpa_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("rows", nargs="+", help="B,Hq,Hkv,D,S")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-check", action="store_true", help="skip the reference check (diagnostic builds)")
    p.add_argument("--peer", default=None, help="time this SDPA backend instead (sdpa_cudnn, ...)")
    args = p.parse_args()
    for spec in args.rows:
        b, hq, hkv, d, s = (int(x) for x in spec.split(","))
        cfg = Config("profile", b, hq, hkv, d, s, args.dtype)
        prob = Problem(cfg)
        splits = ops.plan_for("cuda", b, hq, hkv, d, s, cfg.torch_dtype).num_splits
        fn = mmha_fn(prob, splits) if args.peer is None else sdpa_fn(prob)
        with backend_context(args.peer or "mmha"):
            out = fn().float()
            ref = prob.reference(list(range(b)))
            err = (out - ref).abs().max().item()
            assert args.no_check or err < TOLERANCE[args.dtype], f"{spec}: max error {err}"
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("peer" if args.peer else "mmha")
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        print(f"{spec} splits={splits} max_err={err:.2e}", flush=True)


if __name__ == "__main__":
    main()
