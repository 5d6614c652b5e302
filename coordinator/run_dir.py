"""A run directory's layout: every file and folder a run writes, named in one place.

```
RUN_DIR/
├── config.json                 the run's config as resolved (`lockgate train --resume` reads it)
├── metrics.jsonl               one record per trainer step (gateway/records/metrics_file.py)
├── loop_state.jsonl            the loop's resumable state, one line per step (loop/state.py)
├── trajectories.sqlite         the training gateway's store
├── val_trajectories.sqlite     the validation gateway's store (greedy rollouts)
├── gateway_config.json         the training gateway's config (without the admin token)
├── enrolment.json              with loop.rollouts: client, where and how clients enrol sessions
│                               (the gateway's URL, the enrolment key, the group size; mode 0600)
├── val_gateway_config.json     the validation gateway's config
├── report/                     `lockgate report`'s default output
├── tensorboard/                the TensorBoard sink's event files
├── wandb/, wandb_run_id        W&B's own files, and the run id a resume continues
├── logs/
│   ├── gateway.log, val_gateway.log, trainer.log (on Ray also trainer.rankN.log)
│   ├── replicaN.log            the local vLLM replicas
│   └── agents/                 one stderr log per command rollout
└── trainer/                    the trainer's own folder (its names: trainer/protocol.py)
    ├── config.json             the trainer's config
    ├── batches/, results/      one file per step each way
    ├── weights/step_K/         the snapshot the replicas load for version K
    ├── checkpoints/step_K/     the trainer's checkpoints
    └── ready, committed, failed, STOP, export_layout.json
```

The trainer imports nothing of ours, so `lockgate.trainer.protocol` stays the owner of the
names inside `trainer/` and `RunDir` reads them through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lockgate.trainer import protocol

GATEWAY = "gateway"
VAL_GATEWAY = "val_gateway"
VAL_PREFIX = "val_"  # the validation gateway's files: its store and its config


@dataclass(frozen=True)
class RunDir:
    path: Path

    # -- the coordinator's files -------------------------------------------------------------

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def loop_state(self) -> Path:
        return self.path / "loop_state.jsonl"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb_run_id(self) -> Path:
        return self.path / "wandb_run_id"

    @property
    def enrolment(self) -> Path:
        """Client-driven runs: the gateway's URL, the enrolment key and the group size."""
        return self.path / "enrolment.json"

    # -- the gateways' files -----------------------------------------------------------------

    @property
    def store(self) -> Path:
        return self.store_named("trajectories.sqlite")

    @property
    def val_store(self) -> Path:
        return self.store_named(VAL_PREFIX + self.store.name)

    def store_named(self, name: str) -> Path:
        """A store file of the run by its file name (`lockgate view --store`)."""
        return self.path / name

    def gateway_config_of(self, name: str) -> Path:
        """The config file of the gateway named `name` (GATEWAY or VAL_GATEWAY)."""
        return self.path / f"{name}_config.json"

    @property
    def base_adapter(self) -> Path:
        """A LoRA run's zero adapter, under which its gateways serve version 0 (the base
        model; trainer/lora.py `write_zero_adapter` says why)."""
        return self.path / "base_adapter"

    @property
    def gateway_config(self) -> Path:
        return self.gateway_config_of(GATEWAY)

    @property
    def val_gateway_config(self) -> Path:
        return self.gateway_config_of(VAL_GATEWAY)

    def config_of_store(self, store: Path) -> Path:
        """The config of the gateway that writes `store`: the validation gateway's for a
        validation store, the training gateway's for any other."""
        return self.val_gateway_config if store.name.startswith(VAL_PREFIX) else self.gateway_config

    # -- logs ----------------------------------------------------------------------------------

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def log_of(self, name: str) -> Path:
        """The log of the process named `name` (a gateway's name, "trainer")."""
        return self.logs / f"{name}.log"

    @property
    def gateway_log(self) -> Path:
        return self.log_of(GATEWAY)

    @property
    def val_gateway_log(self) -> Path:
        return self.log_of(VAL_GATEWAY)

    @property
    def trainer_log(self) -> Path:
        return self.log_of("trainer")

    @property
    def agent_logs(self) -> Path:
        return self.logs / "agents"

    # -- the trainer's folder (names owned by trainer/protocol.py) -----------------------------

    @property
    def trainer(self) -> Path:
        return self.path / "trainer"

    @property
    def trainer_config(self) -> Path:
        return protocol.config_path(self.trainer)

    @property
    def batches(self) -> Path:
        return protocol.batches_dir(self.trainer)

    @property
    def results(self) -> Path:
        return protocol.results_dir(self.trainer)

    @property
    def snapshots(self) -> Path:
        return protocol.snapshots_root(self.trainer)

    def snapshot(self, step: int) -> Path:
        return protocol.snapshot_dir(self.trainer, step)

    @property
    def checkpoints(self) -> Path:
        return protocol.checkpoints_dir(self.trainer)
