"""Snapshots in the replicas' kernel layout: the trainer writes them (trainer/export.py), the
direct load reads them (gateway/vllm_ext/snapshot_load.py, on test_snapshot_load.py's stand-in for a
vLLM-CPU model), `lockgate export-hf` turns them back, and nothing else is asked to read them.
The real-vLLM side is in test_sync_vllm.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from lockgate.coordinator.cli.main import main as cli
from lockgate.gateway.replicas.replica_client import ReplicaClient, ReplicaUnavailable
from lockgate.gateway.schema import DiskWeights
from lockgate.gateway.sync import weights
from lockgate.gateway.sync.weights import DiskTransport
from lockgate.gateway.vllm_ext.snapshot_file import open_snapshot
from lockgate.gateway.vllm_ext.snapshot_header import stores_transposed
from lockgate.gateway.vllm_ext.snapshot_load import kernel_layout
from lockgate.trainer.export import to_hf, write_snapshot
from lockgate.trainer.protocol import ExportLayout
from tests.unit.gateway.test_snapshot_load import (
    FakeReplica,
    Model,
    PackingMethod,
    _expected,
    checkpoint,
    loader,
    state,
)

QKV = "layers.0.self_attn.qkv_proj.weight"


def _source(tmp_path: Path) -> Path:
    """A model dir's side files (what a snapshot carries next to its weights)."""
    src = tmp_path / "model"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    return src


def _kernel_snapshot(tmp_path: Path, ckpt: dict[str, torch.Tensor]) -> Path:
    layout = ExportLayout(transposed=kernel_layout(Model()))
    return write_snapshot(ckpt, _source(tmp_path), tmp_path / "step_1", layout)


def test_the_replica_names_each_packed_layer_with_its_checkpoint_tensors() -> None:
    layout = kernel_layout(Model())
    assert sorted(layout) == sorted(
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )
    assert layout[QKV] == [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert layout["layers.1.mlp.down_proj.weight"] == ["layers.1.mlp.down_proj.weight"]


def test_the_trainer_stores_each_named_layer_joined_and_transposed(tmp_path: Path) -> None:
    ckpt = checkpoint()
    snapshot = _kernel_snapshot(tmp_path, ckpt)
    stored = load_file(str(snapshot / "model.safetensors"))
    qkv = [ckpt[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(stored[QKV], torch.cat(qkv).t())  # [in, out]
    assert "layers.0.self_attn.q_proj.weight" not in stored
    assert torch.equal(stored["layers.0.norm"], ckpt["layers.0.norm"])  # the rest: HF layout
    snap = open_snapshot(snapshot)
    assert snap.transposed[QKV] == [
        (f"layers.0.self_attn.{p}_proj.weight", 8 if p == "q" else 4) for p in "qkv"
    ]
    snap.close()
    assert stores_transposed(snapshot) and not stores_transposed(
        write_snapshot(ckpt, _source(tmp_path / "x"), tmp_path / "hf")
    )


def test_a_layout_naming_tensors_the_model_lacks_leaves_them_in_hf_layout(tmp_path: Path) -> None:
    ckpt = checkpoint()
    layout = ExportLayout(
        transposed={"other.qkv_proj.weight": ["other.q.weight", "other.k.weight"]}
    )
    snapshot = write_snapshot(ckpt, _source(tmp_path), tmp_path / "step_1", layout)
    assert not stores_transposed(snapshot)
    assert sorted(load_file(str(snapshot / "model.safetensors"))) == sorted(ckpt)


def test_export_hf_gives_back_the_checkpoint_tensors_exactly(tmp_path: Path) -> None:
    ckpt = checkpoint()
    hf = to_hf(_kernel_snapshot(tmp_path, ckpt), tmp_path / "hf")
    assert (hf / "config.json").is_file() and not stores_transposed(hf)
    back = load_file(str(hf / "model.safetensors"))
    assert sorted(back) == sorted(ckpt)
    assert all(torch.equal(back[k], v) for k, v in ckpt.items())


def test_export_hf_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = _kernel_snapshot(tmp_path, checkpoint())
    assert cli(["export-hf", str(snapshot), str(tmp_path / "hf")]) == 0
    assert not stores_transposed(tmp_path / "hf")
    assert cli(["export-hf", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2
    assert cli(["export-hf", str(snapshot), str(snapshot)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("lockgate: cannot export") and "not a snapshot" in err[0]
    assert err[1] == "lockgate: OUT must differ from SNAPSHOT"


def test_the_direct_load_builds_handles_from_the_stored_in_out_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = {k: v + 1.0 for k, v in checkpoint().items()}
    snapshot = _kernel_snapshot(tmp_path, ckpt)
    model = Model()
    # vLLM's oneDNN build reads `weight.t()`: from this snapshot that is the file's own
    # contiguous [in, out] tensor, not a transposed read of [out, in] rows.
    sources: list[bool] = []
    build = PackingMethod.process_weights_after_loading

    def spy(self: PackingMethod, layer: Any) -> None:
        sources.append(layer.weight.t().is_contiguous())
        build(self, layer)

    monkeypatch.setattr(PackingMethod, "process_weights_after_loading", spy)
    answer = loader(model).lockgate_load_snapshot(str(snapshot))
    assert answer["loaded"] is True, answer
    assert sources == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(state(model), _expected(ckpt), strict=True))


def test_a_staged_kernel_layout_snapshot_loads_the_same_weights(tmp_path: Path) -> None:
    ckpt = {k: v * 2.0 for k, v in checkpoint().items()}
    snapshot = _kernel_snapshot(tmp_path, ckpt)
    model = Model()
    ext = loader(model)
    assert ext.lockgate_stage_snapshot(str(snapshot), 10.0)["done"] is True
    assert ext.lockgate_load_snapshot(str(snapshot))["staged"] == 6
    assert all(torch.equal(a, b) for a, b in zip(state(model), _expected(ckpt), strict=True))


async def test_a_replica_that_cannot_load_it_directly_is_never_handed_it_through_reload_weights(
    tmp_path: Path,
) -> None:
    snapshot = _kernel_snapshot(tmp_path, checkpoint())
    for extension, refuse in ((False, False), (True, True)):
        fake = FakeReplica(extension, refuse)
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)) as http:
            replica = ReplicaClient("http://replica", http)
            with pytest.raises(ReplicaUnavailable, match="kernel layout"):
                await DiskTransport(DiskWeights(path=str(snapshot))).load(replica)
        assert "reload_weights" not in fake.methods


async def test_the_gateway_asks_each_replica_for_its_layout_once() -> None:
    for extension in (True, False):
        fake = FakeReplica(extension)
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)) as http:
            replica = ReplicaClient("http://replica", http)
            answers = [await weights.kernel_layout(replica) for _ in range(3)]
        if extension:
            assert answers == [{"l.qkv_proj.weight": ["l.q_proj.weight", "l.k_proj.weight"]}] * 3
            assert fake.methods == ["lockgate_snapshot_load_ready", "lockgate_snapshot_layout"]
        else:
            assert answers == [{}] * 3
            assert fake.methods == ["lockgate_snapshot_load_ready"]
