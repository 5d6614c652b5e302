"""The text of each token id, for the session view: the model's `tokenizer.json`, read with
the Rust tokenizer (no transformers), loaded on first use, each id decoded once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import tokenizers

log = logging.getLogger(__name__)


class TokenTexts:
    """`texts(ids)` -> {id: text}. Without a readable tokenizer.json every map is empty and the
    viewer shows ids."""

    def __init__(self, model_dir: Path | None) -> None:
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._tokenizer: tokenizers.Tokenizer | None = None
        self._loaded = False
        self._cache: dict[int, str] = {}

    def _load(self) -> tokenizers.Tokenizer | None:
        if not self._loaded:
            self._loaded = True
            path = self.model_dir / "tokenizer.json" if self.model_dir else None
            if path is not None and path.is_file():
                try:
                    self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
                except Exception as exc:  # a broken file only costs the token texts
                    log.warning("viewer: cannot read %s (%s); showing token ids", path, exc)
            else:
                log.warning("viewer: no tokenizer.json in %s; showing token ids", self.model_dir)
        return self._tokenizer

    def __call__(self, ids: Iterable[int]) -> dict[int, str]:
        with self._lock:
            tokenizer = self._load()
            if tokenizer is None:
                return {}
            wanted = set(ids)
            missing = [i for i in wanted if i not in self._cache]
            if missing:
                texts = tokenizer.decode_batch([[i] for i in missing], skip_special_tokens=False)
                self._cache.update(zip(missing, texts, strict=True))
            return {i: self._cache[i] for i in wanted}
