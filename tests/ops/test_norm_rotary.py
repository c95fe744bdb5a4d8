"""RMSNorm and rotary embeddings: fast path == reference, llama3 scaling == transformers."""

from __future__ import annotations

import math

import pytest
import torch

from nbengine.ops.rms_norm import rms_norm, rms_norm_ref
from nbengine.ops.rotary import RotaryEmbedding, apply_rotary_ref, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 48, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=tol, rtol=tol)
    # Normalised rows have unit RMS before scaling.
    out = rms_norm(x.float(), torch.ones(48), 1e-6)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(7, 3), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_cached_tables_match_reference(scaling: dict | None) -> None:
    g = torch.Generator().manual_seed(1)
    rot = RotaryEmbedding(32, 512, 10000.0, scaling)
    pos = torch.tensor([0, 1, 5, 100, 511, 3])
    q, k = torch.randn(6, 4, 32, generator=g), torch.randn(6, 2, 32, generator=g)
    q1, k1 = rot(pos, q, k)
    q2, k2 = apply_rotary_ref(q, k, pos, rope_inv_freq(32, 10000.0, scaling))
    torch.testing.assert_close(q1, q2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
    # Rotation preserves norms and position 0 is the identity.
    torch.testing.assert_close(q1.norm(dim=-1), q.norm(dim=-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q1[0], q[0])


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_scaling=dict(scaling),
        rope_theta=500000.0,
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(64, 500000.0, scaling)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-7, rtol=1e-5)
    # Scaling changes the low frequencies and leaves the highest one alone.
    plain = rope_inv_freq(64, 500000.0, None)
    assert ours[0] == plain[0] and math.isclose(float(ours[-1]), float(plain[-1]) / 8, rel_tol=1e-5)


def _hf_rope(rope_type: str, scaling: dict, **cfg_kw: object):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_scaling=dict(scaling),
        rope_theta=10000.0,
        **cfg_kw,
    )
    return cfg, ROPE_INIT_FUNCTIONS[rope_type]


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
            "attention_factor": 1.2,
            "truncate": False,
        },
    ],
)
def test_yarn_matches_transformers(scaling: dict) -> None:
    from nbengine.ops.rotary import rope_parameters

    cfg, fn = _hf_rope("yarn", scaling)
    theirs, their_factor = fn(cfg, "cpu")
    ours, our_factor = rope_parameters(64, 10000.0, scaling, 4096, 4096)
    torch.testing.assert_close(ours, theirs.float(), atol=0, rtol=1e-6)
    assert our_factor == pytest.approx(their_factor, rel=1e-9)


def test_dynamic_ntk_matches_transformers() -> None:
    from nbengine.ops.rotary import rope_parameters

    scaling = {"rope_type": "dynamic", "factor": 2.0}
    cfg, fn = _hf_rope("dynamic", scaling)
    # Within max_position_embeddings transformers keeps the unscaled frequencies...
    within, _ = rope_parameters(64, 10000.0, scaling, 4096, 4096)
    torch.testing.assert_close(within, rope_inv_freq(64, 10000.0, None), atol=0, rtol=1e-6)
    torch.testing.assert_close(within, fn(cfg, "cpu", seq_len=1000)[0].float(), atol=0, rtol=1e-6)
    # ...and past it rescales the base by the sequence length.
    longer, _ = rope_parameters(64, 10000.0, scaling, 6000, 4096)
    torch.testing.assert_close(longer, fn(cfg, "cpu", seq_len=6000)[0].float(), atol=0, rtol=1e-6)


@pytest.mark.parametrize("served,long", [(2048, False), (4096, True)])
def test_longrope_matches_transformers(served: int, long: bool) -> None:
    from nbengine.ops.rotary import rope_parameters

    short_f = [1.0 + 0.05 * i for i in range(32)]
    long_f = [1.0 + 0.5 * i for i in range(32)]
    scaling = {
        "type": "su",
        "short_factor": short_f,
        "long_factor": long_f,
        "original_max_position_embeddings": 2048,
    }
    cfg, fn = _hf_rope("longrope", {**scaling, "rope_type": "longrope"})
    theirs, their_factor = fn(cfg, "cpu", seq_len=served)
    ours, our_factor = rope_parameters(64, 10000.0, scaling, served, 4096)
    torch.testing.assert_close(ours, theirs.float(), atol=0, rtol=1e-6)
    assert our_factor == pytest.approx(their_factor, rel=1e-9) and our_factor > 1.0


def test_partial_rotary_rotates_the_leading_channels_only() -> None:
    g = torch.Generator().manual_seed(0)
    rot = RotaryEmbedding(16, 64, 10000.0, rotary_dim=12)
    q = torch.randn(5, 3, 16, generator=g)
    k = torch.randn(5, 2, 16, generator=g)
    pos = torch.tensor([0, 3, 7, 20, 63])
    q1, k1 = rot(pos, q, k)
    q2, k2 = apply_rotary_ref(q[..., :12], k[..., :12], pos, rope_inv_freq(12, 10000.0))
    torch.testing.assert_close(q1[..., :12], q2)
    torch.testing.assert_close(k1[..., :12], k2)
    assert torch.equal(q1[..., 12:], q[..., 12:]) and torch.equal(k1[..., 12:], k[..., 12:])


def test_original_length_resolved_as_transformers_does() -> None:
    from nbengine.ops.rotary import with_original_length

    yarn = {"rope_type": "yarn", "factor": 4.0}
    cfg = {"max_position_embeddings": 4096}
    assert with_original_length(yarn, cfg)["original_max_position_embeddings"] == 4096
    phi = {
        "type": "longrope",
        "short_factor": [1.0],
        "long_factor": [2.0],
        "original_max_position_embeddings": 1024,
    }
    top = {"max_position_embeddings": 4096, "original_max_position_embeddings": 2048}
    assert with_original_length(phi, top)["original_max_position_embeddings"] == 2048
    assert with_original_length(phi, cfg) is phi
    linear = {"rope_type": "linear", "factor": 2.0}
    assert with_original_length(linear, top) is linear
