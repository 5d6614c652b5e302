"""The processes an evaluation needs, started together and stopped in reverse order.

A retrieval service (or one already running, by URL), local vLLM replicas of the model (or
replicas already running, by URL: the CPU recipe keeps one pair for both evaluations and the RL
run between them) and a lockgate gateway in front of them that honours each call's sampling
values (an evaluation asks for temperature 1 and for greedy). The same parts `lockgate train`
starts, minus the trainer, and the same decision of the model's chat format
(gateway/calls/chat_format.py: `auto` reads it from the model's files), so an evaluation renders
and parses the model's calls as its training run did.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from lockgate.coordinator.launch.gateway import GatewayProcess
from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.coordinator.run_dir import RunDir
from lockgate.examples.deepresearch.retrieval.launcher import RetrievalService
from lockgate.gateway.calls.chat_format import AUTO, resolve_chat_format
from lockgate.gateway.config import GatewayConfig, SamplingPolicy
from lockgate.gateway.replicas.replica_client import ReplicaClient, ReplicaUnavailable


def start_retrieval(corpus: Path, log_dir: Path) -> RetrievalService:
    """A service on `corpus`, its BM25 index kept beside it (built at start: seconds on the CPU
    knowledge base)."""
    service = RetrievalService(
        corpus.parent / f"{corpus.stem}.bm25", log_path=log_dir / "retrieval.log", corpus=corpus
    )
    service.start()
    return service


@dataclass(frozen=True)
class Served:
    gateway_url: str
    admin_token: str
    retrieval_url: str


@contextlib.contextmanager
def serve_model(
    model_dir: Path,
    corpus: Path,
    work_dir: Path,
    *,
    replicas: int = 2,
    max_model_len: int = 2048,
    retrieval_url: str | None = None,
    replica_urls: Sequence[str] = (),
    weights_version: int = 0,
    chat_format: str = AUTO,
) -> Iterator[Served]:
    """Retrieval, replicas and a gateway for `model_dir`; logs and the store in `work_dir`,
    laid out as a run dir's (so `lockgate view WORK_DIR` opens the store).

    With `replica_urls` no replica is started: those serve, holding the weights of
    `weights_version` (the gateway labels its records with it; `model_dir` gives the tokenizer
    and chat template). `chat_format` is a run config's `model.chat_format`; one that cannot be
    decided is a `ChatFormatError` (one line) before anything starts."""
    renderer = resolve_chat_format(chat_format, model_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    logs = RunDir(work_dir).logs
    with contextlib.ExitStack() as stack:
        if retrieval_url is not None:
            service = RetrievalService.external(retrieval_url)
        else:
            service = start_retrieval(corpus, logs)
        stack.callback(service.stop)
        urls = list(replica_urls)
        if not urls:
            replica_set = LocalReplicaSet(
                ReplicaLaunchConfig(
                    model_dir=model_dir, count=replicas, max_model_len=max_model_len, log_dir=logs
                )
            )
            stack.callback(replica_set.stop)
            replica_set.start()
            urls = replica_set.urls
        token = secrets.token_urlsafe(24)
        gateway = GatewayProcess(
            GatewayConfig(
                model_dir=model_dir,
                renderer=renderer,
                replicas=urls,
                db_path=RunDir(work_dir).store,
                admin_token=token,
                max_model_len=max_model_len,
                sampling=SamplingPolicy(mode="honor"),
                initial_version=weights_version,
            ),
            work_dir,
        )
        stack.callback(gateway.stop)
        gateway.start()
        yield Served(gateway.url, token, service.url)


# The label vLLM's engine starts with (v1/engine/core.py): the weights it was started from.
_STARTED_LABEL = "default"


def weights_versions(replica_urls: Sequence[str]) -> list[int]:
    """The weight version each running lockgate replica holds: 0 as started (or as labelled by
    a gateway in front of it since), then the version of each weight load a training run's sync
    made."""

    async def labels() -> list[str | None]:
        async with httpx.AsyncClient() as http:
            clients = [ReplicaClient(url, http) for url in replica_urls]
            return await asyncio.gather(*(c.version_label() for c in clients))

    try:
        found = asyncio.run(labels())
    except (ReplicaUnavailable, ValueError) as exc:  # down, or not answering in JSON
        raise RuntimeError(f"{exc}; is it a lockgate replica (lockgate replicas)?") from None
    versions = []
    for url, label in zip(replica_urls, found, strict=True):
        try:
            versions.append(0 if label == _STARTED_LABEL else int(label or ""))
        except ValueError:
            raise RuntimeError(
                f"replica {url}: weight version label {label!r} is not a version"
            ) from None
    return versions
