"""The direct load's renaming and expert checks for gpt-oss (gateway/vllm_ext/moe_experts.py), on
vLLM's own gpt-oss name mapper and a stand-in for vLLM-CPU's expert kernel. The real load, at
logprob parity after each sync, is tests/vllm/test_train_families.py's gpt-oss run."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lockgate.gateway.vllm_ext import moe_experts


class CPUUnquantizedExperts:
    """Named as vLLM-CPU's kernel; pads nothing unless told."""

    def __init__(self, intermediate: int, padded: int | None = None) -> None:
        self.moe_config = SimpleNamespace(intermediate_size_per_partition=intermediate)
        self._padded = padded or intermediate
        self._use_zentorch = False

    def _padded_intermediate_size(self, config: Any) -> int:
        return self._padded


def _layer(experts: Any, held_bias: torch.Tensor | None = None) -> nn.Module:
    layer = nn.Module()
    layer.w13_bias = nn.Parameter(torch.zeros(4, 12), requires_grad=False)
    config = SimpleNamespace(w1_bias=layer.w13_bias if held_bias is None else held_bias)
    layer.quant_method = SimpleNamespace(
        moe_kernel=SimpleNamespace(fused_experts=experts), moe_quant_config=config
    )
    return layer


def test_gpt_oss_checkpoint_names_map_onto_vllms_parameters() -> None:
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    model = SimpleNamespace(hf_to_vllm_mapper=GptOssForCausalLM.hf_to_vllm_mapper)
    params = {
        "model.layers.0.mlp.experts.routed_experts.w13_weight": None,
        "model.layers.0.mlp.experts.routed_experts.w13_bias": None,
    }
    expected = {
        "model.embed_tokens.weight": "model.embedding.weight",
        "model.layers.0.self_attn.q_proj.weight": "model.layers.0.attn.q_proj.weight",
        "model.layers.0.self_attn.sinks": "model.layers.0.attn.sinks",
        "model.layers.0.mlp.experts.gate_up_proj": (
            "model.layers.0.mlp.experts.routed_experts.w13_weight"
        ),
        "model.layers.0.mlp.experts.gate_up_proj_bias": (
            "model.layers.0.mlp.experts.routed_experts.w13_bias"
        ),
        "model.layers.0.mlp.router.weight": "model.layers.0.mlp.router.weight",
    }
    for name, want in expected.items():
        assert moe_experts.vllm_name(model, params, name) == want
    # A model without a mapper keeps the name.
    assert moe_experts.vllm_name(nn.Module(), params, "a.b") == "a.b"


def test_an_expert_weight_loads_only_where_the_kernel_is_built_as_at_start_up() -> None:
    stored, served = (4, 8, 12), torch.Size([4, 12, 8])
    assert moe_experts.expert_shape(stored) == tuple(served)
    assert moe_experts.check_experts(_layer(CPUUnquantizedExperts(6)), "w", stored, served) == ""
    assert "[experts, out, in]" in moe_experts.check_experts(
        _layer(CPUUnquantizedExperts(6)), "w", (4, 12, 8), served
    )
    assert "padded to 8" in moe_experts.check_experts(
        _layer(CPUUnquantizedExperts(6, padded=8)), "w", stored, served
    )
    zen = CPUUnquantizedExperts(6)
    zen._use_zentorch = True
    assert "zentorch" in moe_experts.check_experts(_layer(zen), "w", stored, served)
    assert moe_experts.cpu_experts(_layer(SimpleNamespace())) is None


@pytest.mark.parametrize("apart", [False, True])
def test_an_expert_bias_lands_where_the_kernel_reads_it(apart: bool) -> None:
    held = torch.zeros(4, 12) if apart else None
    layer = _layer(CPUUnquantizedExperts(6), held_bias=held)
    targets = moe_experts.bias_targets(layer, "w13_bias")
    assert targets[0] is layer.w13_bias
    assert len(targets) == (2 if apart else 1)
    if apart:
        assert targets[1] is held
