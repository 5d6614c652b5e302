"""The `collective` weights transport against two real vLLM-CPU replicas (issue 44, must-show 2):
trainer rank 0's sender (trainer/weights_sender.py, here in the test's process) streams the
weights over gloo into both replicas' workers while the gateway's controller has them receive;
afterwards both replicas' greedy tokens equal those after a disk sync of the same weights, token
for token, and differ from before the sync. A second collective sync on the same group (the
original weights, in the replicas' kernel layout) brings the original tokens back; a lockgate
train run on the toy task with `sync.transport=collective` trains and syncs, exits 0 and leaves
no process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from lockgate.coordinator.launch.processes import free_port
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.schema import CollectiveWeights, DiskWeights, LoadReport
from lockgate.trainer.export import snapshot_image
from lockgate.trainer.protocol import CollectiveGroup, ExportLayout, SendWeights
from lockgate.trainer.weights_sender import WeightsSender
from tests.support.marked_processes import marked_environment, processes_with_marker
from tests.vllm.test_sync_vllm import open_gateway

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8], [400, 30, 31]]


@pytest.fixture
async def gateway(tiny_model_dir: Path, replicas: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """A gateway in this process (test_sync_vllm.py's), its controller driven directly."""
    async with open_gateway(tiny_model_dir, replicas.urls, tmp_path / "collective.sqlite") as gw:
        yield gw.gateway


async def _greedy(gateway: Any) -> list[list[list[int]]]:
    """Every replica's greedy tokens for each prompt (straight to the replica: no routing)."""
    out = []
    for client in gateway.pool.clients:
        per_prompt = []
        for i, prompt in enumerate(PROMPTS):
            tokens: list[int] = []
            sampling = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
            async for chunk in client.generate_stream(prompt, sampling, f"c-{client.url}-{i}"):
                tokens += chunk.token_ids
            per_prompt.append(tokens)
        out.append(per_prompt)
    return out


async def _disk_sync(gateway: Any, path: Path, version: int) -> None:
    await gateway.sync.pause("abort", 60.0)
    await gateway.sync.load(DiskWeights(path=str(path)), version)
    await gateway.sync.resume(version)


async def _collective_sync(
    gateway: Any, sender: WeightsSender, group: CollectiveGroup, version: int
) -> LoadReport:
    """The loop's order: pause, then the replicas' receive and the trainer's send at once."""
    source = CollectiveWeights(transport="collective", **group.model_dump())
    await gateway.sync.pause("abort", 60.0)
    send = asyncio.to_thread(sender.send, SendWeights(step=version, group=group))
    report, sent = await asyncio.gather(gateway.sync.load(source, version), send)
    assert sent.bytes > 0
    await gateway.sync.resume(version)
    return report


async def test_a_collective_sync_serves_what_a_disk_sync_of_the_same_weights_does(
    gateway: Any, tiny_model_dir: Path, perturbed_model_dir: Path, tmp_path: Path
) -> None:
    version = gateway.gate.version
    before = await _greedy(gateway)
    try:
        await _disk_sync(gateway, perturbed_model_dir, version + 1)
        after_disk = await _greedy(gateway)
        assert after_disk != before, "the perturbed weights must change the greedy tokens"
        await _disk_sync(gateway, tiny_model_dir, version + 2)
        assert await _greedy(gateway) == before

        group = CollectiveGroup(
            address="127.0.0.1", port=free_port(), world_size=3, backend="gloo", timeout_s=60
        )
        sender = WeightsSender(tmp_path)
        sender.hold(
            version + 3, snapshot_image(load_file(perturbed_model_dir / "model.safetensors"))
        )
        report = await _collective_sync(gateway, sender, group, version + 3)
        assert sorted(report.loaded) == sorted(c.url for c in gateway.pool.clients)
        assert not report.failed
        after_collective = await _greedy(gateway)
        assert after_collective == after_disk  # both replicas, every prompt, token for token
        assert after_collective[0] == after_collective[1]

        # The same group again (formed once), the original weights in the kernel layout.
        layout = ExportLayout(transposed=(await gateway.sync.layout()).transposed)
        assert layout.transposed, "vLLM-CPU's direct load names its packed layers"
        original = load_file(tiny_model_dir / "model.safetensors")
        sender.hold(version + 4, snapshot_image(original, layout))
        await _collective_sync(gateway, sender, group, version + 4)
        assert await _greedy(gateway) == before
    finally:
        if gateway.gate.state != "serving":
            await gateway.sync.resume(gateway.gate.version)
        await _disk_sync(gateway, tiny_model_dir, gateway.gate.version + 1)


async def test_a_collective_sync_without_a_sender_fails_within_its_timeout(
    gateway: Any, tiny_model_dir: Path
) -> None:
    """No trainer comes: each replica's receive gives up after the group's timeout, the load
    fails naming them, and nothing is restored from a source that has no sender."""
    version = gateway.gate.version
    group = CollectiveWeights(
        transport="collective",
        address="127.0.0.1",
        port=free_port(),
        world_size=3,
        backend="gloo",
        timeout_s=5,
    )
    await gateway.sync.pause("abort", 60.0)
    try:
        with pytest.raises(Exception, match="no replica loaded version") as failed:
            await asyncio.wait_for(gateway.sync.load(group, version + 1), 60)
        assert "collective_rpc" in str(failed.value)
    finally:
        # Out of the rotation as stale: a disk load brings them back.
        await gateway.sync.load(DiskWeights(path=str(tiny_model_dir)), version + 2)
        await gateway.sync.resume(version + 2)


async def test_a_dead_member_fails_the_group_soon_and_the_next_leaves_it_out(
    gateway: Any, tiny_model_dir: Path, perturbed_model_dir: Path, tmp_path: Path
) -> None:
    """A replica dead since the last sync is still in the pool: the group sized with it
    cannot form, and fails after the join timeout (not the transfer's); once the health
    checks take it out, a new group of the live replicas (what the loop's second try forms)
    loads both, to the same tokens as a disk sync."""
    version = gateway.gate.version
    await _disk_sync(gateway, perturbed_model_dir, version + 1)
    after_disk = await _greedy(gateway)
    await _disk_sync(gateway, tiny_model_dir, version + 2)
    dead = f"http://127.0.0.1:{free_port()}"
    gateway.pool.add(dead, version + 2)
    sender = WeightsSender(tmp_path)
    sender.hold(version + 3, snapshot_image(load_file(perturbed_model_dir / "model.safetensors")))
    try:
        sized_with_it = CollectiveGroup(
            address="127.0.0.1", port=free_port(), world_size=4, backend="gloo",
            timeout_s=60, join_timeout_s=5, group_id="with-dead",
        )  # fmt: skip
        assert dead in [c.url for c in gateway.pool.healthy_clients()]  # not checked yet
        started = asyncio.get_running_loop().time()
        await gateway.sync.pause("abort", 60.0)
        source = CollectiveWeights(transport="collective", **sized_with_it.model_dump())
        send = SendWeights(step=version + 3, group=sized_with_it)
        failed = await asyncio.gather(
            gateway.sync.load(source, version + 3),
            asyncio.to_thread(sender.send, send),
            return_exceptions=True,
        )
        assert all(isinstance(result, BaseException) for result in failed), failed
        assert asyncio.get_running_loop().time() - started < 40  # the join's 5 s, not 60
        if gateway.gate.state != "serving":
            await gateway.sync.resume(gateway.gate.version)
        while dead in [c.url for c in gateway.pool.healthy_clients()]:
            assert asyncio.get_running_loop().time() - started < 60, "still counted healthy"
            await asyncio.sleep(0.2)
        live = sized_with_it.model_copy(update={"world_size": 3, "group_id": "live"})
        report = await _collective_sync(gateway, sender, live, version + 3)
        assert dead not in report.loaded and len(report.loaded) == 2
        gateway.pool.remove(dead)
        assert await _greedy(gateway) == after_disk
    finally:
        gateway.pool.remove(dead)
        if gateway.gate.state != "serving":
            await gateway.sync.resume(gateway.gate.version)
        await _disk_sync(gateway, tiny_model_dir, gateway.gate.version + 1)


def test_lockgate_train_syncs_the_toy_run_over_the_collective_transport(tmp_path: Path) -> None:
    marker, env = marked_environment()
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "lockgate.coordinator.cli", "train", str(ROOT / "examples/toy/config.yaml"),
            "--run-dir", str(run_dir), "--set", "sync.transport=collective",
            "--set", "loop.steps=2", "--set", "loop.val_every=0",
            "--set", "replicas.startup_timeout_s=900",
        ],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "weights: collective, gloo group at 127.0.0.1:" in output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["version"] == 2 and records[-1]["count/syncs"] == 2
    assert (run_dir / "trainer").is_dir()  # where a disk sync's snapshots would be
    assert not list(RunDir(run_dir).snapshots.glob("step_*/*.safetensors"))
    assert processes_with_marker(marker) == []
