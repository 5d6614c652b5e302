"""An agent that runs as an HTTP service: the coordinator POSTs one request per rollout.

The service may run anywhere the coordinator can reach (another host, a cluster) and be
written in any language. Per rollout it gets a `ServiceRequest` (service_wire.py: the task,
the session's OpenAI base URL and key, the model name, the reward URL and the deadline), runs
its agent against that session and answers a `ServiceAnswer` (`{"reward": x}`, or no reward
when it posted one to the reward URL itself; `run_rollout` then reads that one).

Every way the service can fail raises a `ServiceFailed` with a one-line reason, which fails
that rollout only (`run_rollout` records it on the session and the loop counts it): a refused
or broken connection (`ServiceUnreachable`), an HTTP error status (`ServiceHttpError`), no
answer by the deadline (`ServiceTimedOut`), an answer that is not the contract's
(`ServiceAnswerInvalid`). A failure is never turned into a reward of zero.

A refused connection or a 5xx is retried, within the deadline, only while the session has no
recorded model call (asked of the gateway's admin API): a service that already sampled
tokens would sample them again in the same session, and the session's record would no longer
be one run of the agent. A rollout that cannot be checked is not retried.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import string
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError

from lockgate.agent_runtime.command import reward_url
from lockgate.agent_runtime.connections import shared_transport
from lockgate.agent_runtime.environments import TasksEnvironment
from lockgate.agent_runtime.service_wire import ServiceAnswer, ServiceRequest, ServiceTask
from lockgate.agent_runtime.types import RolloutContext, Task
from lockgate.gateway.client import GatewayClient, GatewayClientError

log = logging.getLogger(__name__)

_EXCERPT_CHARS = 200  # of a bad answer's body, in the rollout's error


class ServiceFailed(Exception):
    """The service gave no usable answer for a rollout; the message says why, in one line."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ServiceUnreachable(ServiceFailed):
    """The connection was refused, reset or broken before a whole answer arrived."""


class ServiceHttpError(ServiceFailed):
    """The service answered an HTTP error status."""


class ServiceTimedOut(ServiceFailed):
    """No answer by the rollout's deadline (`timeout_s`)."""


class ServiceAnswerInvalid(ServiceFailed):
    """A 2xx answer that is not a JSON object with a finite numeric (or absent) "reward"."""


class ServiceOptions(BaseModel):
    """How the coordinator calls the service (`environment.args` beside `environment.url`)."""

    model_config = ConfigDict(extra="forbid")
    max_concurrency: int = Field(
        default=64, ge=1, description="Rollouts in flight at the service at once; others wait."
    )
    timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Per rollout, waiting for a slot and retries included: the deadline sent.",
    )
    retries: int = Field(
        default=2,
        ge=0,
        description="Further tries after a refused connection or a 5xx, only while the session"
        " has no recorded call.",
    )
    retry_backoff_s: float = Field(
        default=0.5, ge=0, description="Wait before the first retry; doubled for each next one."
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="HTTP headers sent with every request; ${VAR} in a value is read from the"
        ' environment (e.g. Authorization: "Bearer ${AGENT_TOKEN}"), so no secret sits in the'
        " config.",
    )
    answer_limit_kib: int = Field(
        default=1024, ge=1, description="Largest answer body read; a larger one is invalid."
    )


def expand_headers(headers: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Header values with `${VAR}` (and `$VAR`) taken from `environ`; `$$` is a literal `$`.

    A variable that is not set is a `ValueError` naming the header and the variable, never
    the value (it is usually a secret).
    """
    out: dict[str, str] = {}
    for name, value in headers.items():
        try:
            out[name] = string.Template(value).substitute(environ)
        except KeyError as exc:
            raise ValueError(
                f"header {name!r} needs the environment variable {exc.args[0]}, which is not set"
            ) from None
        except ValueError as exc:
            raise ValueError(f"header {name!r}: {exc} (write $$ for a literal $)") from None
    return out


def _one_line(text: str, limit: int = _EXCERPT_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def _transport_failure(url: str, exc: httpx.TransportError) -> ServiceUnreachable:
    detail = _one_line(str(exc)) or "no detail"
    return ServiceUnreachable(f"POST {url}: {type(exc).__name__}: {detail}", retryable=True)


def reward_of_answer(url: str, status: int, body: bytes) -> float | None:
    """The reward an answer carries, None when it carries none; `ServiceFailed` otherwise."""
    if status == 204:
        return None
    if not 200 <= status < 300:
        excerpt = _one_line(body.decode("utf-8", errors="replace")) or "no body"
        raise ServiceHttpError(f"{url} answered HTTP {status}: {excerpt}", retryable=status >= 500)
    try:
        answer = ServiceAnswer.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        excerpt = _one_line(body.decode("utf-8", errors="replace")) or "an empty body"
        raise ServiceAnswerInvalid(
            f"{url} answered HTTP {status} with {excerpt!r}: "
            f"{where + ': ' if where else ''}{first['msg']}"
        ) from None
    return answer.reward


def _gateway_root(base_url: str) -> str | None:
    """The gateway's URL from a session-scoped base URL `<gateway>/sessions/<sid>/v1`."""
    root, found, _ = base_url.rpartition("/sessions/")
    return root if found else None


class ServiceAgent:
    """An `Agent` that POSTs each rollout to `url`; see the module docstring for the contract.

    `attach_gateway` gives it the admin token it needs to check, before a retry, that a
    session has no recorded call (without it nothing is retried), and the gateways' URLs as
    the service reaches them where they differ from the coordinator's.
    """

    def __init__(
        self,
        url: str,
        options: ServiceOptions | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.url = str(HttpUrl(url))
        self.options = options or ServiceOptions()
        self._headers = expand_headers(
            self.options.headers, os.environ if environ is None else environ
        )
        self._transport = transport  # tests inject one; by default the run's shared pool
        self._slots = asyncio.Semaphore(self.options.max_concurrency)
        self._admin_token: str | None = None
        self._gateway_transport: httpx.AsyncBaseTransport | None = None
        self._public_roots: dict[str, str] = {}

    def attach_gateway(
        self,
        admin_token: str,
        transport: httpx.AsyncBaseTransport | None = None,
        public_roots: Mapping[str, str] | None = None,
    ) -> None:
        """Let retries ask the sessions' gateway (any of the run's) whether a call was recorded.

        `public_roots` maps a gateway's URL as the coordinator reaches it to the URL the service
        is sent instead (coordinator/launch/advertise.py): a loopback URL means nothing on the
        service's host. Session URLs of a gateway not in it are sent as they are.
        """
        self._admin_token = admin_token
        self._gateway_transport = transport
        self._public_roots = {k.rstrip("/"): v.rstrip("/") for k, v in (public_roots or {}).items()}

    def _public(self, base_url: str) -> str:
        """A session's base URL as the service reaches it."""
        root = _gateway_root(base_url)
        public = self._public_roots.get(root) if root is not None else None
        return base_url if root is None or public is None else public + base_url[len(root) :]

    async def __call__(self, task: Task, ctx: RolloutContext) -> float | None:
        deadline = time.time() + self.options.timeout_s
        try:
            async with asyncio.timeout(self.options.timeout_s):
                async with self._slots:
                    return await self._attempts(task, ctx, deadline)
        except TimeoutError:
            failure: ServiceFailed = ServiceTimedOut(
                f"{self.url} gave no answer within timeout_s={self.options.timeout_s:g}"
            )
        except ServiceFailed as exc:
            failure = exc
        log.warning(
            "service rollout of task %s (session %s) failed: %s: %s",
            task.id,
            ctx.session_id,
            type(failure).__name__,
            failure,
        )
        raise failure

    async def _attempts(self, task: Task, ctx: RolloutContext, deadline: float) -> float | None:
        for attempt in itertools.count(1):
            try:
                return await self._post(task, ctx, deadline, attempt)
            except ServiceFailed as exc:
                if not exc.retryable:
                    raise
                tries = f" ({attempt} attempt{'s' if attempt > 1 else ''})"
                if attempt > self.options.retries:
                    raise type(exc)(f"{exc}{tries}") from None
                refused = await self._why_not_retry(ctx)
                if refused is not None:
                    raise type(exc)(f"{exc}{tries}; not retried: {refused}") from None
                await asyncio.sleep(self.options.retry_backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")  # itertools.count never ends

    async def _post(
        self, task: Task, ctx: RolloutContext, deadline: float, attempt: int
    ) -> float | None:
        base_url = self._public(ctx.base_url)
        request = ServiceRequest(
            task=ServiceTask(id=task.id, data=task.data),
            session_id=ctx.session_id,
            base_url=base_url,
            api_key=ctx.api_key,
            model=ctx.model,
            reward_url=reward_url(base_url),
            deadline_unix_s=deadline,
            seconds_left=max(deadline - time.time(), 0.0),
            attempt=attempt,
        )
        # Not closed after use: it owns no connections (the transport is the run's shared pool
        # or the one a test injected, and outlives this request).
        http = httpx.AsyncClient(transport=self._transport or shared_transport(), timeout=None)
        headers = {**self._headers, "Content-Type": "application/json"}
        limit = self.options.answer_limit_kib * 1024
        try:
            async with http.stream(
                "POST", self.url, content=request.model_dump_json(), headers=headers
            ) as response:
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise ServiceAnswerInvalid(
                            f"{self.url} answered more than answer_limit_kib={limit // 1024}"
                        )
        except httpx.TransportError as exc:
            raise _transport_failure(self.url, exc) from exc
        return reward_of_answer(self.url, response.status_code, bytes(body))

    async def _why_not_retry(self, ctx: RolloutContext) -> str | None:
        """None when the session has no recorded call (a retry is safe), else the reason."""
        root = _gateway_root(ctx.base_url)
        if self._admin_token is None or root is None:
            return "no gateway to check the session's records against"
        transport = self._gateway_transport or shared_transport()
        gateway = GatewayClient(root, self._admin_token, transport=transport)
        try:
            info = await gateway.session(ctx.session_id)
        except (GatewayClientError, httpx.TransportError) as exc:
            return f"the session's records could not be read ({_one_line(str(exc))})"
        finally:
            await gateway.aclose()
        if info.num_calls:
            return f"the session already has {info.num_calls} recorded call(s)"
        return None


class ServiceEnvironment(TasksEnvironment):
    """Tasks from a JSONL file, each rollout run by the agent service at `url`.

    It has no reward function: the service answers its reward or posts it to the gateway.
    """

    def __init__(
        self,
        url: str,
        tasks: Path | Sequence[Task],
        options: ServiceOptions | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._service = ServiceAgent(url, options, transport=transport, environ=environ)
        super().__init__(tasks, self._service)

    def attach_gateway(
        self,
        admin_token: str,
        transport: httpx.AsyncBaseTransport | None = None,
        public_roots: Mapping[str, str] | None = None,
    ) -> None:
        """See `ServiceAgent.attach_gateway`; the coordinator calls it once its gateway runs."""
        self._service.attach_gateway(admin_token, transport, public_roots)
