"""The replica side of the `collective` transport: weights received over a torch.distributed
group that this replica's worker and trainer rank 0 join, loaded in place.

Replicas started with `--worker-extension-cls lockgate.gateway.vllm_ext.collective_load.CollectiveLoad`
(the launcher passes it; it is the snapshot-load extension with this added) answer
`POST /collective_rpc {"method": "lockgate_collective_receive", "args": [SPEC]}`, SPEC a JSON
object: the group's `address` and `port` (the TCP store trainer rank 0 hosts), `world_size`,
`backend` (gloo or nccl), `timeout_s`, this replica's `rank` (1 + its place among the
gateway's replicas; the trainer is rank 0), the `version` it is to receive and the `group_id`
of this forming of the group (its store keys' prefix).

The first receive joins the group (every member constructs it at once: the trainer does so when
told to send, which the coordinator does while the gateway asks the replicas to receive); later
ones reuse it until the coordinator names a new group id (after a failed sync, and when a
replica is replaced or added: a formed group takes no new member), and every member joins that
one afresh on the store trainer rank 0 keeps for its life. Joining fails after `join_timeout_s`
(default `timeout_s`). The wire, per version, all broadcasts from rank 0:
an int64 tensor [image bytes, version, chunk bytes], then the image in chunks of that many bytes
(the last one shorter). The image is the bytes of one safetensors file, exactly what the disk
transport would write (trainer/export.py), so its order, dtype names and kernel layout are the
disk path's, and the load is the same direct load (snapshot_load.py `load_in_place`), which
handles vLLM-CPU's repacked layers.

Every collective runs under the group's timeout, so a member that dies mid-transfer fails the
receive after at most `timeout_s` instead of blocking this worker for ever; a failed receive
drops the group (a broken group is of no further use) and the sync fails with the error.

Why not vLLM's own `vllm/distributed/weight_transfer/` engines: in vLLM 0.32 the `nccl` engine
is built on PyNccl and CUDA streams (no gloo group can be given to it), `ipc` is CUDA IPC, and
both hand the tensors to `model.load_weights`, which fails on vLLM-CPU's packed layers. A plain
torch.distributed group takes gloo on CPU and NCCL on CUDA through one code path.

One worker per replica (no tensor parallelism): the image holds full tensors, as the direct load
needs.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockgate.gateway.vllm_ext.snapshot_file import snapshot_from_image
from lockgate.gateway.vllm_ext.snapshot_load import SnapshotLoad, load_in_place

# The store prefix every member uses for the weights group (trainer/weights_sender.py too).
STORE_PREFIX = "lockgate-weights"


@dataclass(frozen=True)
class _Spec:
    address: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    rank: int
    version: int
    group_id: str
    join_timeout_s: float

    @property
    def group_key(self) -> tuple[str, int, int, str, int, str]:
        return (self.address, self.port, self.world_size, self.backend, self.rank, self.group_id)


def _parse_spec(raw: str) -> _Spec:
    try:
        fields = json.loads(raw)
        spec = _Spec(
            address=str(fields["address"]),
            port=int(fields["port"]),
            world_size=int(fields["world_size"]),
            backend=str(fields["backend"]),
            timeout_s=float(fields["timeout_s"]),
            rank=int(fields["rank"]),
            version=int(fields["version"]),
            group_id=str(fields.get("group_id", "0")),
            join_timeout_s=float(fields.get("join_timeout_s") or fields["timeout_s"]),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"malformed collective receive spec ({exc}): {raw[:200]}") from exc
    if (
        spec.backend not in ("gloo", "nccl")
        or not 0 < spec.rank < spec.world_size
        or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", spec.group_id)
    ):
        raise ValueError(f"bad collective receive spec: {spec}")
    return spec


def _join(spec: _Spec) -> dist.ProcessGroup:
    """This worker's member of the weights group (blocks until every member has joined, or
    the timeout)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    join = datetime.timedelta(seconds=spec.join_timeout_s)
    store = dist.TCPStore(
        spec.address, spec.port, is_master=False, timeout=join, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{spec.group_id}", store)
    if spec.backend == "nccl":
        # NCCL connects at the first collective, under the transfer's timeout.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, options)
    # Gloo connects in its constructor, under the timeout it is given: the join's; its
    # messages then get the transfer's.
    group = dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, join)
    group.set_timeout(timeout)
    return group


def _receive(group: dist.ProcessGroup, device: torch.device, version: int) -> torch.Tensor:
    """One version's image, as rank 0 broadcasts it."""
    head = torch.zeros(3, dtype=torch.int64, device=device)
    group.broadcast([head]).wait()
    nbytes, sent_version, chunk = (int(v) for v in head.tolist())
    if sent_version != version or chunk <= 0:
        raise ValueError(f"expected version {version}, rank 0 sends {sent_version} ({chunk=})")
    image = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for start in range(0, nbytes, chunk):
        group.broadcast([image[start : start + chunk]]).wait()
    return image


class CollectiveLoad(SnapshotLoad):
    """Mixed into vLLM's worker class by `--worker-extension-cls`; `self` is the worker."""

    _lockgate_group: tuple[tuple[str, int, int, str, int, str], dist.ProcessGroup] | None = None

    def lockgate_collective_receive(self, raw_spec: str) -> dict[str, Any]:
        """Join the weights group if not yet, receive one version's image and load it.

        Returns {"loaded": True, "version", "bytes", "join_s", "receive_s", plus the load's
        phases}; raises (vLLM answers 500 with the error) where any step fails."""
        spec = _parse_spec(raw_spec)
        worker: Any = self
        runner = worker.model_runner
        device = torch.device("cpu")
        if spec.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        started = time.perf_counter()
        try:
            group = _group_for(self, spec)
            joined = time.perf_counter()
            image = _receive(group, device, spec.version)
            received = time.perf_counter()
            self.lockgate_drop_staged()  # handles staged from a snapshot are not these weights
            phases = load_in_place(runner, snapshot_from_image(image, f"version {spec.version}"))
        except BaseException:
            # Peers may be part way through a collective: this group cannot be trusted again.
            self._lockgate_group = None
            raise
        return {
            "loaded": True,
            "version": spec.version,
            "bytes": len(image),
            "join_s": joined - started,
            "receive_s": received - joined,
            **phases,
        }


def _group_for(ext: CollectiveLoad, spec: _Spec) -> dist.ProcessGroup:
    """The worker's weights group for `spec`: the one it joined, or a new one. (A function,
    not a method: vLLM offers every method of the extension as an RPC.)"""
    current = ext._lockgate_group
    if current is not None and current[0] == spec.group_key:
        return current[1]
    ext._lockgate_group = None
    group = _join(spec)
    ext._lockgate_group = (spec.group_key, group)
    return group
