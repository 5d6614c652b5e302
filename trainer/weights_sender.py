"""The trainer side of the `collective` weights transport: rank 0 streams a step's weights into
every replica's worker over a torch.distributed group, with no file written.

After each step the ranks gather the full state dict (FSDP2, as for a snapshot) and rank 0
keeps it as an image: the bytes of the safetensors file `write_snapshot` would have written
(trainer/export.py `snapshot_image`, in the layout the replicas asked for). When the coordinator
asks for a step's weights (protocol.py `SendWeights`), a thread of rank 0 sends that image, so
the send overlaps the next step's training (the two newest images are kept: `hold` says why).

The group: rank 0 is this rank, which hosts the group's TCP store at the given address and
port; the replicas' workers are ranks 1..N (gateway/vllm_ext/collective_load.py). It is formed
at the first send (every member constructs it at once: the gateway asks the replicas to receive
while the coordinator asks for the send) and kept until a send names another group id (the
coordinator names a new one after a failed sync and when the gateway's replicas change). The
store lives as long as this sender, each forming under its id's key prefix: a store made again
at the same port would race the replicas, which may reach the old one before it closes. The
backend follows the device: gloo for CPU tensors, NCCL for CUDA ones (the image is then moved
to this rank's GPU first); one code path, only the backend's name differs.

The wire, per version, every message a broadcast from rank 0: an int64 tensor [image bytes,
version, chunk bytes], then the image in chunks of that many bytes (the last one shorter).
Every collective runs under the group's timeout: a replica that dies mid-transfer fails the send
(and the sync) within `timeout_s` rather than hanging the trainer; the group is then dropped,
and the coordinator's next send names a new one.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from lockgate.trainer import protocol
from lockgate.trainer.protocol import CollectiveGroup, SendWeights, WeightsSent

log = logging.getLogger(__name__)

# The store prefix every member uses (gateway/vllm_ext/collective_load.py names it too).
STORE_PREFIX = "lockgate-weights"
# Bytes per broadcast: bounds the buffers gloo stages for one message.
CHUNK_BYTES = 64 << 20
_POLL_S = 0.02
_KEPT = 2  # images held at most (`WeightsSender.hold` says why two)


def wire_head(image_bytes: int, version: int, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """The first message of a version: what the receivers allocate and check."""
    return [image_bytes, version, chunk_bytes]


def chunks(image_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of the image's broadcasts, in order."""
    return [(s, min(s + chunk_bytes, image_bytes)) for s in range(0, image_bytes, chunk_bytes)]


def _store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The TCP store rank 0 hosts for every forming of the weights group."""
    return dist.TCPStore(
        address,
        port,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class _Group:
    """Rank 0's member of one forming of the weights group, on the store rank 0 hosts."""

    def __init__(self, spec: CollectiveGroup, store: dist.TCPStore) -> None:
        self.spec = spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        join = datetime.timedelta(seconds=spec.join_timeout_s or spec.timeout_s)
        store.set_timeout(join)
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{spec.group_id}", store)
        if spec.backend == "nccl":
            # NCCL connects at the first collective, under the transfer's timeout.
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(
                prefixed, 0, spec.world_size, options
            )
        else:
            # Gloo connects in its constructor, under the join's timeout; then the transfer's.
            self.group = dist.ProcessGroupGloo(prefixed, 0, spec.world_size, join)
            self.group.set_timeout(timeout)

    def send(self, image: torch.Tensor, version: int) -> None:
        if self.spec.backend == "nccl":
            image = image.to(torch.device("cuda", torch.cuda.current_device()))
        head = torch.tensor(wire_head(len(image), version), dtype=torch.int64, device=image.device)
        self.group.broadcast([head]).wait()
        for start, end in chunks(len(image)):
            self.group.broadcast([image[start:end]]).wait()


class WeightsSender:
    """Rank 0's held images and the thread that sends one when asked."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()  # guards _held (the main thread adds, the sender takes)
        self._held: dict[int, torch.Tensor] = {}
        self._group: _Group | None = None
        self._store: tuple[tuple[str, int], dist.TCPStore] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weights-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def hold(self, step: int, image: torch.Tensor) -> None:
        """Keep step's image until it is sent. With syncs overlapping training, step k's sync
        may be asked for after step k+1 has trained, and the loop waits for sync k before it
        trains k+2: so the two newest images are kept, and a send drops those it supersedes."""
        with self._lock:
            self._held[step] = image
            for old in sorted(self._held)[:-_KEPT]:
                del self._held[old]

    def _serve(self) -> None:
        while not self._stop.is_set():
            step = self._waiting_request()
            if step is None:
                time.sleep(_POLL_S)
                continue
            path = protocol.send_request_path(self.run_dir, step)
            try:
                request = SendWeights.model_validate_json(path.read_text())
                sent = self.send(request)
            except Exception:
                log.exception("sending step %d's weights failed", step)
                protocol.write_atomic(
                    protocol.send_error_path(self.run_dir, step), traceback.format_exc()
                )
            else:
                protocol.write_atomic(
                    protocol.sent_path(self.run_dir, step), sent.model_dump_json()
                )
            path.unlink(missing_ok=True)

    def _store_for(self, group: CollectiveGroup) -> dist.TCPStore:
        where = (group.address, group.port)
        if self._store is None or self._store[0] != where:
            self._store = None
            self._store = (where, _store(group.address, group.port, group.timeout_s))
        return self._store[1]

    def _waiting_request(self) -> int | None:
        """The step of a request waiting in the run dir (the newest), or None."""
        folder = protocol.send_request_path(self.run_dir, 0).parent
        steps = [
            int(p.stem.removeprefix("send_"))
            for p in folder.glob("send_*.json")
            if p.stem.removeprefix("send_").isdigit()
        ]
        return max(steps) if steps else None

    def send(self, request: SendWeights) -> WeightsSent:
        """Send the held image of `request.step` over `request.group` (formed if need be)."""
        with self._lock:
            image = self._held.get(request.step)
            if image is None:
                raise RuntimeError(
                    f"asked for step {request.step}'s weights; rank 0 holds {sorted(self._held)}"
                )
        started = time.perf_counter()
        if self._group is None or self._group.spec != request.group:
            self._group = None
            self._group = _Group(request.group, self._store_for(request.group))
        joined = time.perf_counter()
        try:
            self._group.send(image, request.step)
        except BaseException:
            # Receivers may be part way through: this group cannot be trusted again.
            self._group = None
            raise
        with self._lock:
            for old in [step for step in self._held if step <= request.step]:
                del self._held[old]
        return WeightsSent(
            step=request.step,
            bytes=len(image),
            join_s=joined - started,
            send_s=time.perf_counter() - joined,
        )
