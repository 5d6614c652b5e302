"""Rollouts' OpenAI clients share one connection pool, which outlives any one client."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from lockgate.agent_runtime import RolloutContext
from lockgate.agent_runtime.connections import _pools, close_shared_transport


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "lockgate",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
    }


async def _serve() -> tuple[web.AppRunner, str, list[tuple[str, str, int]]]:
    seen: list[tuple[str, str, int]] = []

    async def chat(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        seen.append((request.match_info["sid"], request.headers["Authorization"], peer[1]))
        return web.json_response(_completion(f"hi {request.match_info['sid']}"))

    app = web.Application()
    app.router.add_post("/sessions/{sid}/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


def test_clients_of_different_sessions_share_a_pool_that_closing_one_keeps_open() -> None:
    async def main() -> None:
        runner, url, seen = await _serve()
        try:
            contexts = [
                RolloutContext(session_id=s, base_url=f"{url}/sessions/{s}/v1", api_key=f"key-{s}")
                for s in ("a", "b")
            ]
            async with contexts[0].openai_client(max_retries=0) as first:
                reply = await first.chat.completions.create(
                    model="lockgate", messages=[{"role": "user", "content": "x"}]
                )
                assert reply.choices[0].message.content == "hi a"
            # The first client is closed; the second still has a working pool, and reuses the
            # kept-alive connection the first one opened (same client port).
            async with contexts[1].openai_client(max_retries=0) as second:
                reply = await second.chat.completions.create(
                    model="lockgate", messages=[{"role": "user", "content": "y"}]
                )
                assert reply.choices[0].message.content == "hi b"
            assert [(s, auth) for s, auth, _ in seen] == [
                ("a", "Bearer key-a"),
                ("b", "Bearer key-b"),
            ]
            assert seen[0][2] == seen[1][2]
            # This loop's one pool is still open (other tests' loops may not be collected yet).
            assert asyncio.get_running_loop() in _pools
        finally:
            await close_shared_transport()
            await runner.cleanup()
        assert asyncio.get_running_loop() not in _pools

    asyncio.run(main())
