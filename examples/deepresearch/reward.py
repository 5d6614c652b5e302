"""The reward: token F1 against the gold answers with SQuAD-style normalisation, plus EM.

F1 is the training reward (the best over the gold answers); exact match is logged beside it.
An optional small format term rewards an episode that ends in the required answer form even
when the answer is wrong, and is off by default. So does an optional evidence term: an
episode whose tool results showed a gold answer (`shows_answer`) earns it whatever it
answered. On 2-hop questions it tells a second search that found the answer's page from an
early wrong answer, which F1 alone scores the same (zero). RL without it taught the small model
to answer after one search; with it (0.2-0.3) that went more slowly, but still went (EXPERIMENTS.md).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: Sequence[str]) -> float:
    norm = normalize_answer(prediction)
    return float(any(norm == normalize_answer(g) for g in gold))


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    # Yes/no and other one-word answers must match exactly: "yes" shares no partial credit
    # with "no", and SQuAD's official script treats them the same way.
    if pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer"):
        return float(pred == ref)
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: Sequence[str]) -> float:
    return max((_f1(prediction, g) for g in gold), default=0.0)


def extract_answer(content: str | None) -> str | None:
    """The final answer in the fixed form `<answer>...</answer>` (the last one), else None."""
    if not content:
        return None
    found = _ANSWER.findall(content)
    return found[-1].strip() if found else None


class Score(BaseModel):
    reward: float
    f1: float
    em: float
    answered: bool


def shows_answer(text: str, gold: Sequence[str]) -> bool:
    """Whether `text` holds one of the gold answers as whole words, after normalisation."""
    padded = f" {normalize_answer(text)} "
    return any(norm and f" {norm} " in padded for norm in map(normalize_answer, gold))


def score(
    answer: str | None,
    gold: Sequence[str],
    *,
    format_weight: float = 0.0,
    evidence_weight: float = 0.0,
    evidence: bool = False,
) -> Score:
    """The episode's reward in [0, 1]: F1, or with a format weight wf and an evidence weight we,
    (1 - wf - we) F1 + wf answered + we evidence (evidence: a tool result showed a gold answer).
    An episode without an answer earns only its evidence term."""
    if format_weight + evidence_weight > 1:
        raise ValueError("the format and evidence weights add up to more than 1")
    seen = evidence_weight * float(evidence)
    if answer is None:
        return Score(reward=seen, f1=0.0, em=0.0, answered=False)
    f1, em = f1_score(answer, gold), exact_match(answer, gold)
    reward = (1 - format_weight - evidence_weight) * f1 + format_weight + seen
    return Score(reward=reward, f1=f1, em=em, answered=True)
