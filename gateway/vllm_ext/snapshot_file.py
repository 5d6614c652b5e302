"""Safetensors snapshots opened as zero-copy views of the file (read by a replica's worker).

Every tensor of a file is a view of one mmap of it, so tensors stored next to each other can
be read as one (a fused `gate_up_proj` from adjacent `gate_proj` and `up_proj`) without a
copy, and a snapshot the trainer has just written is read straight from the page cache.

A snapshot may store some linear weights in the layout the replicas' kernels read (the
trainer writes it so when the replicas ask, `GET /admin/weights/layout`): such a tensor is
named as the replica's parameter (`...qkv_proj.weight`), holds its checkpoint tensors joined
along their rows and then transposed ([in, out]), and is listed in the file's metadata under
`lockgate_transposed` as {name: [[checkpoint name, rows], ...]}. Nothing but lockgate's direct
load reads such a snapshot; `lockgate export-hf` turns it back into HF layout.
"""

from __future__ import annotations

import itertools
import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lockgate.gateway.vllm_ext.snapshot_header import transposed_entries

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class StoredTensor:
    file: int  # index into Snapshot.files
    start: int  # byte offset in that file
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Snapshot:
    """The tensors of every `*.safetensors` file in a directory; close() when done."""

    files: list[torch.Tensor] = field(default_factory=list)  # each file as one uint8 tensor
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    # Stored transposed ([in, out]): name -> the checkpoint tensors it joins, with their rows.
    transposed: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    _maps: list[mmap.mmap] = field(default_factory=list)

    def read(self, stored: StoredTensor) -> torch.Tensor:
        return self.view(stored, stored.end, stored.shape)

    def view(self, first: StoredTensor, end: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes from `first`'s start to `end` as a tensor of `shape` (no copy)."""
        raw = self.files[first.file][first.start : end]
        if first.start % first.dtype.itemsize:  # safetensors aligns data; copy if not
            raw = raw.clone()
        return raw.view(first.dtype).view(shape)

    def adjacent(self, parts: list[StoredTensor]) -> bool:
        """Whether the tensors follow each other in one file, in this order, without a gap."""
        return all(
            a.file == b.file and a.end == b.start and a.dtype == b.dtype
            for a, b in itertools.pairwise(parts)
        )

    def close(self) -> None:
        self.files.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()


def open_snapshot(path: Path) -> Snapshot:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    snap = Snapshot()
    for file in files:
        with file.open("rb") as f:
            # A private mapping is writable as far as torch can tell (no warning for a
            # read-only buffer) and nothing here writes to it, so it stays the page cache.
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        snap._maps.append(m)
        try:
            _index_file(snap, torch.frombuffer(m, dtype=torch.uint8), str(file))
        except ValueError:
            snap.close()
            raise
    _check_transposed(snap, str(path))
    return snap


def snapshot_from_image(image: torch.Tensor, where: str) -> Snapshot:
    """A snapshot held in memory: `image` (uint8, on any device) holds the bytes of one
    safetensors file, as the collective transport sends it (collective_load.py). No copy."""
    snap = Snapshot()
    _index_file(snap, image, where)
    _check_transposed(snap, where)
    return snap


def _index_file(snap: Snapshot, data: torch.Tensor, where: str) -> None:
    """Add the tensors of one safetensors file's bytes `data` to `snap`."""
    raw = data[:8].cpu().numpy().tobytes()
    (header_len,) = struct.unpack("<Q", raw) if len(raw) == 8 else (len(data),)
    if 8 + header_len > len(data):
        raise ValueError(f"{where} is not a safetensors file (header past its end)")
    header = json.loads(data[8 : 8 + header_len].cpu().numpy().tobytes())
    base = 8 + header_len
    index = len(snap.files)
    snap.files.append(data)
    try:
        snap.transposed.update(transposed_entries(header.get("__metadata__") or {}))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{where}: {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        snap.tensors[name] = StoredTensor(
            index, base + begin, base + end, _DTYPES[entry["dtype"]], tuple(entry["shape"])
        )


def _check_transposed(snap: Snapshot, where: str) -> None:
    missing = sorted(set(snap.transposed) - set(snap.tensors))
    if missing:
        snap.close()
        raise ValueError(f"{where}: {missing[0]} is listed as transposed but not stored")
