"""Attention over a packed row: each sample attends only to its own tokens, and nothing is
computed between samples.

Through SDPA, a packed row needs an explicit block-diagonal mask, and with a mask SDPA computes
every score of the row, cross-sample ones included (FlashAttention takes no mask), so a small
model's step costs as much as a larger one's (measured in docs/performance.md, "Trainer").
Here, on CUDA, FlashAttention's variable-length kernel
(`torch.nn.attention.varlen`) runs the row given where each sample starts; on the CPU each
sample runs through causal SDPA in turn. Both compute the attention the mask describes.

`IMPLEMENTATION` is registered with transformers; `load_policy` loads every model with it. A
forward that passes the packed row's boundaries (`cu_seq_lens_q`, as
`model.forward_logits` does) takes the paths above; any other (one sample alone, a KV cache)
runs transformers' own SDPA with its usual mask.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "lockgate_packed"

# (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N + 1], max_len, scale) -> [T, H, D]
Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


def per_sample_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """Each sample's causal attention through SDPA in turn (the CPU's kernel)."""
    bounds = cu.tolist()
    out = [
        F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1),
            k[a:b].transpose(0, 1),
            v[a:b].transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        ).transpose(0, 1)
        for a, b in pairwise(bounds)
    ]
    return torch.cat(out)


def _flash_varlen() -> Kernel | None:
    """FlashAttention's varlen kernel as a `Kernel`, or None where torch has none.

    Its keyword arguments changed across torch releases: causality is `is_causal` in some and a
    (-1, 0) `window_size` in others, and neither `scale` nor grouped-query attention is in every
    one. It takes half-precision inputs only (fp32 falls back to `per_sample_sdpa`).
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = (
        {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    )
    native_gqa = "enable_gqa" in params
    takes_scale = "scale" in params

    def kernel(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, n: int, scale: float
    ) -> torch.Tensor:
        default_scale = math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6)
        if q.dtype not in (torch.float16, torch.bfloat16) or not (takes_scale or default_scale):
            return per_sample_sdpa(q, k, v, cu, n, scale)
        extra = dict(causal)
        if takes_scale:
            extra["scale"] = scale
        if q.shape[1] != k.shape[1]:
            if native_gqa:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return varlen_attn(q, k, v, cu, cu, n, n, **extra)

    return kernel


_CUDA_KERNEL = _flash_varlen()


def kernel_for(device: torch.device) -> Kernel:
    if device.type == "cuda" and _CUDA_KERNEL is not None:
        return _CUDA_KERNEL
    return per_sample_sdpa


# Variants of attention the per-sample kernels do not implement: such a model takes SDPA's.
_NOT_HANDLED = ("sliding_window", "softcap", "s_aux")


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D] -> output [1, T, H, D]."""
    plain = not kwargs.get("dropout") and all(kwargs.get(k) is None for k in _NOT_HANDLED)
    if cu_seq_lens_q is None or max_length_q is None or query.shape[0] != 1 or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = kernel_for(q.device)(q, k, v, cu_seq_lens_q, max_length_q, scale)
    return out[None], None


AttentionInterface.register(IMPLEMENTATION, packed_attention)
# The mask is SDPA's, for the forwards that fall back to it; the packed path ignores it.
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
