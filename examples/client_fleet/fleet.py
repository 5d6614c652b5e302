"""A fleet of agents that drives a client-driven run (`loop.rollouts: client`) from outside.

The run starts no agent. This program, a separate process that could run on any host, reads
the run's enrolment file (the gateway's URL, the enrolment key, the group size), and keeps
`--groups-at-once` GRPO groups going: for a task it creates `group_size` sessions in one group
with the enrolment key, runs one agent per session with the plain OpenAI SDK against the
session's own base URL and key, scores the answer itself (the share of its characters that are
digits, as examples/toy rewards numbers) and finishes the session with that reward. The run
trains on each group once all its sessions have finished.

When the run's policy is as far ahead as its staleness bound allows, a new group is refused
with a 429 and `Retry-After`: the fleet waits that long and asks again. It stops when the
run's gateway goes away (the run ended) or after `--groups` groups, and prints one summary line
as JSON.

    python examples/client_fleet/fleet.py RUN_DIR [--groups-at-once 3] [--groups N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import APIConnectionError, AsyncOpenAI

WORDS = "apple river stone cloud seven green table light music paper storm quiet".split()


class RunEnded(Exception):
    """The run's gateway is gone: the run finished (or stopped)."""


@dataclass
class Tally:
    groups: int = 0
    sessions: int = 0
    failed: int = 0
    refused: int = 0  # new groups refused by the staleness bound (429)
    retry_after_s: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def line(self) -> str:
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else None
        return json.dumps(
            {
                "groups": self.groups,
                "sessions": self.sessions,
                "failed": self.failed,
                "refused_429": self.refused,
                "retry_after_s": sorted(set(self.retry_after_s)),
                "mean_reward": mean,
            }
        )


def read_enrolment(run_dir: Path, wait_s: float) -> dict[str, Any]:
    """The run writes its enrolment file once its gateway and trainer are up."""
    path = run_dir / "enrolment.json"
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} after {wait_s:g} s: is a client-driven run starting?")
        time.sleep(0.5)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def digit_share(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


class Fleet:
    def __init__(self, enrolment: dict[str, Any], max_tokens: int) -> None:
        self.url = enrolment["url"]
        self.group_size = int(enrolment["group_size"])
        self.max_tokens = max_tokens
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {enrolment['key']}"},
            timeout=httpx.Timeout(60.0, connect=5.0),
        )
        self.tally = Tally()
        self.model = "lockgate"

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise RunEnded(str(exc)) from exc

    async def start(self, timeout_s: float) -> None:
        """Wait for the run to open its enrolment (a 503 until then) and learn the model."""
        deadline = time.monotonic() + timeout_s
        while (r := await self.request("GET", "/v1/enrolment")).status_code == 503:
            if time.monotonic() > deadline:
                raise SystemExit("the run did not open its enrolment")
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        r.raise_for_status()
        info = r.json()
        self.model, self.group_size = info["model"], info["group_size"]

    async def enrol(self, task_id: str, group_id: str | None) -> dict[str, Any]:
        """A session in the group, waiting out the staleness bound's 429s."""
        body = {"task_id": task_id, "group_id": group_id}
        while (r := await self.request("POST", "/v1/sessions", json=body)).status_code == 429:
            wait = float(r.headers["retry-after"])
            self.tally.refused += 1
            self.tally.retry_after_s.append(wait)
            await asyncio.sleep(wait)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    async def rollout(self, session: dict[str, Any], prompt: str) -> None:
        """One agent: any OpenAI client, pointed at its session. It scores and ends itself."""
        base = self.url + session["base_url"]
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        try:
            async with AsyncOpenAI(base_url=base, api_key=session["api_key"]) as client:
                answer = await client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.max_tokens,
                )
            reward = digit_share(answer.choices[0].message.content or "")
            body: dict[str, Any] = {"reward": reward}
            self.tally.rewards.append(reward)
        except APIConnectionError as exc:
            raise RunEnded(str(exc)) from exc
        except Exception as exc:  # an agent's failure fails its session, not the fleet
            body = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            self.tally.failed += 1
        await self.request("POST", "/v1/finish", json=body, headers=headers)
        self.tally.sessions += 1

    async def group(self, task_id: str, prompt: str) -> None:
        first = await self.enrol(task_id, None)  # the gateway names the group
        rest = [await self.enrol(task_id, first["group_id"]) for _ in range(first["needed"])]
        await asyncio.gather(*(self.rollout(s, prompt) for s in [first, *rest]))
        self.tally.groups += 1

    async def worker(self, tasks: itertools.cycle[tuple[str, str]], budget: list[int]) -> None:
        while budget[0] != 0:
            budget[0] -= 1
            await self.group(*next(tasks))


def toy_tasks(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [
        (f"fleet-{i}", "Answer with numbers only: " + " ".join(rng.sample(WORDS, 3)))
        for i in range(n)
    ]


async def drive(args: argparse.Namespace) -> Tally:
    fleet = Fleet(read_enrolment(args.run_dir, args.wait_s), args.max_tokens)
    tasks = itertools.cycle(toy_tasks(args.tasks, args.seed))
    budget = [args.groups]  # shared by the workers; -1: until the run ends
    try:
        await fleet.start(args.wait_s)
        async with asyncio.TaskGroup() as tg:
            for _ in range(args.groups_at_once):
                tg.create_task(fleet.worker(tasks, budget))
    except* RunEnded:
        print("the run's gateway is gone: the run ended", file=sys.stderr)
    finally:
        await fleet.http.aclose()
    return fleet.tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's directory (its enrolment.json)")
    parser.add_argument("--groups-at-once", type=int, default=3)
    parser.add_argument("--groups", type=int, default=-1, help="stop after this many groups")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-s", type=float, default=900.0, help="for the run to start")
    args = parser.parse_args()
    print(asyncio.run(drive(args)).line(), flush=True)


if __name__ == "__main__":
    main()
