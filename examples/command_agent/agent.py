"""A command agent: one rollout per run, standard library only.

lockgate starts this program once per rollout with the session's OpenAI endpoint in its
environment (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL) and the task in LOCKGATE_TASK (and
on stdin). It asks the model once and prints its reward as the last line of stdout:
{"reward": <share of the answer's characters that are digits>}. Anything written to stderr ends
up in the run's logs/agents/ folder, and in the rollout's error when the program fails.

Any language works the same way: read the environment, call the chat route, print the reward.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def chat(prompt: str, max_tokens: int) -> str:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(
            {
                "model": os.environ.get("OPENAI_MODEL", "lockgate"),
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
            }
        ).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        # The gateway explains refusals in OpenAI's error format; pass the reason on.
        sys.exit(f"chat call failed: HTTP {exc.code}: {exc.read().decode(errors='replace')}")
    return body["choices"][0]["message"]["content"] or ""


def score(answer: str) -> float:
    chars = [c for c in answer if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def main() -> None:
    task = json.loads(os.environ["LOCKGATE_TASK"])
    answer = chat(task["prompt"], int(task.get("max_tokens", 24)))
    print(f"answer: {answer!r}", file=sys.stderr)
    print(json.dumps({"reward": score(answer)}))


if __name__ == "__main__":
    main()
