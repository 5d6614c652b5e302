"""Supervised fine-tuning on this machine (`lockgate sft`): load the SFT config, check OUT for a
run to resume, tokenize the chats into OUT/data/, then run the trainer's SFT ranks under
torchrun and echo their progress lines until they exit.

Bad input (the config, OUT, the data) is a `ConfigError` or `UsageError` raised before any rank
starts; ranks that fail are a `RunFailed` naming the cause and the log.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from lockgate.coordinator.config import read_config_file
from lockgate.coordinator.cpu_plan import busy_cores_here
from lockgate.coordinator.errors import (
    ConfigError,
    Interrupted,
    RunFailed,
    UsageError,
    config_loading,
)
from lockgate.coordinator.launch.parts import harmony_vocabulary_for
from lockgate.coordinator.launch.replicas import usable_cpus
from lockgate.gateway.calls.chat_format import ChatFormatError, resolve_chat_format
from lockgate.trainer.protocol import write_atomic
from lockgate.trainer.sft.config import SFTConfig


def sft(path: Path, overrides: list[str], out: Path | None, *, resume: bool) -> Path:
    """Train the SFT run `path` configures (`out` overrides its out_dir) and return its final
    model dir; with `resume`, continue the run in OUT from its newest checkpoint."""
    config = load_sft_config(path, overrides, out)
    with _input_errors():
        reuse_data = _check_out(config, resume)
        config.layout.out.mkdir(parents=True, exist_ok=True)
        if not reuse_data:
            _prepare_data(config)
        write_atomic(config.layout.config, config.model_dump_json(indent=2))
    try:
        _run_ranks(config, resume)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; all processes stopped") from None
    return config.layout.final


def load_sft_config(path: Path, overrides: list[str], out: Path | None) -> SFTConfig:
    """The config from `path` and `overrides`, resolved against the file's folder and the model
    (the tiny test model when none is set); a `ConfigError` when it does not load."""
    with config_loading(path):
        config = SFTConfig.model_validate(read_config_file(path, overrides))
        model_dir = config.model.path
        if model_dir is None:
            from lockgate.trainer.tiny_models.builder import ensure_tiny_model

            model_dir = ensure_tiny_model()
        resolved = config.resolved(path.parent, model_dir)
    # The same decision as a training run's gateway (gateway/calls/chat_format.py), recorded in
    # OUT's config as the name it resolved to.
    try:
        assert resolved.model.path is not None
        resolved.model.chat_format = resolve_chat_format(
            resolved.model.chat_format, resolved.model.path
        )
    except ChatFormatError as exc:
        raise ConfigError(f"model.chat_format: {exc}") from None
    harmony_vocabulary_for(resolved.model.chat_format)
    if out is not None:
        resolved.out_dir = out.resolve()
    return resolved


@contextlib.contextmanager
def _input_errors() -> Iterator[None]:
    """Data that cannot be read or used (a missing file, a chat the template cannot train on,
    a full disk) as a one-line `UsageError`, before any rank starts."""
    try:
        yield
    except FileNotFoundError as exc:
        raise UsageError(f"data file not found: {exc.filename}") from exc
    except (ValueError, OSError) as exc:
        raise UsageError(" ".join(str(exc).split())) from exc


def _check_out(config: SFTConfig, resume: bool) -> bool:
    """Whether OUT holds the run to resume (its tokenized data is then reused as it is)."""
    layout = config.layout
    if not layout.config.exists():
        return False
    if not resume:
        raise UsageError(
            f"{layout.out} holds an earlier run: pass --resume to continue it, or choose "
            "another out_dir (--out)"
        )
    before = SFTConfig.model_validate_json(layout.config.read_text()).data_order()
    changed = [k for k, v in config.data_order().items() if before[k] != v]
    if changed:
        raise UsageError(
            f"--resume: {', '.join(changed)} differ from the run in {layout.out}, so its steps "
            "would train other conversations; use the same options or another out_dir"
        )
    return layout.train_data.exists()


def _prepare_data(config: SFTConfig) -> None:
    """Tokenize the train (and val) chats into OUT/data/, printing what was cut or dropped."""
    from lockgate.trainer.sft.data import load_tokenizer, tokenize_file, write_examples

    layout, data = config.layout, config.data
    splits = [("train", data.path, layout.train_data), ("val", data.val_path, layout.val_data)]
    for _, source, _ in splits:
        if source is not None and not source.is_file():
            raise FileNotFoundError(2, "no such file", str(source))  # before the slow tokenizer
    tokenizer = load_tokenizer(config.model_dir)
    stats = {}
    for name, source, target in splits:
        if source is None:
            continue
        examples, stats[name] = tokenize_file(
            source,
            tokenizer,
            chat_format=config.model.chat_format,
            max_length=data.max_length,
            overlong=data.overlong,
            end_of_turn=data.end_of_turn,
            workers=len(usable_cpus()),
        )
        if not examples:
            raise ValueError(f"{source}: no conversation has an assistant token to train on")
        write_examples(examples, target)
        print(f"sft data: {stats[name].summary(name)}", file=sys.stderr, flush=True)
    layout.data_stats.write_text(json.dumps({k: vars(v) for k, v in stats.items()}, indent=2))


def _follow(proc: subprocess.Popen[bytes], log_path: Path, offset: int) -> int:
    """Echo the ranks' progress lines ("sft ...") from the log until the ranks exit."""
    pending = b""
    with log_path.open("rb") as log:
        log.seek(offset)
        while True:
            done = proc.poll() is not None
            # Only whole lines: a line being written is finished on a later read.
            *lines, pending = (pending + log.read()).split(b"\n")
            for line in lines if not done else [*lines, pending]:
                text = line.decode(errors="replace")
                if text.startswith("sft "):
                    print(text, file=sys.stderr, flush=True)
            if done:
                return int(proc.returncode)
            time.sleep(0.2)


# Other processes keeping this much of a core busy make spinning ranks wait on each other.
_BUSY_CORES_TO_SLEEP = 0.5


def _machine_is_free() -> bool:
    """Whether the ranks' OpenMP threads may spin (trainer.py `thread_env`): only on cores
    nothing else keeps busy. Spinning threads beside another busy process wait for a thread
    the OS took off its core, and a run slows many times over (docs/performance.md)."""
    busy = busy_cores_here()
    if busy < _BUSY_CORES_TO_SLEEP:
        return True
    print(
        f"lockgate sft: other processes keep {busy:.1f} cores busy, so the ranks' threads "
        "sleep when idle instead of spinning",
        file=sys.stderr,
    )
    return False


def _run_ranks(config: SFTConfig, resume: bool) -> None:
    """Run the SFT ranks on the prepared OUT until they exit; `RunFailed` with the cause the
    ranks wrote (or their exit code) when they fail."""
    from lockgate.coordinator.launch.processes import terminate
    from lockgate.coordinator.launch.trainer import spawn_ranks

    layout = config.layout
    layout.failed.unlink(missing_ok=True)
    offset = layout.log.stat().st_size if layout.log.exists() else 0
    alone = _machine_is_free()
    proc = spawn_ranks(
        "lockgate.trainer.sft.main",
        ["--config", str(layout.config), *(["--resume"] if resume else [])],
        world_size=config.trainer.world_size,
        num_threads=config.trainer.num_threads,
        log_path=layout.log,
        alone=alone,
    )
    try:
        code = _follow(proc, layout.log, offset)
    finally:
        terminate(proc)  # a no-op once torchrun has exited; stops the ranks on Ctrl-C
    if code != 0:
        why = " ".join(layout.failed.read_text().split()) if layout.failed.exists() else ""
        raise RunFailed(f"sft failed: {why or f'exit code {code}'} (log: {layout.log})")
