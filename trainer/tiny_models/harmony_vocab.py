"""OpenAI's o200k_base vocabulary, which gpt-oss's harmony format (`openai-harmony`) renders with.

Harmony downloads the file on first use unless `TIKTOKEN_ENCODINGS_BASE` names a folder that
holds it; lockgate never downloads at run time, so `scripts/setup.sh` rebuilds the file once from
a package registry (the `js-tiktoken` npm package ships the same ranks in a compressed form) into
the lockgate cache, and everything that renders gpt-oss points harmony there. The rebuilt file
must be byte-exact: its sha256 is checked against the published one.

    python -m lockgate.trainer.tiny_models.harmony_vocab --from-js-tiktoken RANKS_JS
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Final

O200K_FILE: Final = "o200k_base.tiktoken"
O200K_SHA256: Final = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENCODINGS_ENV: Final = "TIKTOKEN_ENCODINGS_BASE"
# js-tiktoken ships each ranks table as an ES module exporting one JSON object.
_JS_PREFIX: Final = "export default "


class MissingVocabulary(RuntimeError):
    """The o200k_base file is not where harmony will look for it."""


def o200k_dir(cache_root: Path | None = None) -> Path:
    from lockgate.trainer.tiny_models.builder import default_cache_dir  # builder imports this

    return (cache_root if cache_root is not None else default_cache_dir()) / "tiktoken"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def require_o200k(cache_root: Path | None = None) -> Path:
    """Point harmony at the cached vocabulary (unless the environment already names a folder)
    and return that folder; a missing or altered file is a one-line error naming the setup step,
    because harmony would otherwise try to download it."""
    named = os.environ.get(ENCODINGS_ENV)
    folder = Path(named) if named else o200k_dir(cache_root)
    path = folder / O200K_FILE
    if not path.is_file():
        raise MissingVocabulary(
            f"the gpt-oss (harmony) format needs OpenAI's o200k_base vocabulary at {path}; "
            "run scripts/setup.sh, which fetches it once"
        )
    if _sha256(path) != O200K_SHA256:
        raise MissingVocabulary(
            f"{path} is not o200k_base (sha256 differs); rerun scripts/setup.sh"
        )
    os.environ[ENCODINGS_ENV] = str(folder)
    return folder


def o200k_lines_from_js_ranks(text: str) -> bytes:
    """The .tiktoken file (`base64(token) rank` per line, by rank) from js-tiktoken's ranks module,
    whose `bpe_ranks` holds lines `! FIRST_RANK TOKEN TOKEN ...` of consecutive ranks."""
    if not text.startswith(_JS_PREFIX):
        raise ValueError("not a js-tiktoken ranks module (no `export default {...}`)")
    ranks: dict[int, str] = {}
    for line in json.loads(text[len(_JS_PREFIX) :].rstrip().rstrip(";"))["bpe_ranks"].split("\n"):
        if line:
            _, first, *tokens = line.split(" ")
            ranks.update((int(first) + i, token) for i, token in enumerate(tokens))
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError("the ranks are not contiguous from 0")
    return "".join(f"{ranks[r]} {r}\n" for r in range(len(ranks))).encode()


def write_o200k(js_ranks: Path, cache_root: Path | None = None) -> Path:
    """Rebuild o200k_base.tiktoken from js-tiktoken's `dist/ranks/o200k_base.js` into the cache,
    refusing anything that is not byte-exact."""
    data = o200k_lines_from_js_ranks(js_ranks.read_text(encoding="utf-8"))
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise ValueError(f"{js_ranks} does not rebuild o200k_base exactly (sha256 differs)")
    folder = o200k_dir(cache_root)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{O200K_FILE}.{os.getpid()}.tmp"
    staging.write_bytes(data)
    os.replace(staging, folder / O200K_FILE)
    return folder / O200K_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lockgate.trainer.tiny_models.harmony_vocab",
        description="Rebuild o200k_base.tiktoken into the lockgate cache (used by scripts/setup.sh).",
    )
    parser.add_argument("--from-js-tiktoken", type=Path, required=True, metavar="RANKS_JS")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        print(write_o200k(args.from_js_tiktoken, args.cache_dir))
    except (OSError, ValueError) as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
