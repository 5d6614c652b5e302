"""How new weights reach a replica: one small interface, one class per transport.

- `disk` (default; works everywhere, CPU included): the trainer publishes a safetensors
  snapshot atomically (written aside, renamed into place); each replica reloads it in place
  with vLLM's `reload_weights`.
- `nccl` (GPU clusters): vLLM's native weight-transfer API. The gateway only drives the
  replica side (`/start_weight_update`, `/update_weights`, `/finish_weight_update`); the
  trainer broadcasts the tensors over the NCCL group both joined at start-up. It needs CUDA and
  a replica started with `--weight-transfer-config '{"backend": "nccl"}'`, so it cannot run
  on this CPU-only project's CI: it is written to the same interface and documented as
  untested here.

Whatever the transport, a load then resets the replica's prefix cache (KV computed under the old
weights must not be reused) and sets the engine's version label, which the controller reads
back to verify the replica really serves the new version.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lockgate.gateway.replica_client import ReplicaClient, ReplicaUnavailable


class DiskWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transport: Literal["disk"] = "disk"
    path: str = Field(description="HF-format snapshot dir (safetensors) every replica can read.")


class NcclWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transport: Literal["nccl"]
    update_info: dict[str, Any] = Field(
        description="vLLM's WeightTransferUpdatePayload (names, dtypes, shapes of the tensors "
        "the trainer is about to broadcast)."
    )


WeightSource = Annotated[DiskWeights | NcclWeights, Field(discriminator="transport")]


class WeightTransport(ABC):
    @abstractmethod
    async def load(self, replica: ReplicaClient) -> None:
        """Put the new weights into this replica (it is paused; nothing is generating)."""


class DiskTransport(WeightTransport):
    def __init__(self, source: DiskWeights) -> None:
        self.path = source.path

    async def load(self, replica: ReplicaClient) -> None:
        # A missing snapshot is the same failure on every replica: say so before asking them.
        if not (Path(self.path) / "config.json").is_file():
            raise ReplicaUnavailable(f"no HF snapshot at {self.path} (config.json missing)")
        await replica.call_admin(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.path}}
        )


class NcclTransport(WeightTransport):
    def __init__(self, source: NcclWeights) -> None:
        self.update_info = source.update_info

    async def load(self, replica: ReplicaClient) -> None:
        await replica.call_admin("/start_weight_update")
        await replica.call_admin("/update_weights", {"update_info": self.update_info})
        await replica.call_admin("/finish_weight_update")


def transport_for(source: DiskWeights | NcclWeights) -> WeightTransport:
    if isinstance(source, DiskWeights):
        return DiskTransport(source)
    return NcclTransport(source)
