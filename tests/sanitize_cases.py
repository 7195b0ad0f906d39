"""Small decode cases for compute-sanitizer (RELIABILITY.md row 20): ragged and empty rows, a row
filled to capacity, NaN in unused slots, out-of-range lengths, single pass and split/merge, blocks
of 4, 8 and 16 warps on the tensor-core loop."""

import torch
from helpers import make_case

from mmha import dispatch, ops


def main() -> None:
    for dtype, head_dim, heads in (
        (torch.float16, 128, (8, 2)),
        (torch.bfloat16, 64, (4, 4)),
        (torch.float32, 80, (16, 1)),
        (torch.float16, 256, (6, 2)),
    ):
        lengths = [0, 1, 17, 127, 255]  # 255 + 1 fills S_max = 256
        warps = dispatch.WARP_CHOICES if dispatch.uses_tensor_cores(head_dim, dtype) else (dispatch.WARPS,)
        for splits in (1, 2, 5):
            for w in warps:
                case = make_case(5, *heads, head_dim, lengths, 256, dtype, seed=splits, bias=True,
                                 rotary_dim=head_dim // 2)  # fmt: skip
                out = ops.decode_attention(
                    case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=splits, warps=w,
                    **case.kwargs(),
                )  # fmt: skip
                assert torch.isfinite(out).all()
    # Out-of-range lengths reach the kernel only with validation off: nothing may be written.
    case = make_case(3, 4, 2, 64, [3, 5, 7], 8, torch.float16, seed=0)
    case.lengths.copy_(torch.tensor([8, -1, 7], dtype=torch.int32))
    ops.decode_attention(case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=2,
                         validate_lengths=False, **case.kwargs())  # fmt: skip
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
