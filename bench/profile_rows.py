"""Launch mmha on a few benchmark rows, as dispatched, for Nsight Compute (bench/profile.sh).

Each row: B,Hq,Hkv,D,S (fp16). Every row is checked against the fp32 reference first, then
launched ``--iters`` times so ncu can pick one launch per row.
"""

from __future__ import annotations

import argparse

import torch

from mmha import ops
from mmha.bench import Config, Problem, mmha_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("rows", nargs="+", help="B,Hq,Hkv,D,S")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    for spec in args.rows:
        b, hq, hkv, d, s = (int(x) for x in spec.split(","))
        cfg = Config("profile", b, hq, hkv, d, s, args.dtype)
        prob = Problem(cfg)
        splits = ops.plan_for("cuda", b, hq, hkv, d, s, cfg.torch_dtype).num_splits
        fn = mmha_fn(prob, splits)
        out = fn().float()
        ref = prob.reference(list(range(b)))
        err = (out - ref).abs().max().item()
        assert err < 2e-2, f"{spec}: max error {err}"
        for _ in range(args.iters):
            fn()
        torch.cuda.synchronize()
        print(f"{spec} splits={splits} max_err={err:.2e}", flush=True)


if __name__ == "__main__":
    main()
