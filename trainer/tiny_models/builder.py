"""A tiny model per chat family (Qwen3-style by default), built offline and cached, for tests
and the CPU demo.

Everything here is generated locally and deterministically: a byte-level BPE tokenizer trained
on a synthetic corpus, carrying the family's added tokens with their special / non-special flags
(Qwen3's by default), its chat template (tools, tool calls and results, reasoning where the
format has it), and a randomly initialised model of the family's architecture small enough to
train on two CPU cores (families.py). Because the tokenizer and template mirror the real format,
the `renderers` library's renderer for it produces exactly the ids the template does, so the
gateway's token-exact path is exercised as it would be on a real model.

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

from lockgate.trainer.tiny_models.families import Architecture, ChatFamily, family
from lockgate.trainer.tiny_models.qwen3_template import QWEN3_ADDED_TOKENS

TINY_MODEL_NAME: Final = "lockgate-tiny-qwen3"
# Bump when the builder's output changes in a way the parameters below do not capture.
BUILDER_VERSION: Final = 1

DEFAULT_SEED: Final = 0
_VOCAB_TARGET: Final = 1024
_VOCAB_MULTIPLE: Final = 64
_CORPUS_DOCUMENTS: Final = 6000
_MODEL_MAX_LENGTH: Final = 2048

_QWEN3_ADDED_TOKENS: Final = QWEN3_ADDED_TOKENS  # the default model's, by their old name
EOS_TOKEN: Final = "<|im_end|>"
PAD_TOKEN: Final = "<|endoftext|>"

# Qwen2/Qwen3's pre-tokenizer split: digits one at a time, newlines isolated from words. The
# renderers library encodes scaffolding and message bodies in separate calls, which only
# reproduces a one-pass template encode because this split never merges across those seams.
_QWEN_SPLIT_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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
    format: str = "qwen3"  # a chat family of families.py
    shape: Mapping[str, Any] = field(default_factory=dict)
    vocab_target: int = _VOCAB_TARGET
    extra_corpus: tuple[str, ...] = ()

    def family(self) -> ChatFamily:
        return family(self.format)

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
        "added_tokens": spec.family().added_tokens,
        "split_pattern": _QWEN_SPLIT_PATTERN,
        "chat_template": spec.family().chat_template,
        "model_shape": spec.model_shape(),
        "words": _WORDS,
        "tool_names": _TOOL_NAMES,
        "arg_names": _ARG_NAMES,
        # Only a family other than the default names itself, so the default model's cache
        # folder (and every cached copy of it) keeps its name.
        **(
            {} if spec.format == "qwen3" else {"format": spec.format, "family": repr(spec.family())}
        ),
    }


def family_spec(chat_format: str) -> TinyModelSpec:
    """The tiny test model of one chat family (families.py): the default model's shape and
    corpus, that family's tokenizer, template and architecture."""
    family(chat_format)  # an unknown name fails here, naming the choices
    if chat_format == "qwen3":
        return TinyModelSpec()
    return TinyModelSpec(name=f"lockgate-tiny-{chat_format}", format=chat_format)


def builder_fingerprint(seed: int = DEFAULT_SEED, spec: TinyModelSpec | None = None) -> str:
    """Short hash of everything that shapes the built files; part of the cache folder name."""
    spec = spec if spec is not None else TinyModelSpec(seed=seed)
    blob = json.dumps(_builder_parameters(spec), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("LOCKGATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lockgate"


def _build_tokenizer(
    out_dir: Path,
    seed: int,
    vocab_target: int = _VOCAB_TARGET,
    extra: Iterable[str] = (),
    chat: ChatFamily | None = None,
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

    chat = chat if chat is not None else family("qwen3")
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
        vocab_size=vocab_target - len(chat.added_tokens),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    corpus = itertools.chain(synthetic_corpus(seed), extra)
    tok.train_from_iterator(corpus, trainer=trainer)

    # One at a time so the ids come out in the family's order regardless of the special flag.
    for content, special in chat.added_tokens:
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
        eos_token=chat.eos,
        pad_token=chat.pad,
        bos_token=chat.bos,
        unk_token=None,
        additional_special_tokens=[
            c for c, special in chat.added_tokens if special and c not in (chat.pad, chat.bos)
        ],
        chat_template=chat.chat_template,
        model_max_length=_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        add_bos_token=False,
        padding_side="right",
    )
    fast.save_pretrained(str(out_dir))
    ids = {content: tok.token_to_id(content) for content, _ in chat.added_tokens}
    return tok.get_vocab_size(with_added_tokens=True), ids


def _model_config(arch: Architecture, shape: dict[str, Any], **tokens: Any) -> Any:
    """The transformers config of a tiny model of `arch` (its `architectures` set)."""
    import torch
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(shape)
    rope = {"rope_type": "default", "rope_theta": shape.pop("rope_theta")}
    common = {"rope_parameters": rope, "use_cache": True, "attention_bias": False, **tokens}
    if arch == "llama":
        config = LlamaConfig(mlp_bias=False, **common, **shape)
    elif arch == "gemma3":
        config = _gemma3_config(common, shape)
    elif arch == "gpt_oss":
        config = _gpt_oss_config(common, shape)
    elif arch == "qwen2":
        config = Qwen2Config(use_sliding_window=False, **common, **shape)
    else:
        config = Qwen3Config(use_sliding_window=False, **common, **shape)
    config.architectures = [_ARCHITECTURE_CLASSES[arch]]
    config.dtype = torch.float32
    return config


def _gemma3_config(common: dict[str, Any], shape: dict[str, Any]) -> Any:
    """Gemma 3's text config: a sliding-window layer and a global one, as its real models
    interleave them; both rope bases from the shape's."""
    from transformers import Gemma3TextConfig

    rope = common.pop("rope_parameters")
    common["rope_parameters"] = {"sliding_attention": rope, "full_attention": rope}
    return Gemma3TextConfig(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=512,
        query_pre_attn_scalar=shape["head_dim"],
        **common,
        **shape,
    )


def _gpt_oss_config(common: dict[str, Any], shape: dict[str, Any]) -> Any:
    """gpt-oss's own architecture in miniature: a mixture of 4 experts (2 per token) with
    biases and the clamped SwiGLU, attention sinks, biased projections, a sliding-window layer
    then a global one, and gpt-oss's yarn rope. vLLM's gpt_oss module fixes some of these
    rather than reading them (sliding window on even layers, RMSNorm eps 1e-5, biases on), so
    the config spells the same values out for the trainer's side."""
    from transformers import GptOssConfig

    theta = common.pop("rope_parameters")["rope_theta"]
    rope = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": shape["max_position_embeddings"] // 32,
    }
    common = {**common, "attention_bias": True, "rope_parameters": rope}
    layers = shape["num_hidden_layers"]
    return GptOssConfig(
        **common,
        **{**shape, "rms_norm_eps": 1e-5},
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
    )


_ARCHITECTURE_CLASSES: Final[dict[str, str]] = {
    "gemma3": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}


def build_tiny_model(
    out_dir: Path, *, seed: int = DEFAULT_SEED, spec: TinyModelSpec | None = None
) -> None:
    """Write tokenizer, config, generation config and random weights into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec if spec is not None else TinyModelSpec(seed=seed)
    chat = spec.family()
    seed = spec.seed
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if chat.format == "gpt-oss":  # harmony renders with OpenAI's vocabulary, not a trained one
        from lockgate.trainer.tiny_models.gpt_oss import build_gpt_oss_tokenizer

        tokenizer_len, ids = build_gpt_oss_tokenizer(out_dir, chat.chat_template)
    else:
        tokenizer_len, ids = _build_tokenizer(
            out_dir, seed, spec.vocab_target, spec.extra_corpus, chat
        )
    vocab_size = -(-tokenizer_len // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    bos, eos, pad = ids[chat.bos or chat.pad], ids[chat.eos], ids[chat.pad]
    config = _model_config(
        chat.architecture,
        spec.model_shape(),
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )

    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # No sampling defaults: vLLM applies generation_config's sampling fields to requests that do
    # not set them, which would silently change the RL sampling policy.
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=[eos, pad], pad_token_id=pad
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
