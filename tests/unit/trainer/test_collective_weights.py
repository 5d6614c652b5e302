"""The collective weights transport's pure parts and its wire, without vLLM: the image is the
disk snapshot's file byte for byte, trainer rank 0's sender and the replica worker's receive
(gateway/vllm_ext/collective_load.py) agree over a real gloo group in threads, a member that
never comes fails the send within the group's timeout, and the configs refuse what cannot work."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from lockgate.coordinator.config import RunConfig, SyncSection
from lockgate.coordinator.launch.processes import free_port
from lockgate.gateway.replicas.replica_client import ReplicaUnavailable
from lockgate.gateway.schema import CollectiveWeights, LoadWeights
from lockgate.gateway.sync.weights import CollectiveTransport
from lockgate.gateway.vllm_ext import collective_load
from lockgate.gateway.vllm_ext.snapshot_file import snapshot_from_image
from lockgate.trainer.export import snapshot_image, write_snapshot
from lockgate.trainer.protocol import CollectiveGroup, ExportLayout, SendWeights
from lockgate.trainer.weights_sender import WeightsSender, chunks, wire_head


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(12, 8),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8),
        "model.norm.weight": torch.randn(8).to(torch.bfloat16),
    }


_LAYOUT = ExportLayout(
    transposed={
        "model.layers.0.mlp.gate_up_proj.weight": [
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ]
    }
)


@pytest.mark.parametrize("layout", [None, _LAYOUT])
def test_the_image_is_the_snapshot_file_byte_for_byte(tmp_path: Path, layout: ExportLayout) -> None:
    state = _state()
    write_snapshot(state, tmp_path, tmp_path / "out", layout)
    image = snapshot_image(state, layout)
    assert image.numpy().tobytes() == (tmp_path / "out" / "model.safetensors").read_bytes()
    snap = snapshot_from_image(image, "test")
    if layout is None:
        assert torch.equal(snap.read(snap.tensors["model.norm.weight"]), state["model.norm.weight"])
    else:
        joined = snap.read(snap.tensors["model.layers.0.mlp.gate_up_proj.weight"])
        assert joined.shape == (8, 24)
        assert torch.equal(joined.t()[:12], state["model.layers.0.mlp.gate_proj.weight"])
        assert snap.transposed == {
            "model.layers.0.mlp.gate_up_proj.weight": [
                ("model.layers.0.mlp.gate_proj.weight", 12),
                ("model.layers.0.mlp.up_proj.weight", 12),
            ]
        }


def test_a_truncated_image_is_refused() -> None:
    image = snapshot_image(_state())
    with pytest.raises(ValueError, match="not a safetensors file"):
        snapshot_from_image(image[:20], "version 3")


def test_chunks_cover_the_image_in_order() -> None:
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(8, 4) == [(0, 4), (4, 8)]
    assert chunks(0, 4) == []
    assert wire_head(10, 3, 4) == [10, 3, 4]


def _group(world_size: int, timeout_s: float = 20.0) -> CollectiveGroup:
    return CollectiveGroup(
        address="127.0.0.1",
        port=free_port(),
        world_size=world_size,
        backend="gloo",
        timeout_s=timeout_s,
    )


def _receiver(group: CollectiveGroup, rank: int, versions: list[int], out: dict) -> None:
    """A replica worker's side, as collective_load runs it: join once, receive each version."""
    try:
        spec = collective_load._parse_spec(
            json.dumps({**group.model_dump(), "rank": rank, "version": versions[0]})
        )
        joined = collective_load._join(spec)
        out[rank] = [collective_load._receive(joined, torch.device("cpu"), v) for v in versions]
    except Exception as exc:  # reported to the test's thread
        out[rank] = exc


def test_two_replicas_receive_two_versions_over_one_gloo_group(tmp_path: Path) -> None:
    group = _group(world_size=3)
    images = {3: snapshot_image(_state(), _LAYOUT), 4: snapshot_image({"x": torch.arange(5.0)})}
    out: dict = {}
    threads = [
        threading.Thread(target=_receiver, args=(group, rank, [3, 4], out)) for rank in (1, 2)
    ]
    for thread in threads:
        thread.start()
    sender = WeightsSender(tmp_path)
    for version, image in images.items():
        sender.hold(version, image)
        sent = sender.send(SendWeights(step=version, group=group))
        assert sent.bytes == len(image)
    for thread in threads:
        thread.join(30)
    for rank in (1, 2):
        received = out[rank]
        assert not isinstance(received, Exception), received
        assert [torch.equal(r, images[v]) for r, v in zip(received, (3, 4), strict=True)] == [
            True,
            True,
        ]


def test_a_replica_that_never_joins_fails_the_send_within_the_join_timeout(
    tmp_path: Path,
) -> None:
    """Forming the group has its own, shorter timeout: the transfer's (60 s) is not waited."""
    group = _group(world_size=3, timeout_s=60.0).model_copy(update={"join_timeout_s": 3.0})
    out: dict = {}
    only_one = threading.Thread(target=_receiver, args=(group, 1, [5], out))
    only_one.start()
    sender = WeightsSender(tmp_path)
    sender.hold(5, snapshot_image(_state()))
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistError types
        sender.send(SendWeights(step=5, group=group))
    assert time.monotonic() - started < 20
    only_one.join(30)
    assert isinstance(out[1], Exception)  # the replica that came fails too, it does not hang


def test_a_new_group_id_is_a_new_group_on_the_same_store(tmp_path: Path) -> None:
    """A replica replaced: the survivor's worker, which holds the first group, and the
    replacement join the group of a new id at the same address and port (the store rank 0
    kept), and receive the next version."""
    first = _group(world_size=3).model_copy(update={"group_id": "first"})
    second = first.model_copy(update={"group_id": "second"})
    survivor: Any = type("Worker", (), {"_lockgate_group": None})()
    groups: list[object] = []

    def survivor_receives(group: CollectiveGroup, version: int, out: dict) -> None:
        try:
            spec = collective_load._parse_spec(
                json.dumps({**group.model_dump(), "rank": 1, "version": version})
            )
            joined = collective_load._group_for(survivor, spec)
            groups.append(joined)
            out[1] = [collective_load._receive(joined, torch.device("cpu"), version)]
        except Exception as exc:
            out[1] = exc

    sender = WeightsSender(tmp_path)
    for group, version in ((first, 3), (second, 4)):
        out: dict = {}
        threads = [
            threading.Thread(target=survivor_receives, args=(group, version, out)),
            threading.Thread(target=_receiver, args=(group, 2, [version], out)),
        ]
        for thread in threads:
            thread.start()
        image = snapshot_image({"x": torch.arange(float(version))})
        sender.hold(version, image)
        sender.send(SendWeights(step=version, group=group))
        for thread in threads:
            thread.join(30)
        for rank in (1, 2):
            assert not isinstance(out[rank], Exception), out[rank]
            assert torch.equal(out[rank][0], image)
    assert groups[0] is not groups[1]


def test_the_sender_refuses_a_step_it_does_not_hold(tmp_path: Path) -> None:
    sender = WeightsSender(tmp_path)
    sender.hold(2, snapshot_image(_state()))
    with pytest.raises(RuntimeError, match=r"asked for step 3's weights; rank 0 holds \[2\]"):
        sender.send(SendWeights(step=3, group=_group(world_size=2)))


def test_the_sender_keeps_the_two_newest_images_until_sent(tmp_path: Path) -> None:
    """Sync k may be asked for after step k+1 has trained (syncs overlap training)."""
    sender = WeightsSender(tmp_path)
    image = snapshot_image(_state())
    for step in (1, 2, 3):
        sender.hold(step, image)
    assert sorted(sender._held) == [2, 3]
    group = _group(world_size=2)
    out: dict = {}
    receiver = threading.Thread(target=_receiver, args=(group, 1, [2], out))
    receiver.start()
    sender.send(SendWeights(step=2, group=group))
    receiver.join(30)
    assert torch.equal(out[1][0], image)
    assert sorted(sender._held) == [3]


def test_the_sender_thread_answers_a_request_file_with_an_error_file(tmp_path: Path) -> None:
    from lockgate.trainer import protocol

    sender = WeightsSender(tmp_path)
    sender.start()
    try:
        request = SendWeights(step=7, group=_group(world_size=2))
        protocol.write_atomic(protocol.send_request_path(tmp_path, 7), request.model_dump_json())
        error = protocol.send_error_path(tmp_path, 7)
        deadline = time.monotonic() + 10
        while not error.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "rank 0 holds []" in error.read_text()
        assert not protocol.send_request_path(tmp_path, 7).exists()
    finally:
        sender.stop()


def test_a_receive_spec_is_checked() -> None:
    good = {
        "address": "h",
        "port": 1,
        "world_size": 3,
        "backend": "gloo",
        "timeout_s": 1,
        "rank": 2,
        "version": 1,
    }
    assert collective_load._parse_spec(json.dumps(good)).rank == 2
    for bad in (
        {**good, "rank": 0},
        {**good, "rank": 3},
        {**good, "backend": "mpi"},
        {**good, "group_id": "a/b"},
    ):
        with pytest.raises(ValueError, match="bad collective receive spec"):
            collective_load._parse_spec(json.dumps(bad))
    with pytest.raises(ValueError, match="malformed"):
        collective_load._parse_spec(json.dumps({"address": "h"}))


def test_the_gateway_and_trainer_declare_the_same_group() -> None:
    gateway = set(CollectiveWeights.model_fields) - {"transport"}
    assert gateway == set(CollectiveGroup.model_fields)
    body = {
        "version": 2,
        "source": {"transport": "collective", **_group(world_size=3).model_dump()},
    }
    assert isinstance(LoadWeights.model_validate(body).source, CollectiveWeights)


async def test_the_gateway_refuses_a_group_sized_for_other_replicas() -> None:
    source = CollectiveWeights(transport="collective", **_group(world_size=3).model_dump())

    class Replica:
        url = "http://a"

    transport = CollectiveTransport(source, ["http://a"], version=1)
    with pytest.raises(ReplicaUnavailable, match="2 replica rank"):
        await transport.load(Replica())  # type: ignore[arg-type]


def test_the_run_config_takes_collective_and_refuses_what_cannot_work() -> None:
    sync = SyncSection.model_validate({"transport": "collective"})
    assert (sync.collective.address, sync.collective.port, sync.collective.backend) == (
        "127.0.0.1",
        0,
        "auto",
    )
    with pytest.raises(ValidationError, match=r"with sync\.transport: collective there is none"):
        SyncSection.model_validate({"transport": "collective", "stage": True})
    with pytest.raises(ValidationError, match="Input should be"):
        SyncSection.model_validate({"transport": "nfs"})
    with pytest.raises(ValidationError, match="less than or equal to 65535"):
        SyncSection.model_validate({"collective": {"port": 70000}})
    with pytest.raises(ValidationError, match=r"set in sync\.transport"):
        RunConfig.model_validate({"trainer": {"weights": "collective"}})
    ray = RunConfig.model_validate({"launcher": "ray", "sync": {"transport": "collective"}})
    assert ray.sync.transport == "collective"  # its group meets at rank 0's node (ray/trainer.py)
