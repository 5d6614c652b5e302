"""The configuration of `lockgate sft` (supervised fine-tuning). Importing it loads no torch.

`lockgate sft CONFIG` reads this from YAML or TOML (with `--set a.b=value`, as `lockgate train`
does), resolves it (`resolved`: absolute paths, the model dir filled in) and writes it to
`OUT/config.json`, which the rank program (`trainer/sft/main.py`) reads. The `trainer` section holds
the RL trainer's own fields that supervised training shares (ranks, device, AdamW, the learning
rate schedule, micro-batching, checkpoints): same types, bounds, defaults and descriptions, and
it becomes a `TrainerConfig` for the shared step code.
"""

from __future__ import annotations

import os
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from lockgate.trainer.config import (
    ComputeDtype,
    Device,
    LoraSpec,
    LrSchedule,
    Packing,
    TrainerConfig,
)

BatchUnit = Literal["conversations", "tokens"]
Overlong = Literal["truncate", "drop"]
Require = Literal["val_exact_match", "val_loss"]


def _shared(name: str) -> Any:
    """TrainerConfig's field `name` (its default, bounds and description), for reuse here."""
    field: FieldInfo = TrainerConfig.model_fields[name]
    return copy(field)


def threads_alone(cores: int, ranks: int) -> int:
    """Threads per rank for ranks that have the machine to themselves, as SFT does: every core,
    split evenly among them, one at least."""
    return max(1, cores // ranks)


class SFTModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Path | None = Field(
        default=None,
        description="HF model dir to fine-tune (its tokenizer and chat format render the "
        "data). Unset: the tiny Qwen3-style model, built offline and cached.",
    )
    chat_format: str = Field(
        default="auto",
        description="The model's chat format (a `renderers` name, or auto: detected from the "
        "model's files). `lockgate sft` resolves it before tokenizing, so a model whose format "
        "cannot be placed is refused. The data is rendered and masked by the format's renderer; "
        "the generic format (default) by the model's own chat template.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train low-rank adapters only, the base weights frozen. final/ then holds "
        "the merged model (an HF model dir, as without lora) and final_adapter/ the adapter "
        "in the format vLLM and peft load. None: full fine-tuning.",
    )


class SFTDataSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Path = Field(
        description='JSONL chats, one {"messages": [...], "tools": [...]} per line (OpenAI '
        "chat format); relative to the config file."
    )
    val_path: Path | None = Field(
        default=None,
        description="JSONL chats for a held-out loss every loop.val_every steps; relative to "
        "the config file.",
    )
    max_length: int = Field(
        default=2048, ge=2, description="Longest conversation in tokens (see overlong)."
    )
    overlong: Overlong = Field(
        default="truncate",
        description="A longer conversation is cut to max_length tokens (truncate) or left out "
        "(drop); either way it is counted and reported.",
    )
    end_of_turn: str | None = Field(
        default=None,
        description="The token that ends an assistant turn (trained on: the model must learn "
        "to stop), for the generic format (default) only: a format's renderer knows its own. "
        "Unset: the tokenizer's eos_token.",
    )


class PlateauStop(BaseModel):
    """Stop once the held-out loss has come down and then stopped improving."""

    model_config = ConfigDict(extra="forbid")
    below: float = Field(
        gt=0,
        description="Only once a held-out loss has been at or below this: a loss still on a "
        "long first plateau before it falls (copy drills can sit there for hundreds of steps) "
        "must not stop the run.",
    )
    patience: int = Field(
        default=3, ge=1, description="Held-out checks in a row without a new best loss."
    )
    min_improvement: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="A new best is at least this fraction below the previous best (0.1: 10%).",
    )


class SFTLoopSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: int = Field(default=1, ge=1, description="Passes over the training data.")
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Stop after this many optimizer steps (counted from the run's start, so "
        "a resumed run stops at the same step). Unset: run all epochs.",
    )
    batch_size: int = Field(
        default=8, ge=1, description="Conversations (or tokens, see batch_unit) per optimizer step."
    )
    batch_unit: BatchUnit = Field(
        default="conversations",
        description="conversations: batch_size conversations a step; tokens: conversations in "
        "order until the next would pass batch_size tokens (one longer than that gets a step "
        "of its own). An epoch's last step takes what is left.",
    )
    shuffle: bool = Field(
        default=True,
        description="Shuffle the conversations every epoch (seeded by trainer.seed and the "
        "epoch, so a resumed run sees the same order).",
    )
    log_every: int = Field(
        default=10, ge=1, description="A progress line (stderr) every this many steps."
    )
    val_every: int = Field(
        default=0,
        ge=0,
        description="Held-out loss on data.val_path every this many steps and after the last; "
        "0 only after the last (when val_path is set).",
    )
    stop_at_val_loss: float | None = Field(
        default=None,
        gt=0,
        description="Stop (checkpoint, export) at the first held-out loss at or below this: "
        "a loss that falls suddenly at a step no run can foretell (copy drills) gets the "
        "steps it needs, with epochs / max_steps as the cap. Needs "
        "data.val_path and val_every.",
    )
    stop_at_val_exact_match: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Stop (checkpoint, export) at the first held-out check where at least this "
        "fraction of the val conversations is reproduced exactly: every assistant token the "
        "argmax given the true tokens before it, which under teacher forcing is what greedy "
        "decoding would write. Judges a skill (copying) by whether it is done, where a mean "
        "loss can be held up by one long example. Needs data.val_path and val_every.",
    )
    require: Require | None = Field(
        default=None,
        description="val_exact_match or val_loss: the run must end with the last held-out "
        "check at its stop_at_ target, else `lockgate sft` exits 1 with a one-line reason "
        "(the model is still written to final/): a warm start that reached its step cap "
        "without the skill stops the pipeline that depends on it.",
    )
    stop_at_train_loss: float | None = Field(
        default=None,
        gt=0,
        description="Stop (checkpoint, export) at the first step where the training loss over "
        "the last `train_loss_window` steps (token-weighted) is at or below this. Each batch is "
        "scored before the model trains on it, so over data seen once (epochs: 1) it is a "
        "held-out loss over far more examples than a val set holds, at no cost (a few hard "
        "val examples can hold a mean of a small val set up).",
    )
    train_loss_window: int = Field(
        default=50, ge=1, description="Steps the stop_at_train_loss mean runs over."
    )
    stop_on_plateau: PlateauStop | None = Field(
        default=None,
        description="Stop (checkpoint, export) when the held-out loss, once at or below "
        "`below`, has not set a new best for `patience` checks: the steps a loss that will "
        "not reach stop_at_val_loss would spend for nothing. Needs data.val_path and val_every.",
    )

    @model_validator(mode="after")
    def _require_names_a_target(self) -> SFTLoopSection:
        if self.require is not None and getattr(self, f"stop_at_{self.require}") is None:
            raise ValueError(f"loop.require: {self.require} needs loop.stop_at_{self.require}")
        return self


class SFTTrainerSection(BaseModel):
    """The RL trainer's fields that supervised training uses, as they are there."""

    model_config = ConfigDict(extra="forbid")
    world_size: int = _shared("world_size")
    device: Device = _shared("device")
    num_threads: int = _shared("num_threads")
    seed: int = _shared("seed")
    lr: float = _shared("lr")
    betas: tuple[float, float] = _shared("betas")
    weight_decay: float = _shared("weight_decay")
    eps: float = _shared("eps")
    grad_clip: float = _shared("grad_clip")
    lr_schedule: LrSchedule = _shared("lr_schedule")
    warmup_steps: int = _shared("warmup_steps")
    decay_steps: int | None = _shared("decay_steps")
    min_lr_ratio: float = _shared("min_lr_ratio")
    micro_batch_tokens: int = _shared("micro_batch_tokens")
    micro_batch_packing: Packing = _shared("micro_batch_packing")
    activation_checkpointing: bool = _shared("activation_checkpointing")
    compute_dtype: ComputeDtype = _shared("compute_dtype")
    checkpoint_every: int = _shared("checkpoint_every")
    keep_checkpoints: int = _shared("keep_checkpoints")

    @model_validator(mode="before")
    @classmethod
    def _threads_from_cores(cls, data: Any) -> Any:
        """`num_threads: auto`: this machine's usable cores shared among the ranks."""
        if isinstance(data, dict) and data.get("num_threads") == "auto":
            ranks = int(data.get("world_size", 1))
            data = {**data, "num_threads": threads_alone(len(os.sched_getaffinity(0)), ranks)}
        return data

    @model_validator(mode="after")
    def _valid_as_trainer_config(self) -> SFTTrainerSection:
        # Checked on load, not when the ranks start: the RL trainer's own cross-field checks.
        try:
            self.to_trainer_config(Path("."))
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return self

    def to_trainer_config(self, model_dir: Path, lora: LoraSpec | None = None) -> TrainerConfig:
        """The full trainer config the shared step code takes (the RL-only fields stay at
        their defaults, which the supervised loss does not read). Validates as TrainerConfig
        does, so a schedule without decay_steps fails here as it does in `lockgate train`."""
        return TrainerConfig(model_dir=model_dir, lora=lora, **self.model_dump())


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="sft", description="Run name; out_dir defaults to runs/<name>.")
    out_dir: Path | None = Field(
        default=None,
        description="Where checkpoints, metrics.jsonl and the final model go; relative to the "
        "config file. Unset: runs/<name> under the current directory.",
    )
    model: SFTModelSection = Field(default_factory=SFTModelSection)
    data: SFTDataSection
    loop: SFTLoopSection = Field(default_factory=SFTLoopSection)
    trainer: SFTTrainerSection = Field(default_factory=SFTTrainerSection)

    @model_validator(mode="after")
    def _stop_needs_a_held_out_loss(self) -> SFTConfig:
        if self.data.val_path is not None and self.loop.val_every > 0:
            return self
        for name in ("stop_at_val_loss", "stop_at_val_exact_match", "stop_on_plateau", "require"):
            if getattr(self.loop, name) is not None:
                raise ValueError(f"loop.{name} needs data.val_path and loop.val_every > 0")
        return self

    def resolved(self, base: Path, model_dir: Path) -> SFTConfig:
        """A copy with every path absolute (relative ones from `base`, the config file's
        folder), `model_dir` as model.path when none is set, and out_dir filled in."""

        def absolute(path: Path) -> Path:
            return path if path.is_absolute() else (base / path).resolve()

        out = self.model_copy(deep=True)
        out.data.path = absolute(out.data.path)
        if out.data.val_path is not None:
            out.data.val_path = absolute(out.data.val_path)
        out.model.path = absolute(out.model.path) if out.model.path is not None else model_dir
        out.out_dir = (
            absolute(out.out_dir)
            if out.out_dir is not None
            else (Path("runs") / out.name).resolve()
        )
        return out

    def data_order(self) -> dict[str, Any]:
        """What fixes which conversations each step trains on: a resumed run must match."""
        return {
            "model": str(self.model.path),
            "data": self.data.model_dump(mode="json"),
            "batch": [self.loop.batch_size, self.loop.batch_unit, self.loop.shuffle],
            "seed": self.trainer.seed,
        }

    @property
    def layout(self) -> SFTLayout:
        if self.out_dir is None:
            raise ValueError("the config is not resolved: out_dir is unset")
        return SFTLayout(self.out_dir)

    @property
    def model_dir(self) -> Path:
        if self.model.path is None:
            raise ValueError("the config is not resolved: model.path is unset")
        return self.model.path


@dataclass(frozen=True)
class SFTLayout:
    """What a run writes under its out_dir."""

    out: Path

    @property
    def config(self) -> Path:  # the resolved SFTConfig the ranks read
        return self.out / "config.json"

    @property
    def train_data(self) -> Path:  # tokenized conversations (`sft_data.write_examples`)
        return self.out / "data" / "train.jsonl"

    @property
    def val_data(self) -> Path:
        return self.out / "data" / "val.jsonl"

    @property
    def data_stats(self) -> Path:
        return self.out / "data" / "stats.json"

    @property
    def checkpoints(self) -> Path:  # DCP checkpoints, checkpoints/step_N (trainer/checkpoint.py)
        return self.out / "checkpoints"

    @property
    def metrics(self) -> Path:  # one JSON record per step
        return self.out / "metrics.jsonl"

    @property
    def final(self) -> Path:  # the HF model dir at the end
        return self.out / "final"

    @property
    def final_adapter(self) -> Path:  # with model.lora: the adapter dir beside final/
        return self.out / "final_adapter"

    @property
    def log(self) -> Path:  # everything torchrun and the ranks print
        return self.out / "sft.log"

    @property
    def failed(self) -> Path:  # "rank R: ErrorType: message" from a rank that died
        return self.out / "failed"
