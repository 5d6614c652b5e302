"""The chat formats whose forced tool calls are constrained, and what each writes around a call.

A format is here only where a structural tag writes the call as the format's `renderers`
renderer writes it, token for token: a call written to another spelling would be one the model
never learnt, or one the parser does not see (where the two disagree, as GLM-4.5's do on an
untyped enum, the tag writes what the parser reads). The tag is xgrammar's own where it has one
that does; where it has none, lockgate builds one from xgrammar's structural-tag parts
(forced_tags.py). A format not here answers a forced call with a 400 naming it.

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
# call (DeepSeek-R1 prefills `<think>\n`; gpt-oss's prompt opens an analysis message), `always`
# a whole block written before every call, empty when the model does not think (GLM-4.5),
# `none` no reasoning (Llama 3).
Reasoning = Literal["optional", "prompt_opened", "always", "none"]
# Both write their block's markers before every call, thinking or not.
WRITTEN_EVERY_CALL: Final = ("prompt_opened", "always")


@dataclass(frozen=True)
class ForcedFormat:
    # xgrammar's model key for the same tool-call syntax (`lockgate_*`: forced_tags.py's)
    xgrammar: str
    reasoning: Reasoning
    # The tokens of the think block's own text the model writes: Qwen3's <think>, </think> and
    # the blank line after it (a newline a token at most); DeepSeek-R1's </think> alone;
    # gpt-oss's <|end|> closing the analysis message; GLM-4.5's <think>, </think> and the
    # newlines either side.
    think_tokens: int
    # A forced call is one call: the format's template writes one per assistant turn (Llama 3),
    # a call ends the turn (gpt-oss), or each call's id carries its own index (Kimi-K2).
    one_call: bool
    # The call's id holds its index among the conversation's calls, which the gateway fixes
    # (forced_tags.with_call_index): Kimi-K2's `functions.NAME:INDEX`.
    indexed: bool = False
    # Stop tokens other than the one a call ends on. A stop token ends the grammar wherever the
    # grammar may end, whichever it is, so a format whose call ends on a stop token of its own
    # (gpt-oss's <|call|>) has its other stops kept out of a forced call's answer
    # (`logit_bias`); the model's end-of-text tokens are among them.
    other_stops: tuple[str, ...] = ()
    # How the arguments are written: JSON, or GLM-4.5's <arg_key>/<arg_value> pairs
    # (forced_tags.glm_xml_as_tokens).
    arguments: Literal["json", "glm_xml"] = "json"

    def xgrammar_reasoning(self, asked: Literal["auto", "disabled"]) -> str:
        """xgrammar's reasoning mode for the gateway's `auto` or `disabled`: a block the prompt
        opened is always continued and closed (the parser reads all before </think> as
        reasoning), a format without reasoning has none."""
        if self.reasoning in WRITTEN_EVERY_CALL:
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
        """Think-block tokens written before every call (the close of a prompt-opened block, a
        block always written)."""
        return self.think_tokens if self.reasoning in WRITTEN_EVERY_CALL else 0

    def bounded(self, budget: ForcedBudget) -> ForcedBudget:
        """A budget without thinking still bounds a block written before every call: to
        nothing but its markers, so the call comes first."""
        if budget.think_tokens is None and self.reasoning in WRITTEN_EVERY_CALL:
            return replace(budget, think_tokens=0)
        return budget


FORCED_FORMATS: Final[dict[str, ForcedFormat]] = {
    "qwen3": ForcedFormat("qwen_3", "optional", 4, one_call=False),
    "llama-3": ForcedFormat("llama", "none", 0, one_call=True),
    "deepseek-r1": ForcedFormat("deepseek_r1", "prompt_opened", 1, one_call=False),
    "gpt-oss": ForcedFormat(
        "lockgate_harmony",
        "prompt_opened",
        1,
        one_call=True,
        other_stops=("<|return|>", "<|endoftext|>"),
    ),
    "kimi-k2": ForcedFormat("kimi", "none", 0, one_call=True, indexed=True),
    "glm-4.5": ForcedFormat("lockgate_glm45", "always", 4, one_call=False, arguments="glm_xml"),
}
