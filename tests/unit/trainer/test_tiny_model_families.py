"""The tiny model of every chat family (trainer/tiny_models/families.py): built offline and
cached under a name of its own, in the architecture its family is served with, and with a chat
template the format's `renderers` renderer reproduces token for token (so a model's own template
and the renderer `lockgate sft` masks with agree on what the gateway records)."""

from __future__ import annotations

from pathlib import Path

import pytest
import renderers
from transformers import AutoConfig, AutoTokenizer

from lockgate.gateway.calls.chat_format import GENERIC, detect_chat_format
from lockgate.trainer.tiny_models.builder import (
    builder_fingerprint,
    ensure_tiny_model,
    family_spec,
)
from lockgate.trainer.tiny_models.families import FAMILIES
from lockgate.trainer.tiny_models.harmony_vocab import require_o200k
from tests.unit.trainer.test_tiny_model import OPENAI_TOOLS, PLAIN, TOOL_CONVERSATION

# Up to the second user message: one call per assistant turn, as Llama 3's template allows.
TOOL_TURNS = TOOL_CONVERSATION[:6]

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama-3": "LlamaForCausalLM",
    "deepseek-r1": "Qwen2ForCausalLM",
    "glm-4.5": "LlamaForCausalLM",
    "kimi-k2": "LlamaForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "default": "Qwen2ForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest) -> tuple[str, Path]:
    if request.param == "gpt-oss":
        require_o200k()  # harmony's vocabulary, which a cached model does not point to by itself
    return request.param, ensure_tiny_model(spec=family_spec(request.param))


def test_every_family_is_listed_here() -> None:
    assert set(FAMILIES) == set(ARCHITECTURES)


def test_each_family_has_its_architecture_and_is_detected_as_its_format(
    family_dir: tuple[str, Path],
) -> None:
    name, model_dir = family_dir
    assert AutoConfig.from_pretrained(str(model_dir)).architectures == [ARCHITECTURES[name]]
    assert detect_chat_format(model_dir) == FAMILIES[name].format


def test_each_family_is_cached_apart_and_the_default_keeps_its_name() -> None:
    prints = {name: builder_fingerprint(spec=family_spec(name)) for name in FAMILIES}
    assert len(set(prints.values())) == len(FAMILIES)
    assert prints["qwen3"] == builder_fingerprint()
    assert ensure_tiny_model(spec=family_spec("qwen3")).name.startswith("lockgate-tiny-qwen3-")
    with pytest.raises(ValueError, match="no tiny model in format 'llama3'; choose one of"):
        family_spec("llama3")


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", ["plain", "tools"])
def test_the_template_and_the_formats_renderer_agree_token_for_token(
    family_dir: tuple[str, Path], conversation: str, generation_prompt: bool
) -> None:
    name, model_dir = family_dir
    if FAMILIES[name].format == GENERIC:
        pytest.skip("the generic format renders with the template itself")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = renderers.create_renderer(tok, renderers.config_from_name(name))
    messages, tools = (PLAIN, None) if conversation == "plain" else (TOOL_TURNS, OPENAI_TOOLS)
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
    )
    expected = tok.encode(text, add_special_tokens=False)
    got = renderer.render_ids(messages, tools=tools, add_generation_prompt=generation_prompt)
    assert got == expected, (tok.decode(got), tok.decode(expected))


# What `lockgate sft` (which masks by rendering prefixes with the template) does per family on a
# tool-using chat: masks exactly the tokens the format's renderer marks as sampled, or refuses
# the chat with a one-line reason; never a wrong mask. Qwen3 and DeepSeek-R1 re-render history
# (reasoning dropped), GLM-4.5 closes an assistant turn with the next role's marker.
# Gemma 3's template has no tool turns at all (it raises on them): a plain chat for it.
PLAIN_CHAT = [
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye."},
    {"role": "assistant", "content": "Bye!"},
]


def test_sft_masks_exactly_the_formats_sampled_tokens(family_dir: tuple[str, Path]) -> None:
    from lockgate.trainer.sft.data import chat_masker, load_tokenizer

    name, model_dir = family_dir
    tok = load_tokenizer(model_dir)
    messages = PLAIN_CHAT if name == "gemma3" else TOOL_CONVERSATION[:5]
    ids, mask = chat_masker(tok, FAMILIES[name].format, None)(messages, OPENAI_TOOLS)
    if FAMILIES[name].format == GENERIC:  # no renderer of its own: the template is the format
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        expected = (
            "Hello!<end_of_turn>Bye!<end_of_turn>"
            if name == "gemma3"
            else '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            "<|im_end|>The answer is 5.<|im_end|>"
        )
        assert trained == expected
        return
    rendered = renderers.create_renderer(tok, renderers.config_from_name(name)).render(
        messages, tools=OPENAI_TOOLS
    )
    # GLM-4.5 leaves a final answer unclosed: its stop token is added and trained.
    stop = [tok.convert_tokens_to_ids("<|endoftext|>")] if name == "glm-4.5" else []
    assert rendered.token_ids + stop == ids
    assert [int(s) for s in rendered.sampled_mask] + [1] * len(stop) == mask


def test_build_model_lists_the_families_and_builds_one_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lockgate.coordinator.cli.main import main

    assert main(["build-model", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(FAMILIES)
    assert main(["build-model", "--format", "llama-3"]) == 0
    assert capsys.readouterr().out.strip() == str(ensure_tiny_model(spec=family_spec("llama-3")))
    assert main(["build-model", "--format", "llama3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockgate: --format: no tiny model in format 'llama3'; choose one of:")
    assert err.count("\n") == 1


def test_rows_sharing_a_prefix_longer_than_gemma3s_window_run_whole() -> None:
    """Gemma 3's sliding layers keep only their window in a KV cache, so rows sharing a
    700-token prefix cannot attend to it through a shared cache (that path crashed): each row
    runs whole and gets what it gets alone."""
    import torch

    from lockgate.trainer.model import forward_logits, load_policy, pad_batch

    model = load_policy(ensure_tiny_model(spec=family_spec("gemma3")), torch.device("cpu")).eval()
    assert model.config.sliding_window < 700
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, 1000, (760,), generator=gen).tolist()
    rows = [first, first[:700] + torch.randint(0, 1000, (40,), generator=gen).tolist()]
    ids = pad_batch(rows, torch.long, torch.device("cpu"))
    with torch.no_grad():
        got = forward_logits(model, ids, [len(r) for r in rows], pack=False)
        for i, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row])).logits[0]
            torch.testing.assert_close(got[i, : len(row)], alone, rtol=1e-4, atol=1e-4)
