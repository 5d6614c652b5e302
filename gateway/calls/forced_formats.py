"""The chat formats whose forced tool calls are constrained, and what each writes around a call.

A format is here only where xgrammar has a structural tag whose syntax is the one the format's
`renderers` parser reads, token for token: a call written to another spelling would be one the
model never learnt, or one the parser does not see. GLM-4.5 is not: it writes a newline between
its think block and the call, and writes the (empty) block even with thinking off, and
xgrammar's `glm_4_7` tag admits neither. A format not here answers a forced call with a 400
naming it.

The forced-call budget (forced_budget.py) reserves the fixed text a call is written with; the
call's own opening and closing text comes from the tag, and what a format writes around its
calls is here: the think block's markers, and whether a turn holds more than one call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, Literal

from lockgate.gateway.calls.forced_budget import ForcedBudget

# How the format reasons before a call: `optional` a whole <think> block the model may write
# (Qwen3), `prompt_opened` a block the prompt has opened and the model must close before the
# call (DeepSeek-R1 prefills `<think>\n`), `none` no reasoning (Llama 3).
Reasoning = Literal["optional", "prompt_opened", "none"]


@dataclass(frozen=True)
class ForcedFormat:
    xgrammar: str  # xgrammar's model key for the same tool-call syntax
    reasoning: Reasoning
    # The tokens of the think block's own text the model writes: Qwen3's <think>, </think> and
    # the blank line after it (a newline a token at most); DeepSeek-R1's </think> alone.
    think_tokens: int
    one_call_per_turn: bool  # the format's template writes one call per assistant turn

    def xgrammar_reasoning(self, asked: Literal["auto", "disabled"]) -> str:
        """xgrammar's reasoning mode for the gateway's `auto` or `disabled`: a block the prompt
        opened is always continued and closed (the parser reads all before </think> as
        reasoning), a format without reasoning has none."""
        if self.reasoning == "prompt_opened":
            return "enabled"
        return "disabled" if self.reasoning == "none" else asked

    def may_think(self, asked: Literal["auto", "disabled"]) -> bool:
        return asked == "auto" and self.reasoning != "none"

    @property
    def think_overhead(self) -> int:
        """Think-block tokens written only when the model thinks."""
        return self.think_tokens if self.reasoning == "optional" else 0

    @property
    def fixed(self) -> int:
        """Think-block tokens written before every call (the close of a prompt-opened block)."""
        return self.think_tokens if self.reasoning == "prompt_opened" else 0

    def bounded(self, budget: ForcedBudget) -> ForcedBudget:
        """A budget without thinking still bounds a prompt-opened block: to nothing but its
        close, so the call comes first."""
        if budget.think_tokens is None and self.reasoning == "prompt_opened":
            return replace(budget, think_tokens=0)
        return budget


FORCED_FORMATS: Final[dict[str, ForcedFormat]] = {
    "qwen3": ForcedFormat("qwen_3", "optional", 4, one_call_per_turn=False),
    "llama-3": ForcedFormat("llama", "none", 0, one_call_per_turn=True),
    "deepseek-r1": ForcedFormat("deepseek_r1", "prompt_opened", 1, one_call_per_turn=False),
}
