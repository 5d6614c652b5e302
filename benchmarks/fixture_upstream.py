"""A fast stand-in for a vLLM 0.32 replica, so a benchmark measures the gateway, not vLLM.

It speaks what the gateway calls: the streamed token-in/token-out `POST /inference/v1/generate`
(SSE over chunked transfer encoding, one event per token like vLLM's engine steps, the last
with `finish_reason` and the replica's `weight_versions`, then `[DONE]`), `GET /health`,
`GET /weight_info` and `POST /update_weight_version`. Every generation answers the same
completion ids (cut to `max_tokens`), with no sampling and no delay.

Written on asyncio + httptools (no framework): at a few thousand requests/s a framework's own
cost would be a large share of the "direct" baseline the gateway is compared with.

    python -m benchmarks.fixture_upstream --port 8101 --completion 9707,1052,151645
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httptools
import orjson
import uvloop


class _Replica:
    def __init__(self, completion: list[int]) -> None:
        self.completion = completion
        self.label = "0"

    def generate(self, body: dict[str, Any]) -> bytes:
        """The whole chunked SSE answer of one generation, as one buffer."""
        n = min(len(self.completion), int(body["sampling_params"]["max_tokens"]))
        rid = body.get("request_id", "")
        out = [
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        ]
        for i, token in enumerate(self.completion[:n]):
            last = i == n - 1
            choice: dict[str, Any] = {
                "index": 0,
                "token_ids": [token],
                "logprobs": {"content": [{"token_id": token, "logprob": -0.5}]},
                "finish_reason": ("stop" if n == len(self.completion) else "length")
                if last
                else None,
            }
            if last:
                choice["weight_versions"] = [{"version": self.label, "start": 0, "end": n}]
            out.append(_chunk(b"data: " + orjson.dumps({"request_id": rid, "choices": [choice]})))
        out.append(_chunk(b"data: [DONE]"))
        out.append(b"0\r\n\r\n")
        return b"".join(out)


def _chunk(event: bytes) -> bytes:
    payload = event + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _json_response(payload: Any) -> bytes:
    body = orjson.dumps(payload)
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


class _Connection(asyncio.Protocol):
    def __init__(self, replica: _Replica) -> None:
        self._replica = replica
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        path = self._url.split(b"?", 1)[0]
        body = b"".join(self._body)
        self._url, self._body = b"", []
        if path == b"/inference/v1/generate":
            answer = self._replica.generate(orjson.loads(body))
        elif path == b"/weight_info":
            answer = _json_response({"weight_version": self._replica.label})
        elif path == b"/update_weight_version":
            self._replica.label = str(orjson.loads(body)["new_version"])
            answer = _json_response({})
        else:  # /health and the other admin endpoints: nothing to do here
            answer = _json_response({})
        self._transport.write(answer)


async def serve(host: str, port: int, completion: list[int]) -> None:
    replica = _Replica(completion)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(replica), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--completion", required=True, help="comma-separated token ids")
    args = parser.parse_args()
    completion = [int(t) for t in args.completion.split(",")]
    uvloop.run(serve(args.host, args.port, completion))


if __name__ == "__main__":
    main()
