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


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention written out: q [H, Tq, D], k and v [Hkv, Tk, D], `allowed` a boolean [Tq, Tk]
    (or broadcastable) mask -> [Tq, H, D].

    With `sinks` (one logit per head, gpt-oss's), each head's softmax runs over its scores and
    its sink, and the sink's share attends to nothing: no fused kernel here takes sinks, so a
    model that has them runs this one, on every device.
    """
    if q.shape[0] != k.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    # Max-subtracted before the softmax, as gpt-oss's reference does, so bf16 does not overflow.
    scores = scores - scores.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1)


def causal_allowed(
    q_len: int, k_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[Tq, Tk]: the queries are the last `q_len` of `k_len` positions; each sees itself and
    the keys before it, only the last `window` of them (itself included) with a window."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _per_sample_windowed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Each packed sample through `sink_attention` in turn: [T, H, D] -> [T, H, D]."""
    out = []
    for a, b in pairwise(cu.tolist()):
        allowed = causal_allowed(b - a, b - a, window, q.device)
        out.append(
            sink_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                allowed,
                scale,
                sinks,
            )
        )
    return torch.cat(out)


def _masked_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A batch [B, H, Tq, D] under transformers' mask (SDPA's: boolean, True attends; None
    when the causal rule alone holds), with sinks: -> [B, Tq, H, D]."""
    q_len, k_len = query.shape[2], key.shape[2]
    out = []
    for i in range(query.shape[0]):
        if attention_mask is None:
            allowed = causal_allowed(q_len, k_len, window, query.device)
        elif attention_mask.dtype == torch.bool:
            allowed = attention_mask[i, 0]
        else:  # an additive float mask
            allowed = attention_mask[i, 0] > float("-inf")
        out.append(sink_attention(query[i], key[i], value[i], allowed, scale, sinks))
    return torch.stack(out)


# Variants of attention the fused kernels do not implement: a soft cap takes SDPA's path, a
# sliding window or sinks the written-out one above.
_NOT_FUSED = ("sliding_window", "softcap", "s_aux")


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
    """transformers' attention signature: query [B, H, T, D] -> output [B, T, H, D].

    A packed row (one, with its samples' bounds) runs per sample; anything else (one sample, a
    padded batch, a KV cache) runs under transformers' mask. Sinks or a sliding window take the
    written-out attention on both paths, since SDPA knows neither sinks nor, without a mask, a
    window; a soft cap takes SDPA's path (it passes the cap on).
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks, window = kwargs.get("s_aux"), kwargs.get("sliding_window")
    written_out = (sinks is not None or window is not None) and kwargs.get("softcap") is None
    packed = cu_seq_lens_q is not None and max_length_q is not None and query.shape[0] == 1
    plain = not kwargs.get("dropout") and all(kwargs.get(k) is None for k in _NOT_FUSED)
    if packed and written_out and not kwargs.get("dropout"):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return _per_sample_windowed(q, k, v, cu_seq_lens_q, scale, window, sinks)[None], None
    if packed and plain:
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        out = kernel_for(q.device)(q, k, v, cu_seq_lens_q, max_length_q, scale)
        return out[None], None
    if sinks is not None and not kwargs.get("dropout") and kwargs.get("softcap") is None:
        out = _masked_sink_attention(query, key, value, attention_mask, scale, window, sinks)
        return out, None
    if sinks is not None:  # no model has these together; SDPA would drop the sinks silently
        raise NotImplementedError("attention sinks with attention dropout or a soft cap")
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, **kwargs
    )


AttentionInterface.register(IMPLEMENTATION, packed_attention)
# The mask is SDPA's, for the forwards that fall back to it; the packed path ignores it.
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
