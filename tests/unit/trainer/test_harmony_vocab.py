"""o200k_base for gpt-oss's harmony format: rebuilt byte-exact from js-tiktoken's ranks by
scripts/setup.sh, found in the lockgate cache without any download, and a one-line error naming
the setup step when it is missing or altered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockgate.trainer.tiny_models.harmony_vocab import (
    ENCODINGS_ENV,
    O200K_FILE,
    MissingVocabulary,
    o200k_lines_from_js_ranks,
    require_o200k,
)


def _js_module(bpe_ranks: str) -> str:
    return "export default " + json.dumps({"pat_str": "", "bpe_ranks": bpe_ranks}) + ";"


def test_js_ranks_unfold_into_one_line_per_rank_in_rank_order() -> None:
    module = _js_module("! 2 Yw== ZA==\n! 0 YQ== Yg==\n")
    assert o200k_lines_from_js_ranks(module) == b"YQ== 0\nYg== 1\nYw== 2\nZA== 3\n"
    with pytest.raises(ValueError, match="not contiguous"):
        o200k_lines_from_js_ranks(_js_module("! 0 YQ==\n! 2 Yw==\n"))
    with pytest.raises(ValueError, match="not a js-tiktoken ranks module"):
        o200k_lines_from_js_ranks("{}")


def test_a_missing_or_altered_vocabulary_is_one_line_naming_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENCODINGS_ENV, raising=False)
    with pytest.raises(MissingVocabulary) as missing:
        require_o200k(tmp_path)
    assert "run scripts/setup.sh" in str(missing.value) and "\n" not in str(missing.value)
    (tmp_path / "tiktoken").mkdir()
    (tmp_path / "tiktoken" / O200K_FILE).write_text("YQ== 0\n")
    with pytest.raises(MissingVocabulary, match="is not o200k_base"):
        require_o200k(tmp_path)


def test_harmony_renders_with_the_cached_vocabulary_offline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from openai_harmony import (
        Conversation,
        HarmonyEncodingName,
        Message,
        Role,
        load_harmony_encoding,
    )

    monkeypatch.delenv(ENCODINGS_ENV, raising=False)
    folder = require_o200k()  # the folder scripts/setup.sh filled
    assert (folder / O200K_FILE).is_file()
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    chat = Conversation.from_messages([Message.from_role_and_content(Role.USER, "hi there")])
    ids = enc.render_conversation_for_completion(chat, Role.ASSISTANT)
    # <|start|>user<|message|>hi there<|end|><|start|>assistant, o200k's ids for the words.
    assert ids == [200006, 1428, 200008, 3686, 1354, 200007, 200006, 173781]
