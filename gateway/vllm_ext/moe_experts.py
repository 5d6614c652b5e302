"""The direct load's names and experts for models vLLM renames and repacks (gpt-oss).

Names: vLLM's gpt_oss module keeps its weights under names of its own (`attn` for `self_attn`,
`embedding`, `w13_weight` for `gate_up_proj`, experts under `routed_experts`) and says so in
its `hf_to_vllm_mapper`; a checkpoint tensor that fits no parameter as named is tried under that
renaming.

Experts: gpt-oss stores each layer's experts stacked, [experts, in, out]; vLLM-CPU keeps them as
[experts, out, in] in a blocked layout of its own (`cpu_prepack_moe_weight`), built once at
start-up. vLLM's own `reload_weights` does not rebuild it, so a replica goes on serving the old
experts (found by logprob parity, docs/models.md). The direct load builds the layout from the
new weights as start-up does and copies it into the served tensors, and copies the expert biases
into the tensors the kernel was given at start-up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# A stacked expert weight's parameter names, as vLLM's MoE layers name them.
EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def vllm_name(model: nn.Module, params: dict[str, Any], name: str) -> str:
    """`name` under the model's checkpoint renaming, with vLLM's move of expert weights under
    `routed_experts` (the name itself where the model renames nothing)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = mapper.map_name(name) if mapper is not None else None
    if mapped is None:
        return name
    try:
        from vllm.model_executor.model_loader.weight_utils import (
            maybe_remap_moe_expert_param_name,
        )
    except ImportError:  # not a vLLM worker
        return mapped
    return str(maybe_remap_moe_expert_param_name(mapped, params))


def cpu_experts(module: nn.Module) -> Any | None:
    """The vLLM-CPU expert kernel of an unquantized MoE layer, or None for any other layer."""
    method = getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if type(experts).__name__ == "CPUUnquantizedExperts" else None


def expert_shape(stored: tuple[int, ...]) -> tuple[int, ...]:
    """A stacked expert weight's shape in vLLM's layout: [experts, in, out] -> [experts, out, in]."""
    return (stored[0], stored[2], stored[1]) if len(stored) == 3 else stored


def check_experts(module: nn.Module, name: str, stored: tuple[int, ...], served: torch.Size) -> str:
    """Why the stored expert weight cannot be loaded directly ('' when it can)."""
    experts = cpu_experts(module)
    if experts is None:
        return f"{name}: experts of a kernel the direct load does not build"
    if getattr(experts, "_use_zentorch", False):
        return f"{name}: zentorch's experts"
    padded = experts._padded_intermediate_size(experts.moe_config)
    if padded != experts.moe_config.intermediate_size_per_partition:
        return f"{name}: experts padded to {padded}"
    if expert_shape(stored) != tuple(served):
        return f"{name}: stored {stored}, served {tuple(served)} as [experts, out, in]"
    return ""


def load_experts(module: nn.Module, param: torch.Tensor, stored: torch.Tensor) -> None:
    """Copy a stacked expert weight ([experts, in, out]) into the served tensor, in the
    kernel's layout."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import cpu_prepack_moe_weight

    experts = cpu_experts(module)
    weight = stored.permute(0, 2, 1).contiguous()
    param.copy_(cpu_prepack_moe_weight(weight, experts.isa))


def bias_targets(module: nn.Module, leaf: str) -> list[torch.Tensor]:
    """The tensors an expert bias must land in: the layer's, and the kernel's own reference
    where a reload since start-up left the two apart."""
    config = getattr(getattr(module, "quant_method", None), "moe_quant_config", None)
    held = getattr(config, {"w13_bias": "w1_bias", "w2_bias": "w2_bias"}.get(leaf, ""), None)
    own = getattr(module, leaf)
    return [own] if held is None or held is own else [own, held]
