"""A trajectory store written by the gateway's own writer (`TrajectoryStore`) with the shapes
the viewer must show: groups with rewards, weight-sync cuts inside a call, an interrupted
call, a re-render split, tool calls and tool results, open / finished / failed sessions."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockgate.gateway.schema import CallRecord, VersionSpan
from lockgate.gateway.store.trajectories import TrajectoryStore

Tokenize = Callable[[str], list[int]]
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


@dataclass
class Built:
    path: Path
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> facts

    def ids(self, **facts: Any) -> set[str]:
        return {
            sid for sid, f in self.sessions.items() if all(f.get(k) == v for k, v in facts.items())
        }


def call(
    sid: str,
    index: int,
    prompt: list[int],
    completion: list[int],
    spans: list[tuple[int, int, int]],
    *,
    messages: list[dict[str, Any]],
    interruptions: int = 0,
    finish: str = "stop",
    extends: bool = False,
) -> CallRecord:
    return CallRecord(
        session_id=sid,
        index=index,
        request={"model": "m", "messages": messages, "tools": TOOLS},
        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 64},
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.05 - 0.37 * ((index * 7 + i) % 9) for i in range(len(completion))],
        versions=[VersionSpan(version=v, start=a, end=b) for v, a, b in spans],
        finish_reason=finish,
        replica="http://replica-0",
        started_at=1000.0 + index,
        ended_at=1000.5 + index,
        interruptions=interruptions,
        extends_previous=extends,
    )


TEXTS = {
    "prompt": "<|im_start|>user\nWhat is 17 * 3? Use the tool.<|im_end|>\n<|im_start|>assistant\n",
    "tool_call": '<tool_call>\n{"name": "search", "arguments": {"q": "17*3"}}\n</tool_call><|im_end|>',
    "tool_result": "\n<|im_start|>user\n<tool_response>\n51\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "answer": "17 * 3 = 51, so the answer is 51.<|im_end|>",
    "edited": "<|im_start|>user\nWhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n",
}


def _tokens(tokenize: Tokenize | None, base: int) -> dict[str, list[int]]:
    if tokenize is not None:
        return {k: tokenize(v) for k, v in TEXTS.items()}
    return {
        "prompt": list(range(base, base + 12)),
        "tool_call": [base + 300 + i for i in range(6)],
        "tool_result": [base + 200, base + 201, base + 202],
        "answer": [base + 400 + i for i in range(10)],
        "edited": [base, base + 1],
    }


async def _write(
    store: TrajectoryStore, built: Built, seed: int, tokenize: Tokenize | None
) -> None:
    t = _tokens(tokenize, 100 + seed)
    user = {"role": "user", "content": "What is 17 * 3? Use the tool."}
    plan = [
        # (task, group, reward, status, kind)
        ("arith-1", "g-arith-1", 1.0, "finished", "cut"),
        ("arith-1", "g-arith-1", 0.0, "finished", "plain"),
        ("arith-1", "g-arith-1", 0.5, "finished", "cut"),
        ("arith-1", "g-arith-1", 1.0, "finished", "plain"),
        ("search-2", "g-search-2", 0.25, "finished", "split"),
        ("search-2", "g-search-2", None, "failed", "interrupted"),
        ("search-2", "g-search-2", None, "open", "plain"),
    ]
    for n, (task, group_name, reward, status, kind) in enumerate(plan):
        group = f"{group_name}-{seed}"
        sid = f"s{seed:02d}{n:02d}" + "0" * 28
        await store.create_session(sid, f"key-{sid}", task, group, {"n": n, "kind": kind})
        p0, c0 = t["prompt"], t["tool_call"]
        await store.add_call(call(sid, 0, p0, c0, [(0, 0, len(c0))], messages=[user]))
        reply = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "17*3"}'},
                }
            ],
        }
        result = {"role": "tool", "tool_call_id": "call_1", "content": "51"}
        msgs = [user, reply, result]
        p1, c1 = p0 + c0 + t["tool_result"], t["answer"]
        versions: list[int]
        if kind == "cut":
            # A weight sync cut the call after 4 tokens; it resumed under version 1.
            await store.add_call(
                call(
                    sid,
                    1,
                    p1,
                    c1,
                    [(0, 0, 4), (1, 4, len(c1))],
                    messages=msgs,
                    interruptions=1,
                    extends=True,
                )
            )
            versions = [0, 1]
        elif kind == "split":
            # The agent edited its history: the prompt does not extend the previous tokens.
            edited = t["edited"] + t["tool_result"]
            await store.add_call(call(sid, 1, edited, c1, [(1, 0, len(c1))], messages=msgs))
            versions = [0, 1]
        elif kind == "interrupted":
            await store.add_call(
                call(
                    sid,
                    1,
                    p1,
                    c1[:3],
                    [(0, 0, 3)],
                    messages=msgs,
                    interruptions=1,
                    finish="interrupted",
                    extends=True,
                )
            )
            versions = [0]
        else:
            await store.add_call(
                call(sid, 1, p1, c1, [(0, 0, len(c1))], messages=msgs, extends=True)
            )
            versions = [0]
        if status != "open":
            await store.finish_session(
                sid, status, reward, "tool crashed" if status == "failed" else None
            )
        built.sessions[sid] = {
            "task": task,
            "group": group,
            "reward": reward,
            "status": status,
            "kind": kind,
            "versions": versions,
            "interrupted": kind in ("cut", "interrupted"),
            "split": kind == "split",
        }


def build_store(path: Path, groups: int = 1, tokenize: Tokenize | None = None) -> Built:
    """Write `groups` copies of the plan above (7 sessions each) with the gateway's writer;
    with `tokenize`, the tokens are those of TEXTS (else made-up ids)."""

    async def main() -> Built:
        store = TrajectoryStore(path)
        built = Built(path)
        try:
            for seed in range(groups):
                await _write(store, built, seed, tokenize)
            await store.flush()
        finally:
            store.close()
        return built

    # On a thread of its own: callers may be inside a running event loop (async tests).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(main())).result()
