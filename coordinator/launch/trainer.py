"""The trainer ranks as one child process tree (torchrun), driven through the file protocol.

`spawn_ranks` starts any trainer rank program under torchrun (`lockgate sft` uses it too).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lockgate.coordinator.errors import RunFailed
from lockgate.coordinator.launch.processes import log_tail, spawn, terminate
from lockgate.trainer import protocol
from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.protocol import ExportLayout, SendWeights, WeightsSent


def spawn_ranks(
    module: str,
    args: Sequence[str],
    *,
    world_size: int,
    num_threads: int,
    log_path: Path,
    alone: bool = False,
    gpus: Sequence[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `world_size` ranks of the rank program `module` under torchrun on this node (a
    free rendezvous port), logging to `log_path`; torchrun ties its ranks to itself. `alone`:
    nothing else busy shares the machine (see `thread_env`). `gpus`: the ranks'
    CUDA_VISIBLE_DEVICES, in which each rank takes the entry its LOCAL_RANK indexes
    (trainer/parallel.py); None: the environment's."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "-m",
        module,
        *args,
    ]
    cuda = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else {}
    return spawn(cmd, log_path, env={**os.environ, **thread_env(num_threads, alone=alone), **cuda})


def thread_env(num_threads: int, *, alone: bool = False) -> dict[str, str]:
    """A rank's OpenMP settings: its thread count, and how its waiting threads wait, unless the
    environment says otherwise. Beside other busy processes (an RL trainer beside its replicas)
    they sleep: spinning ones take the cores the others need, and a rank beside one busy core
    slowed several times over. Alone (`lockgate sft`) they spin: sleeping ones cost a small
    model's SFT a good part of its speed, a thread woken for each of its many short
    operations (both measured in docs/performance.md, "Coordinator: launching on a CPU
    machine"). libgomp spins only while it manages no more threads
    than there are cores, so nothing else in a rank may run OpenMP on a thread of its own
    (trainer/checkpoint.py)."""
    return {
        "OMP_NUM_THREADS": str(num_threads),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "ACTIVE" if alone else "PASSIVE"),
    }


class TrainerError(RunFailed):
    """The trainer failed a step or died; the message carries its traceback or log tail."""


class TrainerProcess:
    """The trainer ranks under torchrun on this machine. Subclasses place them elsewhere (Ray:
    coordinator/launch/ray/trainer.py) by overriding `_launch`, `_exit_code` and `_shutdown`; the file
    protocol, and so the loop's view of the trainer, stays the same."""

    def __init__(
        self,
        config: TrainerConfig,
        run_dir: Path,
        log_path: Path,
        startup_timeout_s: float = 300.0,
        gpus: Sequence[str] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        # The ranks' GPUs on this node (coordinator/launch/placement.py); None: the environment's.
        self.gpus = gpus
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready_by = 0.0

    def start(self) -> None:
        """Launch the ranks and wait until they are ready for a step."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Launch the ranks without waiting for them (`wait_ready` does): a run starts its
        gateways meanwhile."""
        # A fresh protocol state: stale batches or a STOP from an earlier run would confuse ranks.
        for folder in (protocol.batches_dir(self.run_dir), protocol.results_dir(self.run_dir)):
            shutil.rmtree(folder, ignore_errors=True)
        stale = (protocol.STOP, protocol.READY, protocol.COMMITTED, protocol.FAILED)
        for name in (*stale, protocol.EXPORT_LAYOUT):
            (self.run_dir / name).unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        protocol.write_atomic(
            protocol.config_path(self.run_dir), self.config.model_dump_json(indent=2)
        )
        self._launch()
        self._ready_by = time.monotonic() + self.startup_timeout_s

    def wait_ready(self) -> None:
        """Wait until the launched ranks are ready, within `startup_timeout_s` of the launch."""
        while not (self.run_dir / protocol.READY).exists():
            self._check_alive()
            if time.monotonic() > self._ready_by:
                self.stop()
                raise TrainerError(
                    f"trainer not ready after {self.startup_timeout_s:.0f}s:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def _launch(self) -> None:
        """Start every rank of `lockgate.trainer.rl.main` on this run dir."""
        self._proc = spawn_ranks(
            "lockgate.trainer.rl.main",
            ["--run-dir", str(self.run_dir)],
            world_size=self.config.world_size,
            num_threads=self.config.num_threads,
            log_path=self.log_path,
            gpus=self.gpus,
        )

    def _started(self) -> bool:
        return self._proc is not None

    def _exit_code(self) -> int | None:
        """None while the ranks run; else the exit code of the first one known to have ended."""
        assert self._proc is not None
        return self._proc.poll()

    def _shutdown(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to exit after STOP, then kill what is left."""
        proc, self._proc = self._proc, None
        assert proc is not None
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        terminate(proc)

    def resumed_step(self) -> int:
        """The step whose checkpoint the trainer resumed from; 0 for a fresh start.

        Valid once `start()` has returned. The next batch must be step `resumed_step() + 1`, and
        after a resume the weights of that step are at `protocol.snapshot_dir(run_dir, step)`.
        """
        _, step = protocol.parse_ready((self.run_dir / protocol.READY).read_text())
        return step

    def snapshot_dir(self, step: int) -> Path:
        """Where the trainer exported (or, after a resume, re-exported) step's weights."""
        return protocol.snapshot_dir(self.run_dir, step)

    def _check_alive(self) -> None:
        if not self._started():
            raise TrainerError("trainer not started")
        code = self._exit_code()
        if code is not None:
            failed = self.run_dir / protocol.FAILED
            why = f" ({failed.read_text().strip()})" if failed.exists() else ""
            raise TrainerError(f"trainer exited with code {code}{why}:\n{log_tail(self.log_path)}")

    async def train_step(self, batch: TrainBatch) -> StepResult:
        protocol.write_atomic(
            protocol.batch_path(self.run_dir, batch.step), batch.model_dump_json()
        )
        result = protocol.result_path(self.run_dir, batch.step)
        error = protocol.error_path(self.run_dir, batch.step)
        while not result.exists():
            if error.exists():
                raise TrainerError(f"trainer failed step {batch.step}: {error.read_text()}")
            self._check_alive()
            await asyncio.sleep(0.02)
        # The batch is consumed: drop it so a long run does not fill the disk with JSON.
        protocol.batch_path(self.run_dir, batch.step).unlink(missing_ok=True)
        return StepResult.model_validate_json(result.read_text())

    async def send_weights(self, request: SendWeights) -> WeightsSent:
        """Have rank 0 send step's weights over the collective transport's group; returns when
        they are sent. Bounded: the trainer's own collectives fail after the group's timeout,
        so an answer that never comes means a trainer that stopped answering."""
        step = request.step
        sent, error = (
            protocol.sent_path(self.run_dir, step),
            protocol.send_error_path(self.run_dir, step),
        )
        for stale in (sent, error):
            stale.unlink(missing_ok=True)
        protocol.write_atomic(
            protocol.send_request_path(self.run_dir, step), request.model_dump_json()
        )
        deadline = time.monotonic() + 3 * request.group.timeout_s + 30
        while not sent.exists():
            if error.exists():
                raise TrainerError(
                    f"trainer failed to send step {step}'s weights: {error.read_text()}"
                )
            self._check_alive()
            if time.monotonic() > deadline:
                raise TrainerError(f"trainer did not send step {step}'s weights in time")
            await asyncio.sleep(0.02)
        return WeightsSent.model_validate_json(sent.read_text())

    def set_export_layout(self, layout: ExportLayout) -> None:
        """Snapshots from the next export on are written in `layout`."""
        protocol.write_atomic(self.run_dir / protocol.EXPORT_LAYOUT, layout.model_dump_json())

    def commit(self, step: int) -> None:
        """Say that everything about steps <= `step` is recorded: their checkpoint may be written.

        A checkpoint due at step k waits for this, so a resume never starts after a step whose
        records a kill lost.
        """
        protocol.write_atomic(self.run_dir / protocol.COMMITTED, f"{step}\n")

    def stop(self, grace_s: float = 60.0) -> None:
        # The grace covers the last step's checkpoint, written once STOP follows its commit.
        if not self._started():
            return
        protocol.write_atomic(self.run_dir / protocol.STOP, "")
        # Ranks still loading read STOP only once ready; they have no step to finish and no
        # checkpoint to write (a run whose gateway failed to start, or stopped at once).
        ready = (self.run_dir / protocol.READY).exists()
        self._shutdown(grace_s if ready else 0.0)
