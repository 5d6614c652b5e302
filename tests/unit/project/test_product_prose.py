"""Product prose states rules and their reasons; lab notes live in docs/.

The product (gateway/, coordinator/, trainer/, agent_runtime/) must not name an example (an
example uses the product, never the other way round) nor carry run figures: what a benchmark
measured, how long a run took, what a seed gained. Those belong in docs/performance.md,
benchmarks/README.md or an example's EXPERIMENTS.md, linked from the code. Only comments,
docstrings and config field descriptions are read: code literals such as
`timeout_s: float = 300.0` are values, not prose. A rule's threshold ("after 5 s") passes; a
measurement ("took 7.2 s", "36 s instead of 62", "31k tokens/s", "17% more time") does not.

Shipped configs (examples/*/config.yaml, examples/*/configs/*.yaml) may name their own example
but not carry seed-by-seed results: link the example's EXPERIMENTS.md instead.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("gateway", "coordinator", "trainer", "agent_runtime")

_NUM = r"\d[\d,]*(?:\.\d+)?k?"
_TIME = r"(?:ms|s|secs?|seconds?|min|minutes?|h|hours?)"
# Measured quantities in prose. Each pattern wants a sign of measurement (a verb of timing, a
# comparison between two figures, a throughput, a gain in percent, a seed's result, a named
# machine), so that a rule's threshold with its unit passes.
RUN_FIGURES: dict[str, re.Pattern[str]] = {
    "a throughput": re.compile(
        rf"{_NUM}\s*(?:tokens|tok|requests|req|samples|steps|calls|it)\s*(?:/\s*s\b|per second)",
        re.IGNORECASE,
    ),
    "a time something took": re.compile(
        rf"\b(?:took|takes|taking|ran|ran in|finished in|started in|measured|lasted)\s+"
        rf"(?:about |around |~)?{_NUM}\s*{_TIME}\b",
        re.IGNORECASE,
    ),
    "two figures compared": re.compile(
        rf"{_NUM}\s*(?:{_TIME}|%|GiB|MiB|GB|MB)?\s+(?:instead of|against|vs\.?|versus|rather than)"
        rf"\s+(?:~)?{_NUM}\b",
        re.IGNORECASE,
    ),
    "a change from one figure to another": re.compile(
        rf"\bfrom\s+{_NUM}\s*(?:{_TIME}|%|GiB|MiB|GB|MB)?\s+to\s+{_NUM}\s*(?:{_TIME}|%|GiB|MiB|GB|MB)\b",
        re.IGNORECASE,
    ),
    "a gain in percent": re.compile(
        rf"(?:[+−]{_NUM}\s*%|{_NUM}\s*%\s+(?:faster|slower|more|less|fewer|better|worse|higher|"
        r"lower|gain|quicker|shorter|longer))",
        re.IGNORECASE,
    ),
    "a signed result": re.compile(r"(?<![\w.])[+−]\d+\.\d+"),
    "a seed's result": re.compile(
        r"\bseeds?\s+\d+\b(?:(?!\.\s)[^\n]){0,40}?(?:[+−-]?\d+\.\d+|\d+\s*%|[+−]\d+|[:=]\s*\d)"
    ),
    "a named machine": re.compile(r"\b(?:H100|H200|A100|A10G|EPYC|Xeon|MI300X?)\b"),
    "the machine it ran on": re.compile(r"\bon this VM\b"),
    "a figure before and after": re.compile(
        rf"{_NUM}\s*(?:{_TIME}|us|%|GiB|MiB)?\s*(?:->|→)\s*{_NUM}\s*(?:{_TIME}|us|%|GiB|MiB)\b"
    ),
    "a percentile": re.compile(rf"\bp(?:50|90|95|99)\b(?: of)?\s+{_NUM}"),
    "a range of times": re.compile(r"(?<![\w.])\d+(?:\.\d+)?-\d+(?:\.\d+)?\s*(?:ms|us|s)\b"),
    "a CPU cost": re.compile(
        rf"{_NUM}\s*(?:us|µs|ms|s|%)\s+of\s+(?:the\s+)?(?:[\w']+\s+)?CPU\b", re.IGNORECASE
    ),
}
# In shipped configs, only what one seed gained: the example's own name and its settings'
# units are the config's business.
SEED_FIGURES = RUN_FIGURES["a seed's result"]


def example_names(examples: Path = ROOT / "examples") -> list[str]:
    """The example folders' names, less those that are also product words (`sft` is both an
    example and the product's `lockgate sft`), and "deep research", the example DeepResearch
    spelled in words."""
    product_words = {
        part for folder in PRODUCT for p in (ROOT / folder).rglob("*.py") for part in p.parts
    } | {p.stem for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")}
    names = {p.name for p in examples.iterdir() if p.is_dir() and not p.name.startswith("_")}
    return sorted((names - product_words) | {"deep research"})


def name_patterns(names: list[str]) -> dict[str, re.Pattern[str]]:
    """A name matches as a word in any case, with `_`, `-` or a space where it has one
    (`command_agent` is the example, `CommandAgent` the product's class it runs)."""
    out = {}
    for name in names:
        parts = [re.escape(p) for p in re.split(r"[_\- ]", name)]
        out[f"the example {name!r}"] = re.compile(
            r"(?<![A-Za-z])" + r"[_\- ]".join(parts) + r"(?![A-Za-z])", re.IGNORECASE
        )
    return out


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment, docstring and `description=`/`help=` string."""
    out: list[tuple[int, str]] = []
    last = -1  # comments on consecutive lines are one block, read as one text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            if out and line == last + 1 and out[-1][1].startswith("#"):
                out[-1] = (out[-1][0], out[-1][1] + "\n" + tok.string)
            else:
                out.append((line, tok.string))
            last = line
    for node in ast.walk(ast.parse(source)):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ) and (doc := ast.get_docstring(node, clean=False)):
            first = node.body[0]
            out.append((first.lineno, doc))
        elif isinstance(node, ast.keyword) and node.arg in ("description", "help"):
            text = _string(node.value)
            if text:
                out.append((node.value.lineno, text))
    return out


def _string(node: ast.expr) -> str:
    """The text of a string literal, of implicitly joined parts, or of an f-string's literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_string(v) for v in node.values if isinstance(v, ast.Constant))
    return ""


def yaml_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of each `#` comment of a YAML file (a `#` at a line's start or after a
    space, outside quotes)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        quote = ""
        for i, ch in enumerate(line):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
                out.append((n, line[i:]))
                break
    return out


def findings(
    items: list[tuple[int, str]], patterns: dict[str, re.Pattern[str]]
) -> list[tuple[int, str, str]]:
    """(line, what, matched text) for each pattern hit; a block's lines are joined, so a
    phrase split over two lines is still one phrase."""
    found = []
    for line, text in items:
        flat = re.sub(r"\s*\n\s*#?\s*", " ", text)
        for what, pattern in patterns.items():
            for m in pattern.finditer(flat):
                found.append((line, what, m.group(0)))
    return found


def product_files() -> list[Path]:
    return [p for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py"))]


def shipped_configs() -> list[Path]:
    return sorted(ROOT.glob("examples/*/config.yaml")) + sorted(
        ROOT.glob("examples/*/configs/*.yaml")
    )


# An example's run spoken of by its recipe ("the CPU recipe's model"), without its name.
A_RECIPE = re.compile(r"\b(?:CPU|GPU)(?:'s)?\s+recipe", re.IGNORECASE)


def product_patterns() -> dict[str, re.Pattern[str]]:
    return {**name_patterns(example_names()), "an example's recipe": A_RECIPE, **RUN_FIGURES}


PLANTED = '''"""A module.

Measured on an H200: a step of 96k tokens took 7.2 s with the mask, 31k tokens/s.
"""

TIMEOUT_S: float = 300.0  # give up after 300 s; 50 ms between polls
RATE = 7.2  # seconds, a literal: not prose


def f() -> None:
    """Return at once."""
    # on the CPU recipe's run this took 7.2 s (seed 1: +19.8)
    # on the deep research drills the replicas started in 36 s instead of 62
    # the peak fell from 90 to 46 GiB for 17% more time
    # a pause p50 20 -> 47 ms; collections stopped the loop 0.1-0.5 s; 12% of the gateway's CPU
'''


def test_the_checker_catches_planted_lab_notes_and_passes_rules() -> None:
    found = findings(prose(PLANTED), product_patterns())
    by_line: dict[int, set[str]] = {}
    for line, what, _ in found:
        by_line.setdefault(line, set()).add(what)
    assert {"a time something took", "a throughput", "a named machine"} <= by_line[1]
    assert {
        "a time something took",
        "a seed's result",
        "a signed result",
        "an example's recipe",
        "two figures compared",
        "a change from one figure to another",
        "a gain in percent",
        "a figure before and after",
        "a percentile",
        "a range of times",
        "a CPU cost",
    } <= by_line[12]
    assert set(by_line) == {1, 12}, found


def test_the_checker_reads_descriptions_and_yaml_comments() -> None:
    source = 'x = Field(default=1, description="on deep_research drills: 4,800 tokens/s")\n'
    assert {what for _, what, _ in findings(prose(source), product_patterns())} == {
        "the example 'deep research'",
        "a throughput",
    }
    config = 'seed: 1  # seed 1: +19.8 points\nname: "a # b"  # fine\n# seeds 0 and 2 differ\n'
    assert [line for line, *_ in findings(yaml_comments(config), {"s": SEED_FIGURES})] == [1]


def test_example_names_come_from_the_examples_folder(tmp_path: Path) -> None:
    for name in ("toy", "sft", "web_shop", "__pycache__"):
        (tmp_path / name).mkdir()
    names = example_names(tmp_path)
    assert "web_shop" in names and "toy" in names and "deep research" in names
    assert "sft" not in names  # the product's own `lockgate sft`
    assert name_patterns(["web_shop"])["the example 'web_shop'"].search("the Web Shop agent")


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_product_prose_names_no_example_and_carries_no_run_figures(path: Path) -> None:
    found = findings(prose(path.read_text()), product_patterns())
    assert not found, (
        f"{path.relative_to(ROOT)}: state the rule and its reason; move measurements to "
        "docs/ (performance.md, design.md), benchmarks/README.md or an example's "
        "EXPERIMENTS.md and link them:\n"
        + "\n".join(f"  line {line}: {what}: {text!r}" for line, what, text in found)
    )


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_carry_no_seed_by_seed_figures(path: Path) -> None:
    found = findings(yaml_comments(path.read_text()), {"a seed's result": SEED_FIGURES})
    assert not found, (
        f"{path.relative_to(ROOT)}: link the example's EXPERIMENTS.md instead:\n"
        + "\n".join(f"  line {line}: {text!r}" for line, _, text in found)
    )
