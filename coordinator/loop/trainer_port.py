"""What the loop needs of the trainer: train a step, say where its weights are, commit a step,
export in the replicas' layout, and send a step's weights over the collective transport's
group. The loop depends on this protocol, not on how the ranks
are launched, so the launchers (local, Ray) depend on the loop and never the other way."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.protocol import ExportLayout, SendWeights, WeightsSent


class Trainer(Protocol):
    async def train_step(self, batch: TrainBatch) -> StepResult: ...

    def snapshot_dir(self, step: int) -> Path: ...

    def commit(self, step: int) -> None: ...

    def set_export_layout(self, layout: ExportLayout) -> None: ...

    async def send_weights(self, request: SendWeights) -> WeightsSent: ...
