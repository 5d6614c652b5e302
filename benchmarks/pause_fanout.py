"""What pausing every replica costs the gateway's event loop: httpx admin call vs lean POST.

A sync pauses every replica at once, on the event loop that is also closing every cut stream,
so the CPU the fan-out takes is time that loop is not answering the pauses. This times
`--rounds` pauses of `--replicas` stand-in replicas (`sim_replicas.py`, on the same loop) with
the gateway's `ReplicaClient`, two ways, alternating: through `call_admin` (httpx on aiohttp,
every admin call) and through `ReplicaClient.pause("abort")` (the generate path's HTTP/1.1
client). The CPU figure is this process's, stand-ins included; each pause is resumed before
the next.

    PYTHONPATH=. .venv/bin/python -m benchmarks.pause_fanout
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import uvloop

from benchmarks.loadgen import percentile
from benchmarks.sim_replicas import Completion, EngineModel, ReplicaLog, start_replicas
from lockgate.gateway.aiohttp_transport import AiohttpTransport
from lockgate.gateway.replicas.http1 import Http1Upstream
from lockgate.gateway.replicas.replica_client import ReplicaClient
from lockgate.gateway.vllm_ext.routes import PAUSE_PATH


async def _run(replicas: int, rounds: int) -> None:
    stand_ins = await start_replicas(
        replicas, EngineModel(), Completion([1, 2], [3]), ReplicaLog(key_blocks=1)
    )
    ports = [r.port for r in stand_ins]
    # As the gateway builds them (api/gateway.py).
    http = httpx.AsyncClient(transport=AiohttpTransport(max_connections=1024))
    upstream = Http1Upstream(max_connections=1024)
    clients = [ReplicaClient(f"http://127.0.0.1:{p}", http, upstream) for p in ports]

    async def via_httpx(c: ReplicaClient) -> object:
        return await c.call_admin(PAUSE_PATH, params={"mode": "abort"})

    async def lean(c: ReplicaClient) -> object:
        return await c.pause("abort")

    ways: dict[str, Callable[[ReplicaClient], Awaitable[object]]] = {
        "httpx (call_admin)": via_httpx,
        "lean (pause)": lean,
    }
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    wall: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for i in range(rounds + 1):  # the first round opens the connections, unmeasured
            for name, way in ways.items():
                t, c = time.perf_counter(), time.process_time()
                await asyncio.gather(*(way(client) for client in clients))
                if i:
                    wall[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)
                await asyncio.gather(*(client.resume() for client in clients))
    finally:
        await http.aclose()
        await upstream.aclose()
        for r in stand_ins:
            await r.stop()
    print(f"| way | replicas | CPU ms p50 | wall ms p50 | wall ms p99 |  ({rounds} rounds)")
    print("|---|---:|---:|---:|---:|")
    for name in ways:
        print(
            f"| {name} | {replicas} | {percentile(cpu[name], 0.5) * 1e3:.1f} "
            f"| {percentile(wall[name], 0.5) * 1e3:.1f} | {percentile(wall[name], 0.99) * 1e3:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    uvloop.run(_run(args.replicas, args.rounds))


if __name__ == "__main__":
    main()
