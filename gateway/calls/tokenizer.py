"""The model's tokenizer as `renderers` uses it, called in Rust without transformers' layers.

`renderers` takes any object with its `Tokenizer` surface (encode, decode, convert_tokens_to_ids
and three attributes) and says so for exactly this case: a thin adapter over
`tokenizers.Tokenizer`. Handing it the transformers tokenizer instead costs most of a call's
rendering time: every `encode` goes through transformers' batching, padding and truncation
set-up (about 35 us against 10 us for the Rust call it ends in), and because a transformers
tokenizer is callable, `renderers` also asks it for character offsets on every render (to mark
which prompt tokens are message content, which the gateway never reads). This adapter has no
`__call__`, so `renderers` skips that work and leaves the content mask empty, and the token ids
are the same: transformers' fast tokenizers encode and decode with this very Rust tokenizer.

Where transformers would do more than call the Rust tokenizer (a slow Python tokenizer, clean-up
of decoded spaces, special tokens split as text) `fast_tokenizer` returns the transformers one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from transformers import PreTrainedTokenizerBase

# Short texts are the chat format's own pieces ("\n", "assistant\n", "<|im_start|>assistant\n"),
# encoded on every render and parse: they are remembered. Message bodies mostly are not, and the
# number remembered is bounded so an agent's texts cannot grow the gateway's memory.
_CACHED_TEXT_CHARS = 32
_CACHE_ENTRIES = 4096
# Longer texts are encoded through `encode_batch`, which gives the same ids but releases the
# GIL while Rust works (`encode` holds it, and a long text holds every other thread, the event
# loop included). So a render in a worker thread (pipeline.py) leaves the loop running. It
# costs nothing more (measured in docs/performance.md).
_GIL_FREE_CHARS = 1024


class FastTokenizer:
    """Encode / decode with the Rust tokenizer, as transformers' fast tokenizer would."""

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        # A copy of transformers' backend: transformers re-configures its own (truncation,
        # padding) on each call, and this one must never pad or cut.
        self._rust = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
        self._rust.no_truncation()
        self._rust.no_padding()
        self._rust.encode_special_tokens = False
        self._hf = hf
        self.name_or_path: str = hf.name_or_path
        self.unk_token_id: int | None = hf.unk_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        self._encoded: dict[str, list[int]] = {}
        self._token_ids: dict[str, Any] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            return self._rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens or len(text) > _CACHED_TEXT_CHARS:
            return self._rust.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._rust.encode(text, add_special_tokens=False).ids
            if len(self._encoded) < _CACHE_ENTRIES:
                self._encoded[text] = ids
        return list(ids)  # a copy: callers may extend what they are given

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        # transformers' own answer (its unknown-token rules included), remembered per token.
        if not isinstance(tokens, str):
            return [self.convert_tokens_to_ids(t) for t in tokens]
        if tokens not in self._token_ids:
            self._token_ids[tokens] = self._hf.convert_tokens_to_ids(tokens)
        return self._token_ids[tokens]

    def __len__(self) -> int:
        return len(self._hf)


def fast_tokenizer(hf: PreTrainedTokenizerBase) -> FastTokenizer | PreTrainedTokenizerBase:
    """The adapter where it gives exactly transformers' ids and text, else `hf` itself."""
    exact = (
        getattr(hf, "backend_tokenizer", None) is not None
        and not getattr(hf, "clean_up_tokenization_spaces", False)
        and not getattr(hf, "split_special_tokens", False)
    )
    return FastTokenizer(hf) if exact else hf
