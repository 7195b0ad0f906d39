"""The row norm's semantics (``mmha.reference.rms_norm``) against the RMSNorm modules of
transformers it stands in for, on the CPU, and what ``mmha.models.hf_norms`` does without a GPU."""

from __future__ import annotations

import pytest
import torch

from mmha import reference
from mmha.models.hf_norms import layer_norms, norm_form

# (modeling module, class, the form it computes: offset, cast_first)
CLASSES = [
    ("llama", "LlamaRMSNorm", 0.0, True),
    ("qwen3", "Qwen3RMSNorm", 0.0, True),
    ("olmo2", "Olmo2RMSNorm", 0.0, False),
    ("gemma2", "Gemma2RMSNorm", 1.0, False),
    ("gemma3", "Gemma3RMSNorm", 1.0, False),
    ("gpt_oss", "GptOssRMSNorm", 0.0, False),
]


def _module(name: str, cls: str, width: int, dtype: torch.dtype):
    transformers = pytest.importorskip("transformers")
    import importlib

    del transformers
    mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    m = getattr(mod, cls)(width, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_(0.3, 0.5)
    return m.to(dtype)


def _eps(m) -> float:
    return getattr(m, "variance_epsilon", None) or m.eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, cls, offset, cast_first", CLASSES)
def test_reference_is_the_module(name, cls, offset, cast_first, dtype):
    """In its form, the reference equals the module bit for bit (the same operations in the same
    order); in the other offset it does not."""
    m = _module(name, cls, 96, dtype)
    x = (torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch.no_grad():
        theirs = m(x)
    ours = reference.rms_norm(x, m.weight, _eps(m), offset, cast_first)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)
    other = reference.rms_norm(x, m.weight, _eps(m), 1.0 - offset, cast_first)
    assert not torch.allclose(other.float(), theirs.float(), rtol=1e-2, atol=1e-2)


def test_nothing_is_fused_without_a_gpu():
    """On the CPU no module has a form (the row norm is a CUDA kernel): every norm stays."""
    from mmha.bench.families import build_family
    from mmha.hf import HFDecoder

    model = build_family("qwen3", "cpu", torch.float32)
    assert norm_form(model.model.norm) is None
    assert layer_norms(model) == []
    dec = HFDecoder(model, 1, 32)
    assert all(a.q_norm is not None and a.spec.qk_norm is None for a in dec.layers)


def test_the_operator_refuses_cpu_tensors():
    """The CPU entry of the operator exists to say so (with the extension built, GPU or not)."""
    from mmha._ext import _C

    if _C is None:
        pytest.skip("the extension is not built")
    from mmha import ops

    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor, got a tensor on cpu"):
        ops.rms_norm(x, x.clone(), [torch.ones(8)], [0, 1, 8], [1e-6])
