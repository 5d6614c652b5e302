"""Attention over a packed row (trainer/attention.py): per sample, never across samples.

The CPU kernel is checked against SDPA with the block-diagonal causal mask; the CUDA kernel's
adapter (torch's varlen API changed between releases) against stand-ins of both API versions;
the model's packed forward is checked to take that path. The real FlashAttention kernel runs
only on a GPU (skipped elsewhere; `test_trainer_gpu.py` trains through it too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lockgate.trainer import attention
from lockgate.trainer.model import forward_logits, load_policy, pad_batch

LENGTHS = [5, 1, 9, 3]


def _qkv(
    dtype: torch.dtype = torch.float32, heads: int = 4, kv_heads: int = 2, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (
        torch.randn(total, h, 16, generator=gen).to(device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu.to(device)


def _masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over the whole row with the block-diagonal causal mask: what packing must equal."""
    sample = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    pos = torch.arange(len(sample))
    mask = (sample[:, None] == sample[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask.to(q.device),
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def test_the_cpu_kernel_equals_sdpa_with_the_block_mask() -> None:
    q, k, v, cu = _qkv()
    out = attention.per_sample_sdpa(q, k, v, cu, max(LENGTHS), 16**-0.5)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _masked_reference(q, k, v), rtol=1e-5, atol=1e-6)


def _fake_varlen(new_api: bool, seen: list[dict[str, Any]]) -> Callable[..., torch.Tensor]:
    """A stand-in for torch.nn.attention.varlen.varlen_attn with either release's keywords,
    computing with the CPU kernel what the real one would."""

    T = torch.Tensor

    def run(q: T, k: T, v: T, cu_q: T, cu_k: T, max_q: int, max_k: int, kw: dict[str, Any]) -> T:
        seen.append({**kw, "kv_heads": k.shape[1]})
        assert cu_q is cu_k and max_q == max_k == max(LENGTHS)
        scale = kw.get("scale") or q.shape[-1] ** -0.5
        return attention.per_sample_sdpa(q.float(), k.float(), v.float(), cu_q, max_q, scale)

    if new_api:

        def varlen_attn(q: T, k: T, v: T, cu_q: T, cu_k: T, max_q: int, max_k: int, *,
                        scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                        enable_gqa: bool = False) -> T:  # fmt: skip
            assert window_size == (-1, 0), "must ask for causal attention"
            return run(q, k, v, cu_q, cu_k, max_q, max_k, {"scale": scale, "gqa": enable_gqa})

    else:

        def varlen_attn(  # type: ignore[misc]
            q: T, k: T, v: T, cu_q: T, cu_k: T, max_q: int, max_k: int, is_causal: bool = False
        ) -> T:
            assert is_causal, "must ask for causal attention"
            assert k.shape[1] == q.shape[1], "this release has no grouped-query attention"
            return run(q, k, v, cu_q, cu_k, max_q, max_k, {})

    return varlen_attn


@pytest.mark.parametrize("new_api", [True, False], ids=["window_size-api", "is_causal-api"])
def test_the_cuda_kernel_adapter_speaks_both_varlen_apis(
    monkeypatch: pytest.MonkeyPatch, new_api: bool
) -> None:
    from torch.nn.attention import varlen

    seen: list[dict[str, Any]] = []
    fake = _fake_varlen(new_api, seen)
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    kernel = attention._flash_varlen()
    assert kernel is not None
    q, k, v, cu = _qkv(torch.bfloat16)
    out = kernel(q, k, v, cu, max(LENGTHS), 16**-0.5)
    torch.testing.assert_close(out.float(), _masked_reference(q, k, v), rtol=2e-2, atol=2e-2)
    assert seen[-1]["kv_heads"] == (2 if new_api else 4)
    if new_api:  # grouped-query attention and the scale passed through, not expanded
        assert seen[-1]["gqa"] and seen[-1]["scale"] == 16**-0.5
    # fp32 never reaches the half-precision-only kernel
    calls = len(seen)
    kernel(q.float(), k.float(), v.float(), cu, max(LENGTHS), 16**-0.5)
    assert len(seen) == calls


def test_a_packed_forward_attends_per_sample(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_policy(tiny_model_dir, torch.device("cpu"))
    assert model.config._attn_implementation == attention.IMPLEMENTATION
    used: list[torch.device] = []
    real = attention.kernel_for
    monkeypatch.setattr(attention, "kernel_for", lambda device: used.append(device) or real(device))
    rows = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [9, 8, 7, 6, 5]]
    ids = pad_batch(rows, torch.long, torch.device("cpu"))
    lengths = [len(r) for r in rows]
    packed = forward_logits(model, ids, lengths, pack=True)
    assert len(used) == model.config.num_hidden_layers  # every layer took the per-sample path
    alone = forward_logits(model, ids, lengths, pack=False)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("variant", "path"),
    [({"softcap": 30.0}, "sdpa"), ({"dropout": 0.1}, "sdpa"), ({"sliding_window": 4}, "written")],
)
def test_attention_the_fused_kernels_do_not_implement_takes_another_path(
    monkeypatch: pytest.MonkeyPatch, variant: dict[str, Any], path: str
) -> None:
    taken: list[str] = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: taken.append("sdpa"))
    kernel = attention.per_sample_sdpa
    monkeypatch.setattr(attention, "kernel_for", lambda device: taken.append("kernel") or kernel)
    written = attention._per_sample_windowed
    monkeypatch.setattr(
        attention, "_per_sample_windowed", lambda *a: taken.append("written") or written(*a)
    )
    q, k, v, cu = _qkv()
    rows = [t.transpose(0, 1)[None] for t in (q, k, v)]
    attention.packed_attention(
        torch.nn.Module(), *rows, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS), **variant
    )
    attention.packed_attention(
        torch.nn.Module(), *rows, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
    )
    assert taken == [path, "kernel"]


def _gpt_oss_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None
) -> torch.Tensor:
    """transformers' own gpt-oss attention (eager, with its additive mask) on each sample."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(sinks)  # type: ignore[assignment]
    module.num_key_value_groups = q.shape[1] // k.shape[1]  # type: ignore[assignment]
    module.training = False
    out = []
    for a, b in zip(_bounds()[:-1], _bounds()[1:], strict=True):
        n = b - a
        allowed = attention.causal_allowed(n, n, window, q.device)
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        rows = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
        out.append(eager_attention_forward(module, *rows, mask, scaling=16**-0.5)[0][0])
    return torch.cat(out)


def _bounds() -> list[int]:
    return [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]


@pytest.mark.parametrize("window", [None, 4])
def test_sinks_and_a_window_are_gpt_osss_attention_packed_and_not(window: int | None) -> None:
    q, k, v, cu = _qkv()
    sinks = torch.tensor([2.0, -1.0, 0.5, 0.0])
    want = _gpt_oss_reference(q, k, v, sinks, window)
    rows = [t.transpose(0, 1)[None] for t in (q, k, v)]
    extra = {"s_aux": sinks, "sliding_window": window}
    packed, _ = attention.packed_attention(
        torch.nn.Module(), *rows, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS), **extra
    )
    torch.testing.assert_close(packed[0], want, rtol=1e-5, atol=1e-5)
    # One sample alone, without a mask (causal alone holds) and with SDPA's boolean one.
    n = LENGTHS[2]
    a = _bounds()[2]
    one = [t[a : a + n].transpose(0, 1)[None] for t in (q, k, v)]
    alone, _ = attention.packed_attention(torch.nn.Module(), *one, None, **extra)
    torch.testing.assert_close(alone[0], want[a : a + n], rtol=1e-5, atol=1e-5)
    mask = attention.causal_allowed(n, n, window, q.device)[None, None]
    masked, _ = attention.packed_attention(torch.nn.Module(), *one, mask, **extra)
    torch.testing.assert_close(masked[0], want[a : a + n], rtol=1e-5, atol=1e-5)
    # The sinks matter: without them the answer differs.
    plain = _gpt_oss_reference(q, k, v, torch.full((4,), -1e9), window)
    assert (plain - want).abs().max() > 1e-2


def test_a_window_keeps_the_last_keys_it_names() -> None:
    allowed = attention.causal_allowed(2, 5, 3, torch.device("cpu"))
    # Queries at positions 3 and 4 of 5: each sees itself and the two keys before it.
    assert allowed.tolist() == [
        [False, True, True, True, False],
        [False, False, True, True, True],
    ]
