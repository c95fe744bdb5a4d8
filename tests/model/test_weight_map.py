"""The declarative checkpoint layout (model/weight_map.py): what it lists and what it refuses.

The parity tests (test_parity.py, test_parity_archs.py) prove the maps load real
checkpoints; these pin the layout's own rules on small models built on the meta device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbengine.model.llama import DecoderArgs, LlamaForCausalLM
from nbengine.model.weight_map import CheckpointLayout, CheckpointModule
from nbengine.model.weights import WeightSource as W


def _llama(**flags: bool) -> LlamaForCausalLM:
    a = DecoderArgs(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_positions=64,
        tie_word_embeddings=flags.get("tie", True),
        qkv_bias=flags.get("qkv_bias", False),
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        hidden_act="silu",
        fused_checkpoint=flags.get("fused", False),
    )
    with torch.device("meta"):
        return LlamaForCausalLM(a)


def test_packed_parts_fill_the_fused_rows_in_order() -> None:
    m = _llama(qkv_bias=True).hf_weight_map()
    p = "model.layers.1.self_attn."
    assert m["layers.1.self_attn.qkv_proj.bias"] == [
        W(p + "q_proj.bias", 0, 32),
        W(p + "k_proj.bias", 32, 16),
        W(p + "v_proj.bias", 48, 16),
    ]
    assert m["layers.0.mlp.gate_up_proj.weight"] == [
        W("model.layers.0.mlp.gate_proj.weight", 0, 48),
        W("model.layers.0.mlp.up_proj.weight", 48, 48),
    ]
    fused = _llama(fused=True).hf_weight_map()  # Phi-3 stores them fused
    assert fused["layers.0.self_attn.qkv_proj.weight"] == [
        W("model.layers.0.self_attn.qkv_proj.weight", 0, 64)
    ]


def test_every_parameter_once_and_a_tied_head_shares_the_embedding() -> None:
    tied, untied = _llama(tie=True), _llama(tie=False)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert "lm_head.weight" not in tied.hf_weight_map()
    assert untied.hf_weight_map()["lm_head.weight"] == [W("lm_head.weight", 0, 50)]
    for model in (tied, untied):
        assert list(model.hf_weight_map()) == [n for n, _ in model.named_parameters()]


def test_packed_parts_that_do_not_fill_the_parameter_are_refused() -> None:
    class Tiny(CheckpointModule):
        def __init__(self) -> None:
            super().__init__()
            self.checkpoint_layout = CheckpointLayout(packed={"qkv": (("q", 4), ("k", 2))})
            self.qkv = nn.Linear(3, 8, device="meta")

    with pytest.raises(ValueError, match=r"qkv.weight: the packed parts \['q', 'k'\] hold 6"):
        Tiny().hf_weight_map()
