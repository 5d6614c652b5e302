"""The gateway's configuration (importing it loads no torch, vLLM or tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lockgate.gateway.records.advantages import AdvantageSpec


class SamplingPolicy(BaseModel):
    """What the run needs from sampling, whatever the agent asks for.

    `override`: the run's values replace the agent's (training on the agent's temperature 0.2
    would make the recorded logprobs describe a different policy from the one trained).
    `honor`: the agent's values are used where given. Either way the request is recorded as sent.
    """

    model_config = ConfigDict(extra="forbid")
    mode: Literal["override", "honor"] = "override"
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=512, ge=1, description="Budget when the agent sets none.")


class RequestLimits(BaseModel):
    """Bounds on what one request may make the gateway do, so that no agent's request (a
    runaway tool output pasted into a message, a hostile body) can hold the event loop that
    every other call shares. What is over a bound is refused in OpenAI's error shape."""

    model_config = ConfigDict(extra="forbid")
    max_request_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="Largest request body taken on the agent routes (and every route outside "
        "/admin): a bigger one gets a 413 `request_too_large`, before it is read when its "
        "Content-Length says so, and as soon as it passes the limit when sent chunked.",
    )
    max_admin_request_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="The same for /admin routes (a weight load's NCCL tensor list can be long).",
    )
    max_messages: int = Field(
        default=4096,
        ge=1,
        description="Most messages a chat call may carry; the text parts of their contents and "
        "their tool calls are bounded by the same number, in total (each costs validation "
        "time before any check on its size can run).",
    )
    max_tools: int = Field(default=128, ge=0, description="Most tools a chat call may offer.")
    max_json_values: int = Field(
        default=262_144,
        ge=0,
        description="Most JSON values (about: commas and opening brackets are counted, also in "
        "strings) a chat or completions body over 256 KiB may hold; more is a 413 before it is "
        "parsed, since parsing holds the event loop (~0.14 us a value). 0: no bound.",
    )
    max_prompt_chars_per_token: float = Field(
        default=16.0,
        gt=0,
        description="A prompt with more characters than max_model_len times this is refused "
        "(400 `context_length_exceeded`) before it is tokenized: real text averages 3 to 5 "
        "characters a token, so one this long cannot fit and tokenizing it would be wasted.",
    )
    max_calls_in_flight_per_session: int = Field(
        default=64,
        ge=0,
        description="Most generation calls one session may have in flight at once; one more "
        "gets a 429 `rate_limit_exceeded` (0: no bound). Keeps one runaway agent from taking "
        "every replica slot.",
    )
    max_calls_per_minute_per_session: float = Field(
        default=0.0,
        ge=0,
        description="New generation calls per session per minute, a token bucket refilled at "
        "this rate (0: no bound); over it a call gets a 429 saying when to retry.",
    )
    calls_burst_per_session: int = Field(
        default=60,
        ge=1,
        description="The bucket's size: calls a session may start at once before the per-minute "
        "rate applies.",
    )


class AdapterServing(BaseModel):
    """A run that trains a LoRA adapter on a fleet serving the base model, possibly shared with
    other runs: weight version v >= 1 is the adapter loaded on every replica under
    `<name>@v<v>` and sent as the generate request's `model`; version 0 is the base model (under
    `<name>@v0` when initial_weights gives it a zero adapter).
    A sync loads adapters and never pauses or relabels a replica's engine (docs/gateway-api.md,
    "Adapter mode")."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The run's adapter name prefix, unique among the runs sharing the replicas "
        "(their adapters live side by side in each replica).",
    )


# Where a gateway process started from a config file without `admin_token` reads it: the token
# travels through the environment so that no file of a run dir holds it.
ADMIN_TOKEN_ENV = "LOCKGATE_ADMIN_TOKEN"


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_dir: Path = Field(description="HF model dir; its tokenizer renders and parses chats.")
    model_name: str = Field(default="lockgate", description="Name reported by /v1/models.")
    renderer: str = Field(
        default="qwen3",
        description="`renderers` name of the model's chat format; a run sets it from its "
        "model.chat_format, detected from the model when auto (gateway/calls/chat_format.py).",
    )
    replicas: list[str] = Field(default_factory=list, description="vLLM replica base URLs.")
    db_path: Path = Field(description="SQLite trajectory store file.")
    metrics_path: Path | None = Field(
        default=None,
        description="The run's metrics.jsonl, which the viewer's dashboard plots; None: a "
        "gateway outside a training run, with no dashboard.",
    )
    admin_token: str = Field(min_length=8, description="Bearer token for /admin endpoints.")
    max_model_len: int = Field(default=2048, ge=16, description="Replicas' context length.")
    sampling: SamplingPolicy = Field(default_factory=SamplingPolicy)
    limits: RequestLimits = Field(
        default_factory=RequestLimits, description="Bounds on one request's size and work."
    )
    max_pause_wait_s: float = Field(
        default=1800.0,
        gt=0,
        description="A call waiting for a weight sync to end fails with a 503 after this long.",
    )
    replica_stall_s: float = Field(
        default=15.0,
        ge=0,
        description="A generation that hears nothing from its replica for this long has the "
        "replica's health checked: a replica that fails it (hung, e.g. stopped) counts as "
        "failed, leaves the rotation until its health check passes again, and the call goes "
        "on elsewhere with its tokens kept; one that answers (queued, a long prefill) is "
        "waited on. 0: never checked.",
    )
    partial_rollout: bool = Field(
        default=True,
        description="Calls cut by an `abort` sync continue under the new weights (tokens kept, "
        "versions recorded per token). Off: they fail with a 503 `interrupted` instead, so "
        "no sample ever mixes versions.",
    )
    constrained_reasoning: Literal["auto", "disabled"] = Field(
        default="auto",
        description="Calls with tool_choice 'required' or a named function are constrained to "
        "the chat format's tool-call syntax; `auto` lets the model think first, `disabled` "
        "makes the tool call the first thing it writes.",
    )
    initial_version: int = Field(default=0, ge=0)
    initial_weights: str | None = Field(
        default=None,
        description="HF snapshot the replicas serve at start (default: model_dir when "
        "initial_version is 0). A weight load that fails on every replica restores it. In "
        "adapter mode: the adapter dir of initial_version (required when it is 1 or more; at "
        "0 a zero adapter, so that every call names an adapter), loaded on every replica at "
        "start.",
    )
    adapter: AdapterServing | None = Field(
        default=None,
        description="Serve a LoRA adapter per weight version on replicas started with LoRA "
        "enabled (None: full weights, synced into the replicas themselves).",
    )
    advantages: AdvantageSpec | None = Field(
        default=None,
        description="How the run computes advantages, so the viewer shows what was trained on; "
        "None outside a training run: the viewer then shows GRPO.",
    )

    @model_validator(mode="after")
    def _adapter_to_start_from(self) -> Self:
        if self.adapter is not None and self.initial_version > 0 and not self.initial_weights:
            raise ValueError(
                f"adapter mode at initial_version {self.initial_version} needs initial_weights: "
                "the adapter dir of that version, which every replica loads at start"
            )
        return self
