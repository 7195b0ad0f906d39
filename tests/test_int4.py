"""The int4 cache format and its reference step (mmha.int4): packing, the K groups and their
residual, prefill against appends, the step against attention over the format's values, row modes
and bad input."""

import pytest
import torch

from mmha import int4, quant, reference
from mmha.spec import ROW_ATTEND, ROW_IDLE, ROW_STEP, AttentionSpec, Rotary


def test_nibbles_pack_two_channels_a_byte():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = int4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(int4.unpack_nibbles(packed), codes)
    every = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(int4.unpack_nibbles(int4.pack_nibbles(every)), every)


def test_empty_cache_shapes_and_bad_sizes():
    c = int4.Int4Cache.empty(2, 3, 128, 64, torch.float16)
    assert c.k_codes.shape == (2, 3, 2, 128, 16) and c.v_codes.shape == (2, 3, 128, 32)
    assert c.k_scale.shape == c.k_zero.shape == (2, 3, 2, 64) and c.v_scale.shape == (2, 3, 128)
    assert c.k_residual.shape == (2, 3, 128, 64) and c.k_residual.dtype == torch.float16
    with pytest.raises(ValueError, match="max_seq_len must be a multiple of 64"):
        int4.Int4Cache.empty(1, 1, 100, 64, torch.float16)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        int4.Int4Cache.empty(1, 1, 128, 80, torch.float16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        int4.Int4Cache.empty(1, 1, 128, 64, torch.float64)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        int4.Int4Cache.empty(1, 0, 128, 64, torch.float16)


def _tokens(n, hkv=2, d=64, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=g)
    if outliers:  # a few channels carrying most of K's magnitude, as trained models' keys do
        k[:, :, [3, 35]] *= 20.0
    return k, torch.randn(hkv, n, d, generator=g)


def test_a_group_stays_in_the_residual_until_its_last_token():
    c = int4.Int4Cache.empty(1, 2, 128, 64, torch.bfloat16)
    k, v = _tokens(64)
    for t in range(63):
        c.append(0, t, k[:, t], v[:, t])
    assert c.k_codes.count_nonzero() == 0 and c.k_scale.count_nonzero() == 0
    assert torch.equal(c.k_residual[0, :, :63], k[:, :63].to(torch.bfloat16))
    keys, _ = c.read(0, 63)
    assert torch.equal(keys, k[:, :63].to(torch.bfloat16).float())  # the partial group: 16-bit
    c.append(0, 63, k[:, 63], v[:, 63])
    f16 = int4.SCALE_DTYPE
    codes, scale, zero = quant.quantize(
        k.to(torch.bfloat16).transpose(-1, -2), 4, symmetric=False, scale_dtype=f16
    )
    assert c.k_scale.dtype == c.k_zero.dtype == c.v_scale.dtype == c.v_zero.dtype == f16
    assert torch.equal(c.k_scale[0, :, 0].float(), scale) and torch.equal(c.k_zero[0, :, 0].float(), zero)
    keys, values = c.read(0, 64)
    assert torch.equal(keys, quant.dequantize(codes, scale, zero).transpose(-1, -2))
    v_codes, v_scale, v_zero = quant.quantize(v, 4, symmetric=False, scale_dtype=f16)
    assert torch.equal(values, quant.dequantize(v_codes, v_scale, v_zero))


def test_k_nibble_order_pairs_channels_by_one_mask():
    """In a K word, the low nibbles of bytes 0 and 2 are channels 0, 1, their high nibbles 4, 5;
    bytes 1 and 3 hold 2, 3 (low) and 6, 7 (high): what `w & 0x000F000F` and `w & 0x00F000F0` of
    the word (shifted by 8 j) hand the kernel as pairs."""
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16) % 16
    packed = int4.pack_k(codes)
    assert packed.tolist() == [[0x40, 0x62, 0x51, 0x73, 0xC8, 0xEA, 0xD9, 0xFB]]
    assert torch.equal(int4.unpack_k(packed), codes)
    every = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    assert torch.equal(int4.unpack_k(int4.pack_k(every)), every)


def test_k_codes_sit_in_the_x_layout_chunks():
    """Channel c of slot s: chunk c // 32, in that slot's 16 bytes word (c % 32) // 8, within the word
    nibble K_NIBBLES.index(c % 8) (byte nibble // 2, the low or high half by nibble % 2)."""
    c = int4.Int4Cache.empty(1, 1, 64, 64, torch.float32)
    k, v = _tokens(64, hkv=1)
    c.prefill(0, k, v)
    codes, _, _ = quant.quantize(k.transpose(-1, -2), 4, symmetric=False)  # [1, D, 64]
    for s, ch in ((0, 0), (5, 1), (17, 33), (63, 62), (40, 63), (9, 6), (22, 44)):
        nib = int4.K_NIBBLES.index(ch % 8)
        byte = c.k_codes[0, 0, ch // 32, s, 4 * ((ch % 32) // 8) + nib // 2].item()
        assert (byte >> (4 * (nib % 2))) & 0xF == codes[0, ch, s].item()


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130, 192])
def test_prefill_equals_appending_the_prompt_token_by_token(n):
    a = int4.Int4Cache.empty(2, 2, 192, 64, torch.float16)
    b = int4.Int4Cache.empty(2, 2, 192, 64, torch.float16)
    k, v = _tokens(n, seed=n, outliers=True)
    a.prefill(1, k, v)
    for t in range(n):
        b.append(1, t, k[:, t], v[:, t])
    for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    ring = [s % 128 for s in range(n // 64 * 64, n)]  # the partial group's residual entries
    assert torch.equal(a.k_residual[:, :, ring], b.k_residual[:, :, ring])
    assert torch.equal(a.read(1, n)[0], b.read(1, n)[0])
    with pytest.raises(ValueError, match="does not fit max_seq_len 192"):
        a.prefill(0, *_tokens(200))


def test_per_channel_k_keeps_outlier_channels_apart():
    """K per channel over 64 tokens loses far less on outlier-channel keys than K per token (the
    reason for the format: docs/status.md)."""
    k, v = _tokens(256, outliers=True, seed=3)
    c = int4.Int4Cache.empty(1, 2, 256, 64, torch.float32)
    c.prefill(0, k, v)
    keys, _ = c.read(0, 256)
    per_token = quant.dequantize(*quant.quantize(k, 4, symmetric=False))
    plain = torch.ones(64, dtype=torch.bool)
    plain[[3, 35]] = False  # the ordinary channels, which a token's outliers leave a coarse step
    ours = (keys - k)[..., plain].norm() / k[..., plain].norm()
    assert ours < 0.15 and ours < 0.25 * (per_token - k)[..., plain].norm() / k[..., plain].norm()


def _step_case(b=3, hq=8, hkv=2, d=64, s_max=192, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    return qkv, int4.Int4Cache.empty(b, hkv, s_max, d, dtype)


def test_step_attends_over_the_formats_values():
    """Rows at lengths inside a group, at a group's last slot and past it: the step's output is
    attention (mmha.reference.attend) over what the cache reads back after the append, rotary on."""
    spec = AttentionSpec(rotary=Rotary(dim=64, theta=10000.0))
    qkv, c = _step_case()
    lengths = torch.tensor([10, 63, 130])
    for row, n in enumerate(lengths.tolist()):
        c.prefill(row, *_tokens(n, seed=row))
    out, lse = int4.decode_step(qkv, c, lengths, num_heads=8, num_kv_heads=2, attention=spec, return_lse=True)
    assert out.shape == (3, 8 * 64) and out.dtype == torch.float16 and lse.shape == (3, 8)
    q, k, v = reference.project_tokens(qkv.float(), lengths, 8, 2, 64, spec, torch.float16)
    for row, n in enumerate(lengths.tolist()):
        keys, values = c.read(row, n + 1)
        if n % 64 != 63:  # the new key waits in the residual, rounded to fp16
            assert torch.equal(keys[:, n], k[row].to(torch.float16).float())
        o, want_lse = reference.attend(q[row], keys, values, spec.scale_for(64), spec, n)
        torch.testing.assert_close(out[row], o.reshape(-1).to(torch.float16), rtol=0, atol=0)
        torch.testing.assert_close(lse[row], want_lse, rtol=1e-6, atol=1e-6)
    assert c.k_scale[1, :, 0].count_nonzero() > 0  # row 1's append filled its first group


def test_step_stays_near_the_unquantised_step():
    """int4 keeps attention usable: the output's error against the same step over an fp32 cache."""
    qkv, c = _step_case(b=2, s_max=512, dtype=torch.float32, seed=4)
    k, v = _tokens(400, seed=5)
    for row in range(2):
        c.prefill(row, k, v)
    lengths = torch.tensor([400, 400])
    out = int4.decode_step(qkv, c, lengths, num_heads=8, num_kv_heads=2)
    from mmha import layout

    kc = layout.pack_k(k[None], 512, layout="bhsd").repeat(2, 1, 1, 1, 1)
    vc = torch.zeros(2, 2, 512, 64)
    vc[:, :, :400] = v
    want = reference.decode_step(qkv, kc, vc, lengths, num_heads=8, num_kv_heads=2)
    err = (out - want).norm() / want.norm()
    assert 0 < err < 0.2


def test_row_modes_and_positions():
    qkv, c = _step_case(b=3)
    for row in range(3):
        c.prefill(row, *_tokens(70, seed=row))
    before = int4.Int4Cache(**{k: t.clone() for k, t in vars(c).items()})
    modes = torch.tensor([ROW_IDLE, ROW_ATTEND, ROW_STEP])
    out, lse = int4.decode_step(
        qkv, c, torch.tensor([70, 70, 70]), num_heads=8, num_kv_heads=2, row_active=modes, return_lse=True
    )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    for name, t in vars(c).items():  # rows 0 and 1 wrote nothing
        assert torch.equal(t[:2], getattr(before, name)[:2]), name
    assert not torch.equal(c.v_codes[2], before.v_codes[2])
    keys, values = c.read(1, 70)
    q, _, _ = reference.project_tokens(
        qkv.float(), torch.tensor([70, 70, 70]), 8, 2, 64, AttentionSpec(), qkv.dtype
    )
    o, _ = reference.attend(q[1], keys, values, 64**-0.5)
    torch.testing.assert_close(out[1], o.reshape(-1).to(qkv.dtype), rtol=0, atol=0)


def test_bad_input_names_the_argument_and_writes_nothing():
    qkv, c = _step_case(b=2, s_max=128)
    c.prefill(0, *_tokens(20))
    before = {k: t.clone() for k, t in vars(c).items()}
    bad = [
        (dict(qkv=qkv[:, :-1]), "qkv must have shape"),
        (dict(qkv=qkv.float()), "qkv must have the cache's activation dtype"),
        (dict(lengths=torch.tensor([20, 128])), r"lengths\[1\] must be in \[0, 127\]"),
        (dict(num_kv_heads=4), "num_kv_heads .* must equal the cache's kv heads"),
        (dict(row_active=torch.tensor([1, 7])), r"row_active\[1\] must be one of"),
        (dict(positions=torch.tensor([1])), "positions must have shape"),
    ]
    for change, message in bad:
        args = dict(qkv=qkv, lengths=torch.tensor([20, 5]), num_kv_heads=2) | change
        with pytest.raises(ValueError, match=message):
            int4.decode_step(args.pop("qkv"), c, args.pop("lengths"), num_heads=8, **args)
        for name, t in vars(c).items():
            assert torch.equal(t, before[name]), (message, name)


def test_non_finite_values_read_back_non_finite():
    """A non-finite V gives its token a non-finite scale, a non-finite K its group's channel: the
    output says so instead of saturating."""
    qkv, c = _step_case(b=2, s_max=128, dtype=torch.float32)
    k, v = _tokens(64)
    v[:, 7, 3] = float("inf")
    c.prefill(0, k, v)
    k2 = k.clone()
    k2[0, 9, 5] = float("nan")
    c.prefill(1, k2, v.nan_to_num(posinf=1.0))
    assert not torch.isfinite(c.v_scale[0, :, 7]).all() and not torch.isfinite(c.k_scale[1, 0, 0, 5])
    out = int4.decode_step(qkv, c, torch.tensor([64, 64]), num_heads=8, num_kv_heads=2)
    assert not torch.isfinite(out[0]).all() and not torch.isfinite(out[1]).all()


def _tree_case(p, nodes, b=2, seed=0, dtype=torch.float16):
    qkv, c = _step_case(b=b, s_max=256, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    tree_qkv = torch.randn(b, nodes, qkv.shape[1], generator=g).to(dtype)
    for row in range(b):
        c.prefill(row, *_tokens(p, seed=row))
    return tree_qkv, c


SPEC = AttentionSpec(rotary=Rotary(dim=64, theta=10000.0))


@pytest.mark.parametrize("p", [5, 64, 100])
def test_a_chain_tree_equals_one_token_steps(p):
    """A chain (each node the previous one's child) that completes no group: each node's output is
    the one-token step's at its slot, and after accept the cache is the steps' cache."""
    nodes = 6
    tree_qkv, a = _tree_case(p, nodes)
    b = int4.Int4Cache(**{k: t.clone() for k, t in vars(a).items()})
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4]] * 2)
    out = int4.decode_tree(
        tree_qkv, a, torch.tensor([p, p]), parents, num_heads=8, num_kv_heads=2, attention=SPEC
    )
    for t in range(nodes):
        step = int4.decode_step(tree_qkv[:, t], b, torch.tensor([p + t] * 2), num_heads=8, num_kv_heads=2,
                                attention=SPEC)  # fmt: skip
        torch.testing.assert_close(out[:, t], step)  # the masked sum's order: an ulp at most
    for row in range(2):
        a.accept(row, p, list(range(nodes)))
    for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.read(1, p + nodes), b.read(1, p + nodes), rtol=0, atol=0)


def test_accept_across_a_group_end_commits_the_group():
    """Nodes past a group's last slot stay in the residual during the tree step (the group holds no
    codes yet); the accept that keeps them quantises the group, as one-token steps along the path
    would have."""
    p, nodes = 60, 8
    tree_qkv, a = _tree_case(p, nodes, seed=7)
    parents = torch.tensor([[-1, 0, 0, 1, 3, 4, 5, 6]] * 2)  # node 2 off the path 0-1-3-4-5-6-7
    int4.decode_tree(tree_qkv, a, torch.tensor([p, p]), parents, num_heads=8, num_kv_heads=2, attention=SPEC)
    assert a.k_scale[:, :, 0].count_nonzero() == 0  # group 0 (slots 0-63) not committed yet
    path = [0, 1, 3, 4, 5, 6, 7]
    b = _tree_case(p, nodes, seed=7)[1]
    for j, t in enumerate(path):  # the path as one-token steps
        int4.decode_step(
            tree_qkv[:, t], b, torch.tensor([p + j] * 2), num_heads=8, num_kv_heads=2, attention=SPEC
        )
    a.accept(0, p, path)
    for name in ("k_codes", "k_scale", "k_zero"):
        assert torch.equal(getattr(a, name)[0], getattr(b, name)[0]), name
    for name in ("v_codes", "v_scale", "v_zero"):  # the row's slots (past them: the tree's leftovers)
        assert torch.equal(getattr(a, name)[0, :, : p + 7], getattr(b, name)[0, :, : p + 7]), name
    assert a.k_scale[1, :, 0].count_nonzero() == 0  # row 1 kept nothing yet
    torch.testing.assert_close(a.read(0, p + 7), b.read(0, p + 7), rtol=0, atol=0)
    before = {k: t.clone() for k, t in vars(a).items()}
    with pytest.raises(ValueError, match="path must hold increasing node indices"):
        a.accept(1, p, [0, 2, 1])
    for name, t in vars(a).items():  # refused before anything moved
        assert torch.equal(t, before[name]), name


def test_tree_nodes_attend_to_their_ancestors_only():
    """Against mmha.reference.decode_tree over unquantised caches holding what the int4 cache reads
    back: the tree's mask, rotary at each node's depth and the node counts agree."""
    p = 70
    tree_qkv, c = _tree_case(p, 5, dtype=torch.float32, seed=3)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, -1, -1]])
    out, lse = int4.decode_tree(tree_qkv, c, torch.tensor([p, p]), parents, num_heads=8, num_kv_heads=2,
                                attention=SPEC, node_counts=[5, 3], return_lse=True)  # fmt: skip
    from mmha import layout

    keys, values = zip(*(c.read(row, p + 5, committed=p) for row in range(2)), strict=True)
    kc = layout.pack_k(torch.stack(keys)[:, :, :p], 256, layout="bhsd")
    vc = torch.zeros(2, 2, 256, 64)
    vc[:, :, :p] = torch.stack(values)[:, :, :p]
    want, want_lse = reference.decode_tree(tree_qkv, kc, vc, torch.tensor([p, p]), parents, num_heads=8,
                                           num_kv_heads=2, attention=SPEC, node_counts=[5, 3], return_lse=True)  # fmt: skip
    # the nodes' own K/V: 16-bit-rounded keys (fp32 here: exact) and int4 values on our side
    torch.testing.assert_close(out, want, rtol=0.15, atol=0.05)
    assert torch.equal(out[1, 3:], torch.zeros_like(out[1, 3:])) and torch.isinf(lse[1, 3:]).all()
    assert torch.isfinite(want_lse[:, :3]).all()


def test_tree_bad_input_writes_nothing():
    tree_qkv, c = _tree_case(200, 4)
    before = {k: t.clone() for k, t in vars(c).items()}
    parents = torch.tensor([[-1, 0, 1, 2]] * 2)
    cases = [
        (
            (tree_qkv, c, torch.tensor([200, 253]), parents),
            r"lengths\[1\] \+ node count must fit the capacity",
        ),
        ((tree_qkv, c, torch.tensor([200, -1]), parents), r"lengths\[1\] must be >= 0"),
        ((tree_qkv[:, :3], c, torch.tensor([200, 200]), parents), "qkv must have T = 4 nodes"),
        ((tree_qkv, c, torch.tensor([200, 200]), torch.tensor([[-1, 0, 1, 5]] * 2)), "parents"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            int4.decode_tree(*args, num_heads=8, num_kv_heads=2)
        for name, t in vars(c).items():
            assert torch.equal(t, before[name]), (message, name)


def test_the_accuracy_study_measured_this_format():
    """mmha.bench.kv_accuracy's "int4 channels fp16" keys and "int4 asym fp16" values
    (quant.roundtrip_channels, quant.roundtrip with fp16 scales) are what the cache reads back, so
    its numbers are this format's."""
    from mmha.bench import kv_accuracy

    k, v = _tokens(150, outliers=True, seed=9)
    c = int4.Int4Cache.empty(1, 2, 192, 64, torch.float32)
    c.prefill(0, k, v)
    keys, values = c.read(0, 150)
    prompt = k.transpose(0, 1)[:1]  # unused by these formats
    assert torch.equal(
        keys.double(), kv_accuracy.store("int4 channels fp16", k.transpose(0, 1), prompt).transpose(0, 1)
    )
    assert torch.equal(
        values.double(), kv_accuracy.store("int4 asym fp16", v.transpose(0, 1), prompt).transpose(0, 1)
    )
