"""What crosses the coordinator -> trainer boundary: batches in, step results out."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class TrainSample(BaseModel):
    """One token sequence. Per-token lists align with `input_ids`.

    `rollout_logprobs[i]` and `advantages[i]` matter only where `loss_mask[i] == 1`: there the
    token was sampled by the policy and `rollout_logprobs[i]` is log p(input_ids[i] | input_ids[:i])
    under the weights that sampled it.
    """

    input_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantages: list[float]

    @model_validator(mode="after")
    def _aligned(self) -> TrainSample:
        n = len(self.input_ids)
        if n == 0:
            raise ValueError("empty sample")
        for name in ("loss_mask", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, input_ids {n}")
        if self.loss_mask[0]:
            raise ValueError("the first token cannot be trained on: nothing predicts it")
        return self


class TrainBatch(BaseModel):
    step: int = Field(ge=1)
    samples: list[TrainSample]


class StepResult(BaseModel):
    step: int
    weights_dir: str  # a complete snapshot of the weights after this step (trainer/export.py)
    metrics: dict[str, float]
