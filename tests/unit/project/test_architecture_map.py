"""docs/architecture.md's map is the tree: every room (a folder of Python modules) of the four
components has a `### \\`folder/\\`` heading there, and every module a row `| \\`file.py\\` | ... |`
under its room's heading. A file added without a row, or a row left for a file that is gone,
fails here, so the map a newcomer reads cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COMPONENTS = ("gateway", "agent_runtime", "coordinator", "trainer")
MAP_START = "## The map"

HEADING = re.compile(r"^### `([\w/]+/)`\s*$")
ROW = re.compile(r"^\| `([\w.]+\.py)` \|")


def mapped(doc: str) -> tuple[set[str], set[str]]:
    """(rooms, files) the map section of `doc` names, as paths from the repository root."""
    section = doc.split(MAP_START, 1)[1]
    section = section.split("\n## ", 1)[0]  # up to the next top-level section
    rooms: set[str] = set()
    files: set[str] = set()
    room = None
    for line in section.splitlines():
        if heading := HEADING.match(line):
            room = heading.group(1)
            rooms.add(room)
        elif (row := ROW.match(line)) and room is not None:
            files.add(room + row.group(1))
    return rooms, files


def tree(root: Path) -> tuple[set[str], set[str]]:
    """(rooms, files) of the components as they are on disk; a room's `__init__.py` is its
    heading's text, not a row."""
    rooms: set[str] = set()
    files: set[str] = set()
    for component in COMPONENTS:
        for path in (root / component).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            rooms.add(rel.rpartition("/")[0] + "/")
            if path.name != "__init__.py":
                files.add(rel)
    return rooms, files


def drift(root: Path) -> list[str]:
    doc_rooms, doc_files = mapped((root / "docs" / "architecture.md").read_text())
    rooms, files = tree(root)
    return sorted(
        [f"not on the map: {p}" for p in (rooms - doc_rooms) | (files - doc_files)]
        + [f"on the map but gone: {p}" for p in (doc_rooms - rooms) | (doc_files - files)]
    )


def test_the_map_in_docs_architecture_is_the_tree() -> None:
    assert drift(ROOT) == []


def test_a_file_missing_from_the_map_and_a_row_left_behind_are_both_caught(
    tmp_path: Path,
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "# Architecture\n\n## The map\n\n### `gateway/`\n\n| file | holds |\n|---|---|\n"
        "| `client.py` | the client |\n| `gone.py` | a file that was removed |\n\n"
        "### `trainer/old/`\n\n## Next section\n\n### `coordinator/`\n| `loop.py` | x |\n"
    )
    for rel in ("gateway/__init__.py", "gateway/client.py", "gateway/new.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert drift(tmp_path) == [
        "not on the map: gateway/new.py",
        "on the map but gone: gateway/gone.py",
        "on the map but gone: trainer/old/",
    ]
