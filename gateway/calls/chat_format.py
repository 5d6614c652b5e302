"""Which chat format a model speaks: decided once per run, from the model's own files.

The format is a property of the model, so the run config says `auto` by default and this module
reads the model directory: first the `renderers` library's own table of checkpoints it knows by
name (`MODEL_RENDERER_MAP`, matched against the name the files were saved under), then the chat
template's telltale markers (each format writes its turns with its own special tokens), with
`config.json`'s `model_type` breaking ties where a template alone cannot. A model whose template
matches no format known to `renderers` is served by its own Jinja template (the generic
`default` renderer), which cannot bridge turns: every later turn is a counted re-render, and the
gateway says so when it starts. A model with no chat template, or one that matches several
formats, is an error naming the choices, so no run trains on a guessed format.

Pure: reads at most two JSON files and one template file, imports no tokenizer.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

AUTO: Final = "auto"
GENERIC: Final = "default"
# `renderers` names that are not one model's format: `auto` is this module's job, `custom`
# needs an import path no run config carries.
_NOT_FORMATS: Final = frozenset({"auto", "custom"})


class ChatFormatError(ValueError):
    """The model's chat format cannot be decided (or the name given is not one); one line."""


@dataclass(frozen=True)
class ModelFiles:
    """What the detector reads from a model directory."""

    hub_names: tuple[str, ...]  # names the files say they were saved from, most specific first
    model_type: str
    architectures: tuple[str, ...]
    chat_template: str | None


@dataclass(frozen=True)
class _Rule:
    name: str
    matches: Callable[[ModelFiles], bool]


def _has(*markers: str) -> Callable[[ModelFiles], bool]:
    return lambda f: f.chat_template is not None and all(m in f.chat_template for m in markers)


def _lacks(*markers: str) -> Callable[[ModelFiles], bool]:
    return lambda f: f.chat_template is not None and not any(m in f.chat_template for m in markers)


def _both(*tests: Callable[[ModelFiles], bool]) -> Callable[[ModelFiles], bool]:
    return lambda f: all(t(f) for t in tests)


_DEEPSEEK_ASSISTANT: Final = "<\uff5cAssistant\uff5c>"
# GLM-4.5 puts a newline between a call's argument tags, GLM-4.7 / 5 do not; in a template
# file the newline is either written out or escaped.
_GLM45_ARG_BREAK: Final = re.compile(r"</arg_key>(\\n|\n)")


def _glm45(files: ModelFiles) -> bool:
    return files.chat_template is not None and bool(_GLM45_ARG_BREAK.search(files.chat_template))


_QWEN_VISION: Final = ("<|vision_start|>", "<|image_pad|>")
_QWEN_XML_CALLS: Final = "<function="

# Each format's markers in its chat template. Several rules matching one template is the
# ambiguity the error reports (e.g. the GLM-5 revisions, which share their markers).
_RULES: Final[tuple[_Rule, ...]] = (
    _Rule("gpt-oss", _has("<|channel|>", "<|message|>", "<|start|>")),
    _Rule("llama-3", _has("<|start_header_id|>", "<|eot_id|>")),
    _Rule("deepseek-r1", _has(_DEEPSEEK_ASSISTANT, "<think>")),
    _Rule("deepseek-v3", _both(_has(_DEEPSEEK_ASSISTANT), _lacks("<think>"))),
    _Rule("kimi-k2", _both(_has("<|im_middle|>", "<|im_assistant|>"), _lacks("<|media_"))),
    _Rule("kimi-k2.5", _has("<|im_middle|>", "<|im_assistant|>", "<|media_")),
    _Rule("glm-4.5", _both(_has("[gMASK]", "<|assistant|>"), _glm45)),
    *(
        _Rule(name, _both(_has("[gMASK]", "<|assistant|>"), lambda f: not _glm45(f)))
        for name in ("glm-5", "glm-5.1", "glm-5.3")
    ),
    _Rule("gemma4", _has("<|turn>", "<turn|>")),
    _Rule(
        "qwen3",
        _both(
            _has("<|im_start|>", "<tool_call>", "<think>"), _lacks(*_QWEN_VISION, _QWEN_XML_CALLS)
        ),
    ),
    _Rule("qwen3-vl", _has("<|im_start|>", "<tool_call>", *_QWEN_VISION)),
    _Rule(
        "prime-qwen3",
        _both(_has("<|im_start|>", "<tool_call>", _QWEN_XML_CALLS), _lacks("<|vision")),
    ),
)


def known_formats() -> list[str]:
    """Every chat format name `renderers` knows, sorted (`auto` and `custom` left out)."""
    import renderers

    union = typing.get_args(renderers.RendererConfig)[0]
    names = {c.model_fields["name"].default for c in typing.get_args(union)}
    return sorted(names - _NOT_FORMATS)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatFormatError(f"{path}: not readable JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}


def _template_text(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template as text: its own file, else tokenizer_config's (one or several)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None


_HUB_CACHE_DIR: Final = re.compile(r"models--([^/]+?)--([^/]+)")


def read_model_files(model_dir: Path | str) -> ModelFiles:
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    names = [str(v) for v in (config.get("_name_or_path"), tokenizer_config.get("name_or_path"))]
    cached = _HUB_CACHE_DIR.search(str(model_dir.resolve()))
    if cached:  # a snapshot in the Hugging Face cache: models--Org--Name/snapshots/<rev>
        names.insert(0, f"{cached.group(1)}/{cached.group(2)}")
    architectures = config.get("architectures") or []
    return ModelFiles(
        hub_names=tuple(n for n in names if n and n != "None"),
        model_type=str(config.get("model_type", "")),
        architectures=tuple(str(a) for a in architectures),
        chat_template=_template_text(model_dir, tokenizer_config),
    )


def detect_from_files(files: ModelFiles, where: str = "the model") -> str:
    """The format of a model described by `files` (pure; `detect_chat_format` reads them)."""
    from renderers.base import MODEL_RENDERER_MAP

    for name in files.hub_names:
        if name in MODEL_RENDERER_MAP:
            return MODEL_RENDERER_MAP[name]
    if files.chat_template is None:
        raise ChatFormatError(
            f"cannot detect the chat format of {where}: it has no chat template and no known "
            f"checkpoint name; set model.chat_format to one of: {', '.join(known_formats())}"
        )
    found = [rule.name for rule in _RULES if rule.matches(files)]
    if len(found) > 1:
        raise ChatFormatError(
            f"the chat template of {where} fits several formats ({', '.join(found)}); set "
            "model.chat_format to the one it is"
        )
    return found[0] if found else GENERIC


def detect_chat_format(model_dir: Path | str) -> str:
    """The `renderers` format name of the model in `model_dir` (see the module's docstring)."""
    return detect_from_files(read_model_files(model_dir), where=str(model_dir))


def resolve_chat_format(setting: str, model_dir: Path | str) -> str:
    """A run's chat format: `auto` detects it; any other setting must be a name `renderers`
    knows and is taken as given (for a fine-tune whose template was renamed or edited)."""
    if setting == AUTO:
        return detect_chat_format(model_dir)
    if setting not in known_formats():
        raise ChatFormatError(
            f"unknown chat format '{setting}'; choose auto or one of: {', '.join(known_formats())}"
        )
    return setting


def bridges_turns(name: str) -> bool:
    """Whether the format's renderer can extend the previous call's exact tokens: the generic
    renderer re-renders every turn from the template, so each later turn is a counted split."""
    return name != GENERIC
