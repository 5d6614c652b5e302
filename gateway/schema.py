"""Wire types: the OpenAI request/response subset the gateway serves, and the admin API.

Everything that crosses the gateway's HTTP boundary is one of these models. Agent-facing
request models forbid unknown fields: a parameter we would silently ignore is a 400 instead.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator, model_validator

# ---------------------------------------------------------------------------------------------
# Agent-facing: chat completions


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Some clients echo these back on assistant turns; they carry nothing we render.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: Any | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON schema of type 'object'")
        return value


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: this function must be called."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=128)  # OpenAI's range; n > 1 is refused as unsupported
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Accepted and recorded; they do not change what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionRequest(BaseModel):
    """`/v1/completions`: one prompt, as text or as token ids, continued as is (no template)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | list[int] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=128)  # OpenAI's range; n > 1 is refused as unsupported
    stream: bool = False
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None

    def token_budget(self) -> int | None:
        return self.max_tokens


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ---------------------------------------------------------------------------------------------
# Records


class VersionSpan(BaseModel):
    """Completion tokens [start, end) were generated by weights `version`."""

    version: int
    start: int
    end: int


class CallRecord(BaseModel):
    session_id: str
    index: int
    request: dict[str, Any]  # the request as the agent sent it
    sampling: dict[str, Any]  # the sampling parameters actually used
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # one per completion token
    versions: list[VersionSpan]
    finish_reason: str
    replica: str
    started_at: float
    ended_at: float
    interruptions: int = 0
    extends_previous: bool  # prompt starts with the previous call's prompt + completion exactly

    @computed_field  # type: ignore[prop-decorator]
    @property
    def constrained(self) -> bool:
        """Sampled under a grammar (a forced tool call): the logprobs are the unconstrained
        model's, not those of the distribution the tokens were drawn from."""
        return "structured_outputs" in self.sampling


SessionStatus = Literal["open", "finished", "failed"]


class SessionInfo(BaseModel):
    session_id: str
    task_id: str
    group_id: str | None
    metadata: dict[str, Any]
    status: SessionStatus
    reward: float | None
    error: str | None
    created_at: float
    finished_at: float | None
    num_calls: int
    rerender_splits: int


class TrajectorySample(BaseModel):
    """One merged token sequence of a session (records/merge.py), from which the coordinator
    builds the trainer's samples; all per-token lists have the same length."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 on sampled tokens only
    logprobs: list[float]  # rollout logprob where loss_mask == 1, else 0.0
    versions: list[int]  # weight version per token where loss_mask == 1, else -1
    call_indices: list[int]  # the calls merged into this sample


class SessionSamples(BaseModel):
    session: SessionInfo
    samples: list[TrajectorySample]
    splits: int  # calls that did not extend the previous call's tokens and began a new sample


# ---------------------------------------------------------------------------------------------
# Admin API


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str
    group_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class CreatedSession(BaseModel):
    session_id: str
    api_key: str
    base_url: str  # path-scoped OpenAI base URL, relative to the gateway root


class FinishSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["finished", "failed"] = "finished"
    reward: float | None = None
    error: str | None = None


class SetReward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float


class SetMetadata(BaseModel):
    """Keys an agent adds to its session's metadata (how an episode ended, tool errors, ...)."""

    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any]


PauseMode = Literal["abort", "keep", "drain"]


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: PauseMode = "abort"
    timeout_s: float = Field(default=600.0, gt=0)


class PauseReport(BaseModel):
    mode: PauseMode
    latency_s: float  # pause request to every replica quiescent
    interrupted: int  # segments cut by this pause (abort), their calls resume after the sync
    tokens_kept: int  # tokens those segments had generated, all kept
    frozen: int  # requests frozen inside vLLM (keep)
    version: int
    # abort mode, from the pause request: every cut stream closed / every replica paused in vLLM
    streams_closed_s: float = 0.0
    replicas_paused_s: float = 0.0
    # Of replicas_paused_s, the longest time an engine itself took, as its replica reports it
    # (replicas with lockgate's pause route; None if none has it): the rest is HTTP to the
    # replicas' API servers and back.
    engines_paused_s: float | None = None


# Weight sources: how new weights reach the replicas (the transports are sync/weights.py).


class StagedReplica(BaseModel):
    slices: int  # RPCs, each holding the engine for about slice_s
    build_s: float  # the replica's time spent building (its slices, summed)


class DiskWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transport: Literal["disk"] = "disk"
    path: str = Field(
        description="Snapshot dir (safetensors in HF or the replicas' kernel layout, and the "
        "model's config.json) every replica can read."
    )


class NcclWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transport: Literal["nccl"]
    update_info: dict[str, Any] = Field(
        description="vLLM's WeightTransferUpdatePayload (names, dtypes, shapes of the tensors "
        "the trainer is about to broadcast)."
    )


# A weights group's id goes into its store keys (trainer/protocol.py spells it out too).
GROUP_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class CollectiveWeights(BaseModel):
    """Weights streamed by trainer rank 0 over a torch.distributed group every replica's
    worker joins (sync/weights.py `CollectiveTransport`); the trainer's own declaration of the
    group is trainer/protocol.py `CollectiveGroup`, field for field."""

    model_config = ConfigDict(extra="forbid")
    transport: Literal["collective"]
    address: str = Field(min_length=1, description="Where trainer rank 0 hosts the group's store.")
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(
        ge=2, description="1 (the trainer) + the gateway's replicas, each one rank."
    )
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(
        gt=0,
        description="Every step of the transfer (each message; joining too, without "
        "join_timeout_s) fails after this.",
    )
    join_timeout_s: float | None = Field(
        default=None, gt=0, description="Forming the group fails after this; None: timeout_s."
    )
    group_id: str = Field(
        default="0",
        pattern=GROUP_ID_PATTERN,
        description="Names one forming of the group: a new id has every member join afresh "
        "(the coordinator names one at a run's first sync, after a failed one and when the "
        "gateway's replicas change, since a formed group takes no new member).",
    )


class AdapterWeights(BaseModel):
    """A LoRA adapter for a gateway in adapter mode (`GatewayConfig.adapter`): each replica
    loads it beside the base model under `<name>@v<version>` (replicas/adapters.py), and no
    replica's engine is paused or relabelled."""

    model_config = ConfigDict(extra="forbid")
    transport: Literal["adapter"]
    path: str = Field(
        min_length=1,
        description="Adapter dir (peft's adapter_config.json and adapter_model.safetensors) "
        "every replica can read.",
    )


WeightSource = Annotated[
    DiskWeights | NcclWeights | CollectiveWeights | AdapterWeights,
    Field(discriminator="transport"),
]


class LoadWeights(BaseModel):
    """`{"version": 3, "path": DIR}` (disk, the default), `{"version", "transport": "nccl",
    "update_info"}`, `{"version", "transport": "collective", "address", "port", ...}` or
    `{"version", "transport": "adapter", "path": DIR}` (a gateway in adapter mode)."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    source: WeightSource

    @model_validator(mode="before")
    @classmethod
    def _flat_disk_form(cls, data: Any) -> Any:
        return _nest_source(data, keep=("version",))


class StageWeights(BaseModel):
    """`{"path": DIR}` (disk) or `{"source": {...}}`: prepare a load while serving."""

    model_config = ConfigDict(extra="forbid")
    source: WeightSource
    # Each replica's engine is held this long at a time (a slice builds at least one handle),
    # then runs a step: longer slices stage sooner, shorter ones stall calls less.
    slice_s: float = Field(default=0.2, gt=0, le=60)

    @model_validator(mode="before")
    @classmethod
    def _flat_disk_form(cls, data: Any) -> Any:
        return _nest_source(data, keep=("slice_s",))


def _nest_source(data: Any, keep: tuple[str, ...]) -> Any:
    """The flat form (the source's fields beside `keep`, transport disk unless said) nested."""
    if isinstance(data, dict) and "source" not in data:
        rest = {k: v for k, v in data.items() if k not in keep}
        if "transport" not in rest:
            rest["transport"] = "disk"
        return {**{k: data[k] for k in keep if k in data}, "source": rest}
    return data


class LoadReport(BaseModel):
    version: int
    loaded: list[str]
    failed: dict[str, str]  # replica -> why; these are out of the rotation
    load_s: float


class StageReport(BaseModel):
    staged: dict[str, StagedReplica]  # replicas whose next load of this source only swaps
    not_staged: dict[str, str]  # replica -> why; their load does it all, as without staging
    stage_s: float


class WeightsLayout(BaseModel):
    """How the replicas want disk snapshots written (`GET /admin/weights/layout`)."""

    # Replica parameter -> the checkpoint tensors it joins, to be stored joined and transposed
    # ([in, out]); empty: HF layout throughout.
    transposed: dict[str, list[str]]
    # Why some layers or all stay in HF layout: replica -> reason (no direct load, not
    # reachable, a layout unlike the others'). The layout is what every replica asked for.
    hf_because: dict[str, str]


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)


class AddReplica(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1, max_length=2048)
    version: int | None = Field(
        default=None, description="The weights it holds; unset: the version being served."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        """An http(s) URL both of the gateway's HTTP clients can address (httpx for admin
        calls and health checks, replicas/http1.py for generation). One they cannot
        (`http://[::1`, a bad port, a space) failed every call routed to it with a 500 and
        ended the replicas' health checks for good (found by fuzzing, issue 18)."""
        if not value.isascii() or any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError("a replica's URL is printable ASCII without spaces")
        # The gateway appends its routes to the URL as given: the joined form must parse too.
        for url in (value, value.rstrip("/") + "/health"):
            try:
                parsed = httpx.URL(url)
                split = urlsplit(url)
                split.port  # noqa: B018  # parsed on access: a bad port raises ValueError
            except (httpx.InvalidURL, ValueError) as exc:
                raise ValueError(f"not a URL: {exc}") from None
            if parsed.scheme not in ("http", "https") or not parsed.host or not split.hostname:
                raise ValueError("a replica's URL is http(s)://host[:port][/path]")
        return value


class ReplicaStatus(BaseModel):
    url: str
    healthy: bool
    in_flight: int
    failures: int
    version: int
    stale: bool = False
    # Adapter mode: the adapter this gateway's calls use on it (`<name>@v<version>`; None at
    # version 0, the base model).
    adapter: str | None = None


class GatewayStatus(BaseModel):
    state: Literal["serving", "pausing", "paused", "resuming"]
    version: int
    in_flight: int  # upstream generation requests
    waiting: int  # calls waiting for the gateway to serve again
    interruptions: int  # segments cut by weight syncs since start
    tokens_kept: int
    replicas: list[ReplicaStatus]


# Client-driven rollouts (api/enrolment.py): clients enrol sessions with the run's enrolment key,
# the coordinator opens the enrolment, admits groups under the staleness bound and collects the
# complete groups.


class OpenEnrolment(BaseModel):
    """`PUT /admin/enrolment`: open client-driven rollouts (again: counts start over)."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(
        min_length=16, max_length=256, description="The enrolment key; only its digest is kept."
    )
    group_size: int = Field(ge=1, description="Sessions per GRPO group.")
    groups_admitted: int = Field(
        ge=0, description="New groups may start while fewer than this many have started."
    )
    retry_after_s: float = Field(
        default=2.0, gt=0, le=3600, description="The Retry-After of a refused new group."
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="A group still incomplete this long after its first session is closed, its "
        "open sessions failed; None: no limit.",
    )


class AdmitGroups(BaseModel):
    """`POST /admin/enrolment/admitted`: the coordinator's new bound (it never lowers it)."""

    model_config = ConfigDict(extra="forbid")
    groups_admitted: int = Field(ge=0)


class EnrolmentGroup(BaseModel):
    task_id: str
    group_id: str
    members: int  # sessions created in it so far
    needed: int  # sessions still to create before it is full
    ended: int  # its sessions finished or failed so far


class EnrolmentInfo(BaseModel):
    """`GET /v1/enrolment`: what a client needs to know to enrol sessions."""

    model: str
    version: int  # the weight version being served
    group_size: int
    groups_admitted: int
    groups_started: int
    open_groups: list[EnrolmentGroup]  # started, not yet complete


class EnrolledSession(CreatedSession):
    """`POST /v1/sessions`: the session, and the group it joined."""

    task_id: str
    group_id: str
    members: int  # sessions in the group, this one included
    needed: int  # sessions still to create before the group is full


class CompleteGroup(BaseModel):
    seq: int  # 1, 2, ...: the order groups completed in
    task_id: str
    group_id: str
    version: int  # the weight version served when its first session was created
    sessions: list[str]


class CompleteGroups(BaseModel):
    """`GET /admin/enrolment/groups?after=SEQ`: the groups completed after `after`."""

    groups: list[CompleteGroup]
    groups_started: int
