"""The gateway app over a fake replica that always answers one text, served on a loopback port:
for tests whose agent is another process (a command, a service) and so needs a real socket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig
from tests.support.fake_gateway import FakeReplica
from tests.support.threaded_server import serve_in_thread


@dataclass
class SocketGateway:
    url: str
    app: Any
    replica: FakeReplica


@contextmanager
def socket_gateway(
    model_dir: Path, db_dir: Path, admin_token: str, answer: str
) -> Iterator[SocketGateway]:
    """Serve the gateway (store in `db_dir`) until the block ends; its replica says `answer`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    replica = FakeReplica(
        completion=tok.encode(answer, add_special_tokens=False)
        + [tok.convert_tokens_to_ids("<|im_end|>")]
    )
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(replica.handler))
    config = GatewayConfig(
        model_dir=model_dir,
        replicas=["http://fake-replica:8000"],
        db_path=db_dir / "store.sqlite",
        admin_token=admin_token,
        max_model_len=256,
    )
    app = create_app(config, http=upstream)
    with serve_in_thread(app) as port:
        try:
            yield SocketGateway(f"http://127.0.0.1:{port}", app, replica)
        finally:
            asyncio.run(upstream.aclose())
