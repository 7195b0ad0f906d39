"""The row norm on the GPU (csrc/kernels/row_norm.cu): against ``mmha.reference.rms_norm`` in
every dtype and form, a transformer layer's norm and a fused qkv row's per-head q/k norms in
place, strided rows, columns outside the segments untouched, CUDA-graph capture, argument errors
that name the argument and write nothing; ``mmha.models.hf_norms`` finding each transformers
RMSNorm's form and ``HFDecoder`` running with its norms fused."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import gpu
from test_norms import CLASSES, _eps, _module

from mmha import ops, reference
from mmha.models.hf_norms import norm_form

pytestmark = gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# One unit in the last place of the dtype (the block's reduction order is not torch's).
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-6}


def _close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(ours.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("cast_first", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [32, 128, 4096, 5120])
def test_layer_norm_matches_reference(width, dtype, weight_dtype, offset, cast_first):
    g = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(7, width, generator=g, device="cuda") * 2 + 0.5).to(dtype)
    w = (torch.randn(width, generator=g, device="cuda") * 0.5).to(weight_dtype)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, out, [w], [0, 1, width], [1e-6], offset, cast_first)
    _close(out, reference.rms_norm(x, w, 1e-6, offset, cast_first), dtype)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norms_in_place(dtype, per_head, whole):
    """q's and k's heads of a fused qkv row normalised in place in one launch (per head over D,
    weights [D] or [H, D]; or over each whole projection); v untouched."""
    b, hq, hkv, d = 5, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=g, device="cuda") * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    if whole:
        wq, wk = (torch.randn(n * d, generator=g, device="cuda").to(dtype) for n in (hq, hkv))
        layout = [0, 1, hq * d, hq * d, 1, hkv * d]
        expected_q, expected_k = reference.rms_norm(q, wq, 1e-6), reference.rms_norm(k, wk, 1e-5)
    else:
        shape = (lambda n: (n, d)) if per_head else (lambda n: (d,))
        wq, wk = (torch.randn(*shape(n), generator=g, device="cuda").to(dtype) for n in (hq, hkv))
        layout = [0, hq, d, hq * d, hkv, d]
        expected_q = reference.rms_norm(q.view(b, hq, d), wq, 1e-6).view(b, -1)
        expected_k = reference.rms_norm(k.view(b, hkv, d), wk, 1e-5).view(b, -1)
    v_before = v.clone()
    ops.rms_norm(qkv, qkv, [wq, wk], layout, [1e-6, 1e-5])
    _close(q, expected_q, dtype)
    _close(k, expected_k, dtype)
    assert torch.equal(v, v_before)


def test_strided_rows_and_untouched_columns():
    """Rows of a wider tensor (row stride > width) in and out; out's columns outside the segment
    keep their values."""
    big = torch.randn(6, 300, device="cuda")
    x = big[:, 10:266]
    out_big = torch.full((6, 400), 7.0, device="cuda")
    out = out_big[:, :256]
    w = torch.randn(128, device="cuda")
    ops.rms_norm(x, out, [w], [128, 1, 128], [1e-6])
    _close(out[:, 128:], reference.rms_norm(x[:, 128:], w, 1e-6), torch.float32)
    assert torch.all(out_big[:, :128] == 7.0) and torch.all(out_big[:, 256:] == 7.0)


def test_graph_capture():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)
    ops.rms_norm(x, out, [w], [0, 1, 4096], [1e-5])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.rms_norm(x, out, [w], [0, 1, 4096], [1e-5])
    x.copy_(torch.randn_like(x))
    out.zero_()
    graph.replay()
    _close(out, reference.rms_norm(x, w, 1e-5), torch.float16)


BAD = [
    (dict(x=lambda x: x.double()), "x must have dtype float16, bfloat16 or float32"),
    (dict(x=lambda x: x[0]), "x must be 2-D"),
    (dict(x=lambda x: x.t()), "x must have unit stride"),
    (dict(out=lambda o: o[:, :64]), "out must have x's shape"),
    (dict(out=lambda o: o.half()), "out must have x's dtype"),
    (dict(out=lambda o: o.cpu()), "out must be on cuda"),
    (dict(weights=lambda w: [w[:100]]), "weights[0] must hold 128 values"),
    (dict(weights=lambda w: [w.half()]), None),  # another weight dtype is fine
    (dict(weights=lambda w: [w[:64], w[:64].half()], layout=[0, 1, 64, 64, 1, 64], eps=[1e-6, 1e-6]),
     "weights[1] must have weights[0]'s dtype"),
    (dict(weights=lambda w: [w.cpu()]), "weights[0] must be on cuda"),
    (dict(weights=lambda w: []), "weights must hold 1 to 2 tensors"),
    (dict(layout=[0, 1, 129]), "layout's segment 0"),
    (dict(layout=[0, 1]), "layout must hold (col_offset, heads, cols)"),
    (dict(eps=[1e-6, 1e-6]), "eps must hold one value"),
    (dict(eps=[float("nan")]), "eps[0] must be finite"),
    (dict(offset=float("inf")), "offset must be finite"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", BAD)
def test_bad_arguments_name_them_and_write_nothing(change, message):
    x = torch.randn(4, 128, device="cuda")
    out = torch.full_like(x, 3.0)
    w = torch.randn(128, device="cuda")
    args = dict(x=x, out=out, weights=[w], layout=[0, 1, 128], eps=[1e-6], offset=0.0)
    for key, value in change.items():
        if key == "x":
            args["x"] = value(x)
        elif key == "out":
            args["out"] = value(out)
        elif key == "weights":
            args["weights"] = value(w)
        else:
            args[key] = value

    def call():
        ops.rms_norm(args["x"], args["out"], args["weights"], args["layout"], args["eps"], args["offset"])

    if message is None:
        call()
        return
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call()
    assert torch.all(out == 3.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, cls, offset, cast_first", CLASSES)
def test_norm_form_finds_each_class(name, cls, offset, cast_first, dtype):
    """The probe finds each class's offset (and, in 16 bits, where the rounding is told apart,
    its cast); the module's own output and the row norm's agree on fresh rows."""
    m = _module(name, cls, 256, dtype).cuda()
    form = norm_form(m)
    assert form is not None and form.offset == offset and form.eps == _eps(m)
    if dtype != torch.float32:
        assert form.cast_first == cast_first
    x = (torch.randn(9, 256, device="cuda") * 2).to(dtype)
    with torch.no_grad():
        theirs = m(x)
    ours = ops.rms_norm(x, torch.empty_like(x), [m.weight.detach()], [0, 1, 256], [form.eps], form.offset,
                        form.cast_first)  # fmt: skip
    _close(ours, theirs, dtype)


def test_norm_form_refuses_a_layer_norm():
    ln = torch.nn.LayerNorm(128).cuda()
    with torch.no_grad():
        ln.bias.normal_()
    assert norm_form(ln) is None


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2", "llama3"])
def test_decoder_fuses_the_norms(family):
    """HFDecoder swaps every RMSNorm of the layers and the final norm; per-head q/k norms (Qwen 3,
    Gemma 3) go into the kernel's q/k build (the layers' specs), OLMo 2's whole-projection ones
    to one row-norm launch; its graphs give transformers' fp32 tokens (with fuse_norms off, the
    same tokens)."""
    from mmha.bench.families import build_family, prompts, transformers_tokens
    from mmha.hf import HFDecoder

    model = build_family(family, "cuda", torch.float32)
    ps = prompts(model.config.vocab_size)
    fused = HFDecoder(model, len(ps), 96)
    layers = model.config.num_hidden_layers
    assert len(fused._norms) >= 2 * layers + 1
    if family in ("qwen3", "gemma3"):
        assert all(a.row_norm is None and a.layer.spec.qk_norm is not None for a in fused._attention)
        assert all(s.qk_norm is not None for s in fused.cache.attention)
    if family == "olmo2":
        assert all(a.row_norm is not None and a.layer.spec.qk_norm is None for a in fused._attention)
    ours = fused.generate(ps, 24, eos_token_id=[])
    plain = HFDecoder(model, len(ps), 96, fuse_norms=False).generate(ps, 24, eos_token_id=[])
    assert ours == plain == transformers_tokens(model, 24)


def test_a_norm_kept_in_fp32_is_probed_in_the_model_dtype():
    """A bf16 model whose final norm's weight stays fp32: the Llama form would return fp32 there
    (weight * n.to(bf16) promotes), so that norm keeps running as it is; the others are swapped."""
    from mmha.bench.families import build_family
    from mmha.models.hf_norms import layer_norms

    model = build_family("llama3", "cuda", torch.bfloat16)
    model.model.norm.float()
    names = [(type(p).__name__, n) for p, n, _ in layer_norms(model)]
    assert ("LlamaModel", "norm") not in names
    assert len(names) == 2 * model.config.num_hidden_layers
