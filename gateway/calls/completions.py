"""`/v1/completions`: a raw prompt (text or token ids) continued without any chat template.

Recorded like a chat call: the prompt ids, every sampled id with its logprob and version. A
prompt that starts with the session's previous prompt + completion extends it (one training
sample); any other starts a new sample.
"""

from __future__ import annotations

from typing import Any

from lockgate.gateway.calls.bodies import parse_json, validate
from lockgate.gateway.calls.bounds import (
    check_completion_body,
    check_prompt_chars,
    check_token_budget,
)
from lockgate.gateway.calls.pipeline import Call, CallPipeline
from lockgate.gateway.calls.rendering import PreviousTurn, RenderedPrompt, token_array
from lockgate.gateway.calls.stops import as_list, cut_at_stop
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.errors import bad_request, conflict
from lockgate.gateway.schema import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from lockgate.gateway.store.trajectories import SessionRow


def read_request(body: bytes, config: GatewayConfig) -> tuple[dict[str, Any], CompletionRequest]:
    """The body as sent and validated, its bounds checked first (bounds.py)."""
    raw = parse_json(body, config.limits.max_json_values)
    check_completion_body(raw, config)
    return raw, validate(CompletionRequest, raw)


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.n != 1:
        raise bad_request("n > 1 is not supported: start one session per rollout", param="n")
    if req.stream:
        raise bad_request("stream is not supported on /v1/completions", param="stream")
    if req.echo:
        raise bad_request("echo is not supported", param="echo")


def _extends(prompt_ids: list[int], previous: PreviousTurn | None) -> bool:
    if previous is None:
        return False
    before = previous.prompt_ids + previous.completion_ids
    return len(prompt_ids) >= len(before) and prompt_ids[: len(before)] == before.tolist()


async def complete(
    pipeline: CallPipeline, session: SessionRow, raw: dict[str, Any], req: CompletionRequest
) -> dict[str, Any]:
    if session.status != "open":
        raise conflict(f"session '{session.id}' is {session.status}; it takes no more calls")
    _refuse_unsupported(req)
    check_token_budget(req, pipeline.config.max_model_len)
    tokenizer = pipeline.renderer.tokenizer
    if isinstance(req.prompt, str):
        text = req.prompt
        check_prompt_chars(len(text), pipeline.config, "prompt")
        prompt_ids = await pipeline.off_loop_if_large(
            len(text), lambda: tokenizer.encode(text, add_special_tokens=False)
        )
    else:
        vocab = len(tokenizer)
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt"
            )
        prompt_ids = list(req.prompt)
    room = pipeline.config.max_model_len - len(prompt_ids)
    if room < 1:
        raise bad_request(
            f"the prompt is {len(prompt_ids)} tokens; this model's context is "
            f"{pipeline.config.max_model_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    previous = await pipeline.last_turn_of(session.id)
    prompt = RenderedPrompt(
        token_array(prompt_ids), extends_previous=_extends(prompt_ids, previous)
    )
    sampling = pipeline.sampling_for(req, room)
    call = pipeline.new_call(session, raw, prompt, sampling, req.stop)
    await pipeline.generate(call)
    await pipeline.record(call)
    return _response(pipeline, call, req).model_dump(mode="json", exclude_none=True)


def _response(pipeline: CallPipeline, call: Call, req: CompletionRequest) -> CompletionResponse:
    s = call.generator.sampled
    tokenizer = pipeline.renderer.tokenizer
    logprobs = None
    if req.logprobs is not None:
        pieces = [pipeline.renderer.decode_token(t) for t in s.token_ids]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        top = None
        if req.logprobs > 0:
            decode = pipeline.renderer.decode_token
            top = [
                {decode(t): lp for t, lp in s.top_logprobs[i][: req.logprobs]}
                for i in range(len(s.top_logprobs))
            ]
        logprobs = CompletionLogprobs(
            tokens=pieces, token_logprobs=s.logprobs, top_logprobs=top, text_offset=offsets
        )
    finish = s.finish_reason if s.finish_reason in ("stop", "length") else "stop"
    n_prompt = len(call.prompt.prompt_ids)
    return CompletionResponse(
        id=f"cmpl-{call.session.id[:8]}-{call.index}",
        model=pipeline.config.model_name,
        choices=[
            CompletionChoice(
                text=cut_at_stop(
                    tokenizer.decode(s.token_ids, skip_special_tokens=True), as_list(req.stop)
                )[0],
                finish_reason=finish,  # type: ignore[arg-type]
                logprobs=logprobs,
            )
        ],
        usage=Usage(
            prompt_tokens=n_prompt,
            completion_tokens=len(s.token_ids),
            total_tokens=n_prompt + len(s.token_ids),
        ),
    )
