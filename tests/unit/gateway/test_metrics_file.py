"""metrics.jsonl's one reader: a partial last line (a run still writing) is skipped, any other
line that is no step record is an error naming its line; the dashboard's script plots only the
keys the viewer's API sends."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lockgate.gateway.records.metrics_file import (
    MetricsFileError,
    Reward,
    parse_metrics,
    read_metrics,
)
from lockgate.gateway.viewer.run_metrics import COLUMNS, MetricsFile

ROOT = Path(__file__).resolve().parents[3]


def _lines(*records: dict[str, object]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_partial_last_line_is_not_yet_a_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines({"step": 1}, {"step": 2}) + '{"step": 3, "rew')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    # Once its newline is written it is a whole record.
    path.write_text(_lines({"step": 1}, {"step": 2, Reward.MEAN: 0.5}))
    assert read_metrics(path)[-1] == {"step": 2, Reward.MEAN: 0.5}
    # A whole object still waiting for its newline is a record already.
    assert parse_metrics('{"step": 1}\n{"step": 2}') == [{"step": 1}, {"step": 2}]
    assert parse_metrics("") == [] and parse_metrics("\n\n") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"step": 1}\nnope\n{"step": 3}\n', r"m\.jsonl:2: not valid JSON"),
        ('{"step": 1}\n{"step": 2, "rew\n', r"m\.jsonl:2: not valid JSON"),  # torn, then ended
        ('{"step": 1}\n\n{"reward/mean": 1.0}\n', r"m\.jsonl:3: not a step record"),
        ('[1, 2]\n{"step": 2}\n', r"m\.jsonl:1: not a step record"),
        ('{"step": "1"}\n', r"m\.jsonl:1: not a step record"),
    ],
)
def test_any_other_bad_line_is_an_error_naming_it(text: str, error: str) -> None:
    with pytest.raises(MetricsFileError, match=error):
        parse_metrics(text, "m.jsonl")


def test_the_dashboard_says_why_a_bad_file_cannot_be_shown(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnope\n{"step": 3}\n')
    shown = MetricsFile(path).read()
    assert not shown.available and shown.error is not None and ":2: not valid JSON" in shown.error
    path.write_text(_lines({"step": 1}) + '{"step": 2, "rew')
    shown = MetricsFile(path).read()
    assert shown.available and shown.error is None and shown.steps == [1]


def test_the_dashboard_plots_only_columns_the_api_sends() -> None:
    script = (ROOT / "gateway" / "viewer" / "static" / "viewer.js").read_text()
    plotted = set(re.findall(r'\bc\["([^"]+)"\]', script))
    assert plotted and plotted <= set(COLUMNS), plotted - set(COLUMNS)
