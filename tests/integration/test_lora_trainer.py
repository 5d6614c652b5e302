"""The RL trainer with `lora` set, real torchrun ranks (FSDP2 on gloo, the tiny model): every step
publishes an adapter dir where the snapshot went (pruned as snapshots are), two ranks train the
adapters exactly as one does, and the adapter is what the trainer computes with."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from lockgate.trainer.config import LoraSpec
from lockgate.trainer.logprobs import logprobs_from_dir
from lockgate.trainer.lora import ADAPTER_WEIGHTS, is_adapter_dir
from tests.support.trainer_runs import max_diff, synthetic_batch, train

LORA = LoraSpec(rank=4, alpha=8)
# Both sides pack (one CPU rank would run samples one at a time): only the sharding differs.
OPTIONS = {"lora": LORA, "micro_batch_packing": "packed", "keep_snapshots": 2, "lr": 1e-2}


def _adapter(weights_dir: str) -> dict[str, torch.Tensor]:
    assert is_adapter_dir(Path(weights_dir)), weights_dir
    return load_file(str(Path(weights_dir) / ADAPTER_WEIGHTS))


async def test_two_ranks_publish_the_adapters_one_rank_does(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    batches = [synthetic_batch(step) for step in (1, 2, 3)]
    one = await train(tiny_model_dir, tmp_path / "ws1", 1, batches, **OPTIONS)
    two = await train(tiny_model_dir, tmp_path / "ws2", 2, batches, **OPTIONS)
    weights = Path(one[-1].weights_dir).parent
    assert sorted(p.name for p in weights.iterdir()) == ["step_2", "step_3"]  # pruned
    a, b = _adapter(one[-1].weights_dir), _adapter(two[-1].weights_dir)
    worst = max_diff(a, b)
    moved = max(float(t.abs().max()) for name, t in a.items() if "lora_B" in name)
    print(f"\nws1 vs ws2 adapter max difference {worst:.2e}; lora_B moved from 0 by {moved:.2e}")
    # AdamW's first steps move every entry by about lr whatever its gradient's size, so the
    # ranks' different summation order shows at lr's scale: compare with how far B moved.
    assert moved > 1e-3
    assert worst < 1e-3 * moved
    seq = batches[0].samples[0].input_ids
    before = logprobs_from_dir(tiny_model_dir, [seq])[0]
    after = logprobs_from_dir(Path(one[-1].weights_dir), [seq])[0]
    assert max(abs(x - y) for x, y in zip(before, after, strict=True)) > 1e-4
