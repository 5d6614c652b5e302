"""FlashAttention's varlen kernel on a GPU against the block-diagonal causal mask (the CPU kernel
and the adapter: tests/unit/trainer/test_trainer_attention.py)."""

from __future__ import annotations

import torch

from lockgate.trainer import attention
from tests.support.trainer_runs import needs_gpu
from tests.unit.trainer.test_trainer_attention import LENGTHS, _masked_reference, _qkv


@needs_gpu
def test_flash_varlen_on_the_gpu_equals_the_block_mask() -> None:
    q, k, v, cu = _qkv(torch.bfloat16, device="cuda")
    kernel = attention.kernel_for(q.device)
    assert kernel is not attention.per_sample_sdpa, "this torch has no varlen attention"
    out = kernel(q, k, v, cu, max(LENGTHS), 16**-0.5)
    torch.testing.assert_close(out.float(), _masked_reference(q, k, v), rtol=2e-2, atol=2e-2)
