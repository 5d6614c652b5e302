"""Weight snapshots in HF format: what replicas reload and what people take away.

A snapshot is the model's full state dict as safetensors next to the source model's config and
tokenizer files, written into a temporary folder and renamed into place, so a replica never
reads half a snapshot.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

# Everything of an HF model dir except its weights.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def write_snapshot(state_dict: Mapping[str, torch.Tensor], source_dir: Path, out_dir: Path) -> Path:
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in _SIDE_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, tmp / name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def prune_snapshots(weights_dir: Path, keep: int, current: int) -> None:
    """Keep the `keep` newest step_N snapshots up to step `current`; delete the rest, and any
    of a later step: an earlier run in the same dir left those, and counting them as newest
    would delete the snapshot just written."""
    steps = sorted(
        (int(m.group(1)), p)
        for p in weights_dir.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    )
    stale = [path for step, path in steps if step > current]
    kept = [(step, path) for step, path in steps if step <= current]
    for path in stale + [path for _, path in kept[:-keep]]:
        shutil.rmtree(path, ignore_errors=True)
