"""The trainer's configuration. Importing it loads no torch, so the coordinator's CLI stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: Path = Field(description="HF model dir the policy starts from.")
    world_size: int = Field(default=1, ge=1, description="Trainer ranks (FSDP2 over gloo on CPU).")
    num_threads: int = Field(default=1, ge=1, description="torch intra-op threads per rank.")
    seed: int = Field(default=0, description="Seed of the trainer's RNG.")

    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this."
    )

    clip_eps_low: float = Field(default=0.2, ge=0, description="PPO clip: ratio >= 1 - this.")
    clip_eps_high: float = Field(default=0.28, ge=0, description="PPO clip: ratio <= 1 + this.")
    loss_agg: LossAggregation = Field(
        default="token-mean", description="How per-token losses become the batch loss."
    )
    micro_batch_tokens: int = Field(
        default=4096, ge=16, description="Padded tokens per forward pass (gradient accumulation)."
    )
    keep_snapshots: int = Field(
        default=3, ge=2, description="Weight snapshots kept on disk (older ones are deleted)."
    )

    @model_validator(mode="after")
    def _clip_range(self) -> TrainerConfig:
        if self.clip_eps_low >= 1:
            raise ValueError("clip_eps_low must be below 1 (the ratio's lower clip would be <= 0)")
        return self
