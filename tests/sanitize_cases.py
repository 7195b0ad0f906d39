"""Small decode cases for compute-sanitizer (RELIABILITY.md rows 20 and 27): ragged and empty
rows, a row filled to capacity, NaN in unused slots, single pass and split/merge, both tile sources
and several stage counts of the tile loop, the CUDA-core loop, and out-of-range lengths (past the
capacity, negative) on every variant: nothing may be read or written outside the caches."""

import torch
from helpers import make_case

from mmha import dispatch, ops


def main() -> None:
    for dtype, head_dim, heads in (
        (torch.float16, 128, (8, 2)),
        (torch.bfloat16, 64, (4, 4)),
        (torch.float32, 80, (16, 1)),
        (torch.float16, 256, (6, 2)),
        (torch.bfloat16, 96, (8, 8)),
    ):
        lengths = [0, 1, 17, 127, 255]  # 255 + 1 fills S_max = 256
        tiles = dispatch.uses_tensor_cores(dtype)
        sources = (["cp_async", "tma"] if head_dim % 64 == 0 else ["cp_async"]) if tiles else ["auto"]
        for splits in (1, 2, 5):
            for source in sources:
                for stages in (2, 3) if tiles else (2,):
                    case = make_case(5, *heads, head_dim, lengths, 256, dtype, seed=splits, bias=True,
                                     rotary_dim=head_dim // 2)  # fmt: skip
                    out = ops.decode_attention(
                        case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=splits, stages=stages,
                        tile_source=source, **case.kwargs(),
                    )  # fmt: skip
                    assert torch.isfinite(out).all()
                    # Out-of-range lengths reach the kernel only with validation off.
                    case.lengths.copy_(torch.tensor([256, -1, 7, 10**6, -(2**31)], dtype=torch.int32))
                    ws = ops.Workspace.allocate("cuda", 5, heads[0], head_dim, splits)
                    out = ops.decode_attention(
                        case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=splits, stages=stages,
                        tile_source=source, validate_lengths=False, workspace=ws, **case.kwargs(),
                    )  # fmt: skip
                    torch.cuda.synchronize()
                    assert ws.status.tolist() == [1, 1, 0, 1, 1], ws.status.tolist()
                    assert torch.isnan(out[[0, 1, 3, 4]]).all() and torch.isfinite(out[2]).all()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
