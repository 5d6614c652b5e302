"""What a LoRA step publishes (the adapter dir vLLM loads, peft's names) and what
`lockgate export-hf --merge` makes of it (HF weights that transformers loads, the adapter
model's logits to float rounding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lockgate.coordinator.cli.main import main as cli
from lockgate.trainer.config import LoraSpec, TrainerConfig
from lockgate.trainer.logprobs import logprobs_from_dir
from lockgate.trainer.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    is_adapter_dir,
    merge_adapter,
    write_adapter,
    write_zero_adapter,
)
from lockgate.trainer.model import load_policy
from tests.support.lora_models import trained_lora_model

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, alpha=16, target_modules=["q_proj", "o_proj", "up_proj"])


@pytest.fixture
def adapter(tiny_model_dir: Path, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = trained_lora_model(tiny_model_dir, SPEC).eval()
    out = write_adapter(model.state_dict(), SPEC, tiny_model_dir, tmp_path / "step_3")
    return model, out


def test_the_adapter_dir_is_what_vllm_loads(
    adapter: tuple[torch.nn.Module, Path], tiny_model_dir: Path
) -> None:
    model, path = adapter
    assert is_adapter_dir(path) and not is_adapter_dir(tiny_model_dir)
    assert sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (4, 16, "none")
    assert config["target_modules"] == ["q_proj", "o_proj", "up_proj"]
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    layers = model.config.num_hidden_layers
    assert len(tensors) == 2 * 3 * layers  # A and B per target module, nothing of the base
    q = model.model.layers[1].self_attn.q_proj
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    assert tensors[f"{prefix}.lora_A.weight"].shape == (4, q.in_features)
    assert tensors[f"{prefix}.lora_B.weight"].shape == (q.out_features, 4)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert torch.equal(tensors[f"{prefix}.lora_B.weight"], q.lora_B.weight)


def test_export_hf_merge_loads_in_transformers_with_the_adapter_models_logits(
    adapter: tuple[torch.nn.Module, Path], tmp_path: Path, tiny_model_dir: Path
) -> None:
    model, path = adapter
    assert cli(["export-hf", str(path), str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator())
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, merged.eval()(input_ids=ids).logits
        base = load_policy(tiny_model_dir, CPU).eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert float((theirs - base).abs().max()) > 1e-2
    # The trainer's logprobs of an adapter dir are those of its merged model (parity's basis).
    seqs = ids.tolist()
    lora, plain = logprobs_from_dir(path, seqs), logprobs_from_dir(tmp_path / "merged", seqs)
    for a, b in zip(lora, plain, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_export_hf_on_an_adapter_needs_merge_and_a_base(
    adapter: tuple[torch.nn.Module, Path],
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, path = adapter
    assert cli(["export-hf", str(path), str(tmp_path / "out")]) == 2
    assert "pass --merge" in capsys.readouterr().err
    assert cli(["export-hf", str(tiny_model_dir), str(tmp_path / "out"), "--merge"]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err
    # A base that moved: named with --base, or a one-line error.
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    (path / ADAPTER_CONFIG).write_text(
        json.dumps({**config, "base_model_name_or_path": str(tmp_path / "gone")})
    )
    assert cli(["export-hf", str(path), str(tmp_path / "out"), "--merge"]) == 2
    assert "is not an HF model dir" in capsys.readouterr().err
    argv = ["export-hf", str(path), str(tmp_path / "out"), "--merge", "--base"]
    assert cli([*argv, str(tiny_model_dir)]) == 0
    assert merge_adapter(path, tmp_path / "again", tiny_model_dir).is_dir()


def test_lora_with_the_collective_transport_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="lora with weights='collective' is not built"):
        TrainerConfig(model_dir=tiny_model_dir, lora=SPEC, weights="collective")


def test_a_sharded_rank_publishes_only_the_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The rank programs' export: FSDP2 gathers the trainable tensors only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lockgate.trainer.parallel import Distributed, shard_model
    from lockgate.trainer.rank import export_adapter

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        model = trained_lora_model(tiny_model_dir, SPEC).eval()
        expected = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
        mesh = init_device_mesh("cpu", (1,))
        shard_model(model, mesh, activation_checkpointing=True)
        world = Distributed(0, 1, CPU, mesh)
        export_adapter(model, SPEC, tiny_model_dir, tmp_path / "step_1", world)
    finally:
        dist.destroy_process_group()
    tensors = load_file(str(tmp_path / "step_1" / ADAPTER_WEIGHTS))
    assert {k.removeprefix("base_model.model.") for k in tensors} == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(tensors[f"base_model.model.{name}"], tensor)


def test_the_zero_adapter_is_the_base_model_under_an_adapters_shapes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A LoRA run's version 0 on the replicas: built from the model's config alone."""
    from lockgate.trainer.lora import apply_lora, read_adapter

    out = write_zero_adapter(SPEC, tiny_model_dir, tmp_path / "base_adapter")
    spec, base, tensors = read_adapter(out)
    assert (spec.rank, spec.target_modules, base) == (
        4,
        SPEC.target_modules,
        tiny_model_dir.resolve(),
    )
    adapted = load_policy(tiny_model_dir, CPU)
    apply_lora(adapted, SPEC)
    expected = {n: p.shape for n, p in adapted.named_parameters() if ".lora_" in n}
    assert {n: t.shape for n, t in tensors.items()} == expected
    assert all(not t.any() for t in tensors.values())
    adapted.load_state_dict(tensors, strict=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, load_policy(tiny_model_dir, CPU)(ids).logits)
