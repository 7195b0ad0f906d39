"""Layout pack/unpack round trips, bit-exact, all dtypes."""

import pytest
import torch

from mmha import layout


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("which", ["bshd", "bhsd"])
def test_pack_unpack_round_trip_bit_exact(dtype, which):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 4, 64, generator=g).to(dtype)
    if which == "bhsd":
        x = x.transpose(1, 2).contiguous()
    kc = layout.pack_k(x, max_seq_len=20, layout=which)
    vc = layout.pack_v(x, max_seq_len=20, layout=which)
    assert kc.shape == layout.k_cache_shape(3, 4, 20, 64, dtype)
    assert vc.shape == layout.v_cache_shape(3, 4, 20, 64)
    assert kc.shape[-1] == 16 // x.element_size()
    assert torch.equal(layout.unpack_k(kc, 17, layout=which).view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(layout.unpack_v(vc, 17, layout=which).view(torch.uint8), x.view(torch.uint8))


def test_k_layout_puts_one_chunk_of_consecutive_tokens_together():
    # cache_k[b, h, c, t, :] is elements c*x .. c*x + x-1 of token t.
    k = torch.arange(2 * 3 * 1 * 16, dtype=torch.float32).view(1, 6, 1, 16)  # [B, S, H, D]
    kc = layout.pack_k(k)
    x = 4
    for t in range(6):
        for c in range(16 // x):
            assert torch.equal(kc[0, 0, c, t], k[0, t, 0, c * x : (c + 1) * x])


def test_x_per_dtype_and_rejects_indivisible_head_dim():
    assert layout.kv_x(torch.float16) == 8
    assert layout.kv_x(torch.bfloat16) == 8
    assert layout.kv_x(torch.float32) == 4
    with pytest.raises(ValueError, match=r"head_dim \(12\) must be divisible by x = 16 // element_size = 8"):
        layout.k_cache_shape(1, 1, 4, 12, torch.float16)


def test_write_k_and_v_touch_only_their_slots():
    kc = layout.pack_k(torch.zeros(2, 8, 2, 16, dtype=torch.float16))
    vc = layout.pack_v(torch.zeros(2, 8, 2, 16, dtype=torch.float16))
    new = torch.ones(2, 3, 2, 16, dtype=torch.float16)
    layout.write_k(kc, new, 4)
    layout.write_v(vc, new, 4)
    k = layout.unpack_k(kc)
    v = layout.unpack_v(vc)
    assert k[:, 4:7].eq(1).all() and k[:, :4].eq(0).all() and k[:, 7:].eq(0).all()
    assert v[:, 4:7].eq(1).all() and v[:, :4].eq(0).all() and v[:, 7:].eq(0).all()


def test_pack_rejects_too_long_sequences():
    with pytest.raises(ValueError, match=r"max_seq_len \(4\) must be >= the sequence length \(5\)"):
        layout.pack_k(torch.zeros(1, 5, 1, 8, dtype=torch.float16), max_seq_len=4)
