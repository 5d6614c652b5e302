"""A model call's pipeline, from the agent's request to its durable record.

A chat call: the session must be open -> parse the body, check its bounds, validate it ->
refuse what is not supported -> refuse a prompt too long for the context by its characters ->
render the messages (+ tools) to prompt ids, extending the previous call's exact tokens where
the agent's history allows (a large prompt in a worker thread, so that no call holds the event
loop; bounds.py says what each bound saves) -> apply the run's sampling policy (and a tool-call
constraint) -> generate across segments on the replicas -> parse the sampled ids into the
answer's message -> record the call durably. What goes back to the agent (JSON or an SSE
stream) is the API's business (api/chat.py); `/v1/completions` goes through the same steps
without the chat template (completions.py).

The pipeline also keeps, per open session, the index of its next call and the latest recorded
call (what the renderer's bridge continues from).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from lockgate.gateway.calls.bodies import parse_json, validate
from lockgate.gateway.calls.bounds import (
    OFF_LOOP_CHARS,
    chat_prompt_chars,
    check_chat_body,
    check_chat_request,
    check_prompt_chars,
)
from lockgate.gateway.calls.constraints import tool_call_constraint
from lockgate.gateway.calls.rendering import (
    ChatRenderer,
    ParsedCompletion,
    PreviousTurn,
    RenderedPrompt,
    token_array,
)
from lockgate.gateway.calls.stops import StopScanner, as_list, cut_at_stop
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.errors import GatewayError, bad_request, conflict
from lockgate.gateway.metrics import GatewayMetrics
from lockgate.gateway.replicas.adapters import AdapterSet
from lockgate.gateway.replicas.generation import CallGenerator
from lockgate.gateway.replicas.pause import PauseGate
from lockgate.gateway.replicas.pool import ReplicaPool
from lockgate.gateway.schema import CallRecord, ChatCompletionRequest, CompletionRequest
from lockgate.gateway.store.trajectories import SessionRow, TrajectoryStore

T = TypeVar("T")

# Renders of large prompts at once: more would only contend for the GIL with the event loop
# (tokenizing releases it, the renderer's Python does not); the rest wait their turn.
_RENDER_THREADS = 2


@dataclass
class Call:
    """A call being generated: what its record is made of."""

    session: SessionRow
    raw: dict[str, Any]
    prompt: RenderedPrompt
    index: int
    sampling: dict[str, Any]
    generator: CallGenerator
    started_at: float


@dataclass
class ChatCall(Call):
    """A chat call: with its validated request."""

    req: ChatCompletionRequest


class CallPipeline:
    """Prepares, generates and records calls; one per gateway."""

    def __init__(
        self,
        config: GatewayConfig,
        store: TrajectoryStore,
        renderer: ChatRenderer,
        gate: PauseGate,
        pool: ReplicaPool,
        metrics: GatewayMetrics,
        adapters: AdapterSet | None = None,
    ) -> None:
        self.config = config
        self.adapters = adapters  # adapter mode (replicas/adapters.py); None: full weights
        self.store = store
        self.renderer = renderer
        self.gate = gate
        self.pool = pool
        self.metrics = metrics
        self._next_index: dict[str, int] = {}
        # The latest recorded call of each open session, as the renderer's bridge needs it:
        # read from the store only on a session's first call since start, dropped when the
        # session finishes (so memory is bounded by open sessions, not by calls).
        self._last_turn: dict[str, tuple[int, PreviousTurn]] = {}
        self._renders = ThreadPoolExecutor(_RENDER_THREADS, thread_name_prefix="lockgate-render")

    def close(self) -> None:
        """Stop the render threads (a render running finishes; none waiting starts)."""
        self._renders.shutdown(wait=False, cancel_futures=True)

    async def off_loop_if_large(self, chars: int, fn: Callable[[], T]) -> T:
        """`fn()`, in a render thread if its input has more than `OFF_LOOP_CHARS` characters:
        tokenizing costs about a microsecond a character (half a second for 500 kB), and the
        event loop serves every other call meanwhile. Small ones stay here (a thread hop costs
        more than they do)."""
        if chars <= OFF_LOOP_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._renders, fn)

    def begin_session(self, session_id: str) -> None:
        """A session just created: its first call is call 0."""
        self._next_index[session_id] = 0

    def end_session(self, session_id: str) -> None:
        """A session finished: its last turn is no longer needed."""
        self._last_turn.pop(session_id, None)

    async def prepare_chat(self, session: SessionRow, body: bytes) -> ChatCall:
        if session.status != "open":
            raise conflict(f"session '{session.id}' is {session.status}; it takes no more calls")
        raw = parse_json(body, self.config.limits.max_json_values)
        return await self.prepare_chat_raw(session, raw)

    async def prepare_chat_raw(self, session: SessionRow, raw: dict[str, Any]) -> ChatCall:
        """A chat call from its parsed body. The other front ends (Responses, Messages)
        translate their bodies into a chat-completions body and enter here, so that every
        API shares one pipeline and its records bridge across turns alike."""
        req, prompt = await self.render_chat_raw(session, raw)
        room = self.config.max_model_len - len(prompt.prompt_ids)
        if room < 1:
            raise bad_request(
                f"the prompt is {len(prompt.prompt_ids)} tokens; this model's context is "
                f"{self.config.max_model_len} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        sampling = self.sampling_for(req, room)
        constraint = tool_call_constraint(
            self.config.renderer,
            req.tools,
            req.tool_choice,
            reasoning=self.config.constrained_reasoning,
            parallel_tool_calls=req.parallel_tool_calls,
            special_tokens=self.renderer.special_tokens,
            max_tokens=sampling["max_tokens"],
            encode=self._encode_text,
            earlier_calls=sum(len(m.tool_calls or ()) for m in req.messages),
        )
        if constraint is not None:
            sampling.update(constraint)
        call = self.new_call(session, raw, prompt, sampling, req.stop)
        return ChatCall(**call.__dict__, req=req)

    async def render_chat_raw(
        self, session: SessionRow, raw: dict[str, Any]
    ) -> tuple[ChatCompletionRequest, RenderedPrompt]:
        """A chat body checked, validated and rendered to its prompt (bridging the previous
        call's exact tokens where it can), with no call made yet: how a call starts, and what
        a token count (the Messages API's count_tokens) measures."""
        if session.status != "open":
            raise conflict(f"session '{session.id}' is {session.status}; it takes no more calls")
        check_chat_body(raw, self.config.limits)
        req = validate(ChatCompletionRequest, raw)
        _refuse_unsupported(req)
        check_chat_request(req, self.config.max_model_len)
        chars = chat_prompt_chars(req, raw)
        check_prompt_chars(chars, self.config, "messages")

        previous = await self.last_turn_of(session.id)
        prompt = await self.off_loop_if_large(
            chars, functools.partial(self.renderer.render_prompt, req.messages, req.tools, previous)
        )
        return req, prompt

    def new_call(
        self,
        session: SessionRow,
        raw: dict[str, Any],
        prompt: RenderedPrompt,
        sampling: dict[str, Any],
        stop: str | list[str] | None = None,
    ) -> Call:
        """Reserve the call's index in its session and make its generator (after
        `last_turn_of`, which learns the session's next index)."""
        # Reserved now, so that two concurrent calls of one session never share an index.
        index = self._next_index[session.id]
        self._next_index[session.id] = index + 1
        generator = CallGenerator(
            self.gate,
            self.pool,
            session_id=session.id,
            prompt_ids=prompt.prompt_ids,
            sampling=sampling,
            partial_rollout=self.config.partial_rollout,
            stall_s=self.config.replica_stall_s,
            adapters=self.adapters,
            stop=StopScanner(as_list(stop), self._decode, self.renderer.silent_token_ids)
            if stop
            else None,
        )
        return Call(session, raw, prompt, index, sampling, generator, time.time())

    def _decode(self, ids: list[int]) -> str:
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode_text(self, text: str) -> list[int]:
        return self.renderer.tokenizer.encode(text, add_special_tokens=False)

    def sampling_for(
        self, req: ChatCompletionRequest | CompletionRequest, room: int
    ) -> dict[str, Any]:
        """The sampling parameters the replicas use: the run's policy applied to the request."""
        policy = self.config.sampling
        honor = policy.mode == "honor"
        temperature = (
            req.temperature if honor and req.temperature is not None else policy.temperature
        )
        top_p = req.top_p if honor and req.top_p is not None else policy.top_p
        sampling: dict[str, Any] = {
            "max_tokens": min(req.token_budget() or policy.max_tokens, room),
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": self.renderer.stop_token_ids,
            # The gateway decodes (and scans stop strings) itself: vLLM's incremental
            # detokenizer would run per token in the replica's API server for nothing.
            "detokenize": False,
        }
        if req.seed is not None:
            sampling["seed"] = req.seed
        top_k = req.logprobs if isinstance(req, CompletionRequest) else req.top_logprobs
        if req.logprobs and top_k:
            sampling["logprobs"] = top_k
        return sampling

    async def last_turn_of(self, session_id: str) -> PreviousTurn | None:
        if session_id not in self._next_index:
            # First call of this session since the gateway started: the store knows the rest.
            last = await self.store.last_call(session_id)
            if session_id not in self._next_index:  # a concurrent first call may have been first
                self._next_index[session_id] = last.index + 1 if last else 0
                if last is not None:
                    self._last_turn[session_id] = (last.index, _previous_turn(last))
        entry = self._last_turn.get(session_id)
        return entry[1] if entry else None

    async def generate(self, call: Call) -> None:
        """Generate a call to its finish; one that fails keeps its tokens on record."""
        try:
            async with contextlib.aclosing(call.generator.run()) as chunks:
                async for _ in chunks:
                    pass
        except GatewayError:
            await self.record_unfinished(call)
            raise

    def parse(self, call: ChatCall, parsed: ParsedCompletion | None = None) -> ParsedCompletion:
        """The answer in the sampled tokens (`parsed` if already parsed); text from a stop
        string on is not part of it."""
        if parsed is None:
            parsed = self.renderer.parse_completion(
                call.generator.sampled.token_ids, call.prompt.prompt_ids, call.req.tools
            )
        stops = as_list(call.req.stop)
        if not stops or call.generator.sampled.finish_reason != "stop":
            return parsed
        m = parsed.message
        reasoning, in_reasoning = cut_at_stop(m.reasoning_content or "", stops)
        content = "" if in_reasoning else cut_at_stop(m.content or "", stops)[0]
        message = m.model_copy(update={"reasoning_content": reasoning or None, "content": content})
        return ParsedCompletion(message=message, has_tool_calls=parsed.has_tool_calls)

    async def record(self, call: Call) -> None:
        finish = call.generator.sampled.finish_reason
        assert finish is not None
        await self._add_record(call, finish)

    async def record_unfinished(self, call: Call) -> None:
        """A call that failed after generating something: its tokens are kept, marked
        `interrupted` (never trained on: the agent did not receive them)."""
        if call.generator.sampled.token_ids:
            await self._add_record(call, "interrupted")

    async def _add_record(self, call: Call, finish_reason: str) -> None:
        """Write the call's record durably, then make it the session's last turn."""
        record = self._record_of(call, finish_reason)
        await self.store.add_call(record)
        s = call.generator.sampled
        self.metrics.call(
            prompt_tokens=len(record.prompt_ids),
            completion_tokens=len(record.completion_ids),
            finish_reason=finish_reason,
            rerender_split=call.index > 0 and not record.extends_previous,
            interruptions=s.interruptions,
            failovers=s.failovers,
        )
        last = self._last_turn.get(call.session.id)
        if call.session.status == "open" and (last is None or last[0] < call.index):
            turn = (
                _turn(call.req, record.prompt_ids, record.completion_ids)
                if isinstance(call, ChatCall)
                else _raw_turn(record)
            )
            self._last_turn[call.session.id] = (call.index, turn)

    def _record_of(self, call: Call, finish_reason: str) -> CallRecord:
        s = call.generator.sampled
        return CallRecord(
            session_id=call.session.id,
            index=call.index,
            request=call.raw,
            sampling=call.sampling,
            prompt_ids=call.prompt.prompt_ids.tolist(),
            completion_ids=s.token_ids,
            logprobs=s.logprobs,
            versions=s.spans(),
            finish_reason=finish_reason,
            replica=",".join(s.replicas),
            started_at=call.started_at,
            ended_at=time.time(),
            interruptions=s.interruptions,
            extends_previous=call.prompt.extends_previous,
        )


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.n != 1:
        raise bad_request("n > 1 is not supported: start one session per rollout", param="n")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")


def _previous_turn(call: CallRecord) -> PreviousTurn:
    if "messages" not in call.request:
        return _raw_turn(call)
    req = ChatCompletionRequest.model_validate(call.request)
    return _turn(req, call.prompt_ids, call.completion_ids)


def _raw_turn(call: CallRecord) -> PreviousTurn:
    """A /v1/completions call: its tokens, but no chat a later chat call could continue."""
    return PreviousTurn(
        messages=None,
        tools=None,
        prompt_ids=token_array(call.prompt_ids),
        completion_ids=token_array(call.completion_ids),
    )


def _turn(
    req: ChatCompletionRequest, prompt_ids: list[int], completion_ids: list[int]
) -> PreviousTurn:
    return PreviousTurn(
        messages=[m.model_dump(exclude_none=True) for m in req.messages],
        tools=None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools],
        prompt_ids=token_array(prompt_ids),
        completion_ids=token_array(completion_ids),
    )
