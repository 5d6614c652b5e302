"""Command line: build an index from a JSONL corpus, or serve one.

    python -m lockgate.examples.deepresearch.retrieval build --corpus C.jsonl --index DIR
    python -m lockgate.examples.deepresearch.retrieval serve --index DIR [--corpus C.jsonl] \\
        [--host 127.0.0.1] [--port 0]

`serve` prints the service's URL, alone on a line of stdout, once it accepts connections
(port 0: a free port the kernel picks); everything else goes to stderr. Bad input ends the
command with a one-line error on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from lockgate.examples.deepresearch.retrieval.index import (
    BM25Index,
    CorpusError,
    IndexConfig,
    IndexLoadError,
)
from lockgate.examples.deepresearch.retrieval.server import create_app

PROG = "python -m lockgate.examples.deepresearch.retrieval"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="BM25 retrieval service")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="index a JSONL corpus into a directory")
    build.add_argument("--corpus", type=Path, required=True, help='JSONL: {"id", "contents"}')
    build.add_argument("--index", type=Path, required=True, help="directory to write")
    build.add_argument("--stopwords", choices=["en", "none"], default="en")
    build.add_argument("--stemmer", choices=["none", "english"], default="none")
    serve = commands.add_parser("serve", help="serve an index over HTTP")
    serve.add_argument("--index", type=Path, required=True, help="an index directory")
    serve.add_argument(
        "--corpus", type=Path, help="build the index from this corpus into --index first"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0: pick a free port")
    serve.add_argument("--max-batch", type=int, default=64, help="queries per search batch")
    serve.add_argument(
        "--max-wait-ms",
        type=float,
        default=0.0,
        help="how long a batch waits for more queries (default 0: it takes those that arrived "
        "while the previous batch ran)",
    )
    return parser


def _build(corpus: Path, index_dir: Path, config: IndexConfig) -> BM25Index:
    start = time.perf_counter()
    index = BM25Index.build(corpus, index_dir, config)
    print(
        f"indexed {len(index)} documents from {corpus} into {index_dir} "
        f"in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    return index


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    # A wildcard address is not one a client can connect to.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _AnnouncingServer(uvicorn.Server):
    """Prints the URL once the socket accepts connections and the app has started."""

    def __init__(self, config: uvicorn.Config, url: str) -> None:
        super().__init__(config)
        self.url = url

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(self.url, flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # SIGTERM or Ctrl-C asked for the shutdown just done: the service exits 0, as
            # stopped services should (uvicorn raises the signal again, which exits -15 and
            # reads as a crash to compose and to the launcher).
            self._captured_signals.clear()


async def _serve(index: BM25Index, sock: socket.socket, args: argparse.Namespace) -> None:
    app = create_app(index, max_batch=args.max_batch, max_wait_s=args.max_wait_ms / 1000)
    # Longer than clients keep idle connections (httpx 5 s, RetrievalClient's default), as the
    # gateway's server does: with uvicorn's 5 s an agent back from a 5 s turn of generation
    # could send on a connection being closed, and its search would fail with a reset.
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=75)
    await _AnnouncingServer(config, _url(sock)).serve(sockets=[sock])


def _run(args: argparse.Namespace) -> None:
    if args.command == "build":
        _build(args.corpus, args.index, IndexConfig(stopwords=args.stopwords, stemmer=args.stemmer))
        return
    if args.max_batch < 1 or args.max_wait_ms < 0:
        raise ValueError("--max-batch must be at least 1 and --max-wait-ms at least 0")
    if args.corpus is not None:
        index = _build(args.corpus, args.index, IndexConfig())
    else:
        index = BM25Index.load(args.index)
    sock = _bind(args.host, args.port)
    print(f"serving {len(index)} documents from {args.index}", file=sys.stderr, flush=True)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(index, sock, args))
    else:
        uvloop.run(_serve(index, sock, args))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _run(args)
    except (CorpusError, IndexLoadError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
