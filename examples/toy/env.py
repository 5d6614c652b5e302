"""Toy environment: learn to answer in numbers.

The agent is an ordinary OpenAI SDK client pointed at its session URL. The reward is the share of
generated tokens that are numbers (tokens whose text is digits and whitespace only). A randomly
initialised model emits such tokens at roughly their share of the vocabulary, so the reward
starts low; GRPO makes it rise within minutes on 2 CPU cores, which is what the main job shows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from lockgate.agent_runtime import Agent, RewardFn, RolloutContext, Task
from lockgate.gateway.schema import CallRecord

_WORDS = "apple river stone cloud seven green table light music paper storm quiet".split()


class NumbersEnvironment:
    def __init__(
        self,
        model_dir: Path,
        *,
        num_tasks: int = 64,
        num_val_tasks: int = 16,
        max_tokens: int = 24,
        seed: int = 0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.max_tokens = max_tokens
        rng = random.Random(seed)
        self._tasks = [
            Task(
                id=f"numbers-{i}",
                data={"prompt": "Answer with numbers only: " + " ".join(rng.sample(_WORDS, 3))},
            )
            for i in range(num_tasks)
        ]
        # Held out: an instruction worded differently from every training prompt.
        self._val_tasks = [
            Task(
                id=f"numbers-val-{i}",
                data={"prompt": "Reply in digits: " + " ".join(rng.sample(_WORDS, 3))},
            )
            for i in range(num_val_tasks)
        ]

    def train_tasks(self) -> Sequence[Task]:
        return self._tasks

    def val_tasks(self) -> Sequence[Task]:
        return self._val_tasks

    @cached_property
    def number_tokens(self) -> frozenset[int]:
        # The Rust tokenizer itself: transformers would bring torch (and triton) into the
        # coordinator's process for this alone.
        tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        ids = set()
        for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            if text.strip() and all(c.isdigit() or c.isspace() for c in text):
                ids.add(token_id)
        return frozenset(ids)

    @property
    def agent(self) -> Agent:
        max_tokens = self.max_tokens

        async def answer(task: Task, ctx: RolloutContext) -> float | None:
            # Any OpenAI client works (AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key));
            # this one shares the run's connection pool, which matters with many rollouts.
            async with ctx.openai_client(max_retries=0) as client:
                await client.chat.completions.create(
                    model=ctx.model,
                    messages=[{"role": "user", "content": task.data["prompt"]}],
                    max_tokens=max_tokens,
                )
            return None  # scored from the recorded tokens by `reward`

        return answer

    @property
    def reward(self) -> RewardFn:
        targets = self.number_tokens

        def share_of_numbers(task: Task, calls: Sequence[CallRecord]) -> float:
            tokens = [t for call in calls for t in call.completion_ids]
            return sum(t in targets for t in tokens) / max(len(tokens), 1)

        return share_of_numbers


def make_environment(model_dir: Path, **args: object) -> NumbersEnvironment:
    return NumbersEnvironment(model_dir, **args)  # type: ignore[arg-type]
