"""A tiny Qwen3-style model, built offline and cached, for tests and the CPU demo.

Everything here is generated locally and deterministically: a byte-level BPE tokenizer trained
on a synthetic corpus, carrying Qwen3's added tokens with Qwen3's special / non-special flags,
Qwen3's chat template (tools, `<tool_call>`, `<tool_response>`, `<think>`), and a randomly
initialised `Qwen3ForCausalLM` small enough to train on two CPU cores. Because the tokenizer and
template mirror real Qwen3, the `renderers` library's Qwen3 renderer produces exactly the ids
the template does, so the gateway's token-exact path is exercised as it would be on a real model.

    python -m lockgate.trainer.tiny_models.builder [--cache-dir DIR | --out DIR]
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

TINY_MODEL_NAME: Final = "lockgate-tiny-qwen3"
# Bump when the builder's output changes in a way the parameters below do not capture.
BUILDER_VERSION: Final = 1

DEFAULT_SEED: Final = 0
_VOCAB_TARGET: Final = 1024
_VOCAB_MULTIPLE: Final = 64
_CORPUS_DOCUMENTS: Final = 6000
_MODEL_MAX_LENGTH: Final = 2048

# Qwen3's added tokens in Qwen3's order, with Qwen3's `special` flag. The non-special ones
# (`<tool_call>`, `<think>`, ...) survive `decode(skip_special_tokens=True)`, which reasoning
# and tool-call parsers rely on.
_QWEN3_ADDED_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS_TOKEN: Final = "<|im_end|>"
PAD_TOKEN: Final = "<|endoftext|>"

# Qwen2/Qwen3's pre-tokenizer split: digits one at a time, newlines isolated from words. The
# renderers library encodes scaffolding and message bodies in separate calls, which only
# reproduces a one-pass template encode because this split never merges across those seams.
_QWEN_SPLIT_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's chat template (Qwen3 dense / MoE checkpoints, hybrid thinking), kept verbatim in
# behaviour so that renderers' Qwen3Renderer and `apply_chat_template` agree token for token.
QWEN3_CHAT_TEMPLATE: Final = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Architecture: small enough for two CPU cores, head_dim 32 because vLLM's CPU attention
# backend only supports head sizes in {32, 64, 80, ...}; one KV head exercises GQA.
_MODEL_SHAPE: Final[dict[str, Any]] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": _MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TinyModelSpec:
    """What shapes a built model: the default is the test model; examples build their own.

    `extra_corpus` is text the tokenizer also learns merges from (an example's own words, so its
    names and facts take few tokens); `shape` overrides fields of the default architecture.
    """

    name: str = TINY_MODEL_NAME
    seed: int = DEFAULT_SEED
    shape: Mapping[str, Any] = field(default_factory=dict)
    vocab_target: int = _VOCAB_TARGET
    extra_corpus: tuple[str, ...] = ()

    def model_shape(self) -> dict[str, Any]:
        unknown = set(self.shape) - set(_MODEL_SHAPE)
        if unknown:
            raise ValueError(f"unknown model shape fields: {sorted(unknown)}")
        return {**_MODEL_SHAPE, **self.shape}


# ---------------------------------------------------------------------------------------------
# Synthetic corpus: enough variety that the BPE learns useful merges for the text our tests and
# demo tasks produce (English-ish prose, numbers, JSON tool calls, chat scaffolding).

_WORDS: Final = (
    "the a an and or but if then so because when while where which who what how why this that "
    "these those it its is are was were be been being have has had do does did will would can "
    "could should may might must not no yes all any some each every many few more most less "
    "one two three four five six seven eight nine ten first second last next other same new old "
    "good bad big small long short high low early late right left true false open close start "
    "stop find search read write list add sum count check call return answer question result "
    "value number word file line name city weather time date day week month year user system "
    "assistant tool function model agent task goal step plan think reason note help please thank "
    "you we they he she i me my your our their here there now today tomorrow again also only just "
    "very well about after before from into over under with without between through during "
    "Paris London Tokyo Berlin Rome Madrid Cairo Lima Oslo Delhi celsius fahrenheit temperature "
    "hello hi sure okay sorry great Alice Bob "
    "rain sun cloud wind snow apple banana orange price total order item cart code test run error "
    "output input data table row column key query limit page score reward learn train policy"
).split()

_TOOL_NAMES: Final = (
    "get_weather",
    "search",
    "calculator",
    "read_file",
    "write_file",
    "lookup",
    "add",
    "multiply",
    "submit_answer",
    "list_items",
)

_ARG_NAMES: Final = (
    "city",
    "unit",
    "query",
    "limit",
    "path",
    "content",
    "a",
    "b",
    "expression",
    "answer",
    "page",
    "id",
)

_TOOLS_HEADER_TEXT: Final = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER_TEXT: Final = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n'
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!", ":", ","))


def _json_value(rng: random.Random) -> Any:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randint(-1000, 100_000)
    if kind == 1:
        return round(rng.uniform(-100, 100), rng.randint(1, 3))
    if kind == 2:
        return rng.choice((True, False, None))
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))


def _tool_call_json(rng: random.Random) -> str:
    names = rng.sample(_ARG_NAMES, rng.randint(1, 3))
    call = {"name": rng.choice(_TOOL_NAMES), "arguments": {n: _json_value(rng) for n in names}}
    return json.dumps(call, ensure_ascii=False)


def _tool_spec_json(rng: random.Random) -> str:
    names = rng.sample(_ARG_NAMES, rng.randint(1, 3))
    spec = {
        "type": "function",
        "function": {
            "name": rng.choice(_TOOL_NAMES),
            "description": _sentence(rng),
            "parameters": {
                "type": "object",
                "properties": {
                    n: {"type": rng.choice(("string", "number", "integer", "boolean"))}
                    for n in names
                },
                "required": names[:1],
            },
        },
    }
    return json.dumps(spec, ensure_ascii=False)


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b} = {result}"


def _chat_scaffold(rng: random.Random) -> str:
    # Added tokens are matched before the BPE ever sees them, so only the text between them
    # (role names, newlines, prose, JSON) is worth learning merges for.
    parts = [f"system\n{_sentence(rng)}\n", f"user\n{_sentence(rng)} {_arithmetic(rng)}\n"]
    if rng.random() < 0.5:
        parts.append(f"assistant\n\n{_sentence(rng)}\n\n\n{_sentence(rng)}\n")
    else:
        parts.append(f"assistant\n\n{_tool_call_json(rng)}\n\n\n")
        parts.append(f"user\n\n{json.dumps({'result': _json_value(rng)})}\n\n")
    return "".join(parts)


def synthetic_corpus(seed: int, documents: int = _CORPUS_DOCUMENTS) -> Iterator[str]:
    """The deterministic training text for the tokenizer."""
    rng = random.Random(seed)
    generators = (
        lambda: " ".join(_sentence(rng) for _ in range(rng.randint(1, 4))),
        lambda: _arithmetic(rng),
        lambda: _tool_call_json(rng),
        lambda: _tool_spec_json(rng),
        lambda: _chat_scaffold(rng),
        lambda: _TOOLS_HEADER_TEXT + "\n" + _tool_spec_json(rng) + _TOOLS_FOOTER_TEXT,
    )
    for i in range(documents):
        yield generators[i % len(generators)]()


# ---------------------------------------------------------------------------------------------


def _builder_parameters(spec: TinyModelSpec) -> dict[str, Any]:
    extra = hashlib.sha256("\x00".join(spec.extra_corpus).encode()).hexdigest()
    return {
        "builder_version": BUILDER_VERSION,
        "seed": spec.seed,
        "vocab_target": spec.vocab_target,
        "extra_corpus": extra,
        "vocab_multiple": _VOCAB_MULTIPLE,
        "corpus_documents": _CORPUS_DOCUMENTS,
        "model_max_length": _MODEL_MAX_LENGTH,
        "added_tokens": _QWEN3_ADDED_TOKENS,
        "split_pattern": _QWEN_SPLIT_PATTERN,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "model_shape": spec.model_shape(),
        "words": _WORDS,
        "tool_names": _TOOL_NAMES,
        "arg_names": _ARG_NAMES,
    }


def builder_fingerprint(seed: int = DEFAULT_SEED, spec: TinyModelSpec | None = None) -> str:
    """Short hash of everything that shapes the built files; part of the cache folder name."""
    spec = spec if spec is not None else TinyModelSpec(seed=seed)
    blob = json.dumps(_builder_parameters(spec), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("LOCKGATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lockgate"


def _build_tokenizer(
    out_dir: Path, seed: int, vocab_target: int = _VOCAB_TARGET, extra: Iterable[str] = ()
) -> tuple[int, dict[str, int]]:
    """Train and save the tokenizer; return its length and the ids of the added tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target - len(_QWEN3_ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    corpus = itertools.chain(synthetic_corpus(seed), extra)
    tok.train_from_iterator(corpus, trainer=trainer)

    # One at a time so the ids come out in Qwen3's order regardless of the special flag.
    for content, special in _QWEN3_ADDED_TOKENS:
        added = AddedToken(
            content,
            single_word=False,
            lstrip=False,
            rstrip=False,
            normalized=False,
            special=special,
        )
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[c for c, special in _QWEN3_ADDED_TOKENS[1:] if special],
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        add_bos_token=False,
        padding_side="right",
    )
    fast.save_pretrained(str(out_dir))
    ids = {content: tok.token_to_id(content) for content, _ in _QWEN3_ADDED_TOKENS}
    return tok.get_vocab_size(with_added_tokens=True), ids


def build_tiny_model(
    out_dir: Path, *, seed: int = DEFAULT_SEED, spec: TinyModelSpec | None = None
) -> None:
    """Write tokenizer, config, generation config and random weights into `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    spec = spec if spec is not None else TinyModelSpec(seed=seed)
    seed = spec.seed
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_len, ids = _build_tokenizer(out_dir, seed, spec.vocab_target, spec.extra_corpus)
    vocab_size = -(-tokenizer_len // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    shape = spec.model_shape()
    rope_theta = shape.pop("rope_theta")

    config = Qwen3Config(
        vocab_size=vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        use_cache=True,
        use_sliding_window=False,
        attention_bias=False,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        **shape,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = torch.float32

    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    # No sampling defaults: vLLM applies generation_config's sampling fields to requests that do
    # not set them, which would silently change the RL sampling policy.
    model.generation_config = GenerationConfig(
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def ensure_tiny_model(cache_dir: Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Return the cached tiny model's directory (of `spec`, default the test model), building
    it first if needed.

    Builds into a temporary folder beside the final one and renames it into place, so a
    reader never sees a half-written model and two racing builders both end up with the
    same complete directory (the loser discards its copy).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = spec if spec is not None else TinyModelSpec()
    final = root / f"{spec.name}-{builder_fingerprint(spec=spec)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        build_tiny_model(staging, spec=spec)
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of the cache
        try:
            os.rename(staging, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lockgate.trainer.tiny_models.builder",
        description="Build (once) the tiny offline Qwen3-style test model and print its path.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $LOCKGATE_CACHE or ~/.cache/lockgate)",
    )
    where.add_argument(
        "--out",
        type=Path,
        default=None,
        help="build a fresh copy into exactly this directory (must not exist or be empty)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="only with --out")
    args = parser.parse_args(argv)
    if args.out is not None:
        if args.out.exists() and any(args.out.iterdir()):
            parser.error(f"{args.out} exists and is not empty")
        build_tiny_model(args.out, seed=args.seed)
        path = args.out
    else:
        if args.seed != DEFAULT_SEED:
            parser.error("--seed needs --out: the cache holds the default-seed model only")
        path = ensure_tiny_model(args.cache_dir)
    print(path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
