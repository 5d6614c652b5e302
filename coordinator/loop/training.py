"""The training loop: groups under the staleness bound, train, sync weights.

Supervised coroutines share one TaskGroup, so any failure stops the run with its traceback
instead of being lost in a done-callback:

- a source of finished groups (sources.py): the loop's own dispatch, which starts a group
  whenever the staleness controller allows it and runs its n rollouts through agent_runtime
  (dispatch.py), or clients that create their sessions themselves and finish them with rewards,
  admitted by the gateway under the same gate (client_rollouts.py); either hands each finished
  group to the loop (`collect`, then `offer`: a group too small or without variance is dropped
  there and frees its slot);
- the trainer side takes B groups per step (dropping rollouts past the max-off-policy bound),
  trains, and after every `sync_every` steps pauses the gateway, loads the new weights on every
  replica and resumes at the new version. With η >= 1 (and `sync.overlap`) that sync runs
  beside the next step: the trainer takes and trains step k+1's groups while the replicas load
  step k's weights, and waits only if sync k is still running when step k+1 is trained. The
  gate and the bound count versions the replicas really hold, so a sync that lands later only
  makes them stricter.

Synchronous (η = 0), one-step-off (η = 1) and fully-async (η > 1) runs share this one step
pipeline; only the gate differs. So do both sources of groups.

Validation (`val_every`): a round of greedy rollouts starts right after the sync of every
`val_every`-th step (and at the start) and runs beside the training rollouts; the next sync
waits for it, so training stalls only if a round outlasts a whole step. Its `val/*` metrics go
on the first step record written after it ends.

With `model.lora` (`adapters`) a step's weights are a LoRA adapter: the sync is the same pause,
load and resume, the load having the gateway (in adapter mode) load the adapter into every
replica beside the base model; the validation gateway names adapters of its own, so a round
first has it load the adapter of the version it validates.

Resume: every step appends its `LoopState` (loop_state.py) before its batch goes to the
trainer; a loop given the state of the trainer's checkpoint step syncs the replicas to that
step's weights, dispatches the groups pending at that step again, and goes on from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockgate.agent_runtime import Environment, RolloutResult, Task
from lockgate.coordinator.config import AlgorithmSection, LoopSection, SyncSection
from lockgate.coordinator.errors import RunFailed
from lockgate.coordinator.loop.dispatch import DispatchSource
from lockgate.coordinator.loop.groups import Group, Rollout, drop_reason, group_to_train_samples
from lockgate.coordinator.loop.sources import GroupSource
from lockgate.coordinator.loop.staleness import (
    StalenessController,
    drop_stale_rollouts,
    staleness_counts,
)
from lockgate.coordinator.loop.state import LoopState, append_state
from lockgate.coordinator.loop.trainer_port import Trainer
from lockgate.coordinator.loop.validation import run_validation
from lockgate.coordinator.metrics.log import MetricsLog
from lockgate.gateway.client import GatewayClient, GatewayClientError
from lockgate.gateway.records.advantages import group_reward
from lockgate.gateway.records.metrics_file import (
    STEP,
    TRAIN_PREFIX,
    VERSION,
    Batch,
    Count,
    Perf,
    Reward,
    Staleness,
    Sync,
    Time,
    count_key,
)
from lockgate.gateway.schema import CollectiveWeights, LoadReport, WeightsLayout
from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.protocol import CollectiveGroup, ExportLayout, SendWeights

log = logging.getLogger(__name__)

# Before a failed collective sync's second try: the gateway's health checks (every 2 s, out
# after 2 failures: gateway/replicas/pool.py) have then left a dead replica out of the group.
_COLLECTIVE_RETRY_WAIT_S = 5.0


class SyncFailed(RunFailed):
    """No replica took the new weights; the run stops, still serving the old version."""


@dataclass
class RunSummary:
    steps: int
    rewards: list[float]  # mean reward of each step's batch
    version: int
    elapsed_s: float
    counters: dict[str, int] = field(default_factory=dict)

    def first_last(self, k: int = 3) -> tuple[float, float]:
        k = max(1, min(k, len(self.rewards) // 2 or 1))
        first = self.rewards[:k]
        last = self.rewards[-k:]
        return sum(first) / len(first), sum(last) / len(last)


@dataclass
class Validation:
    """What validation needs: the temperature-0 gateway and the held-out tasks."""

    gateway: GatewayClient
    tasks: Sequence[Task]
    # With adapters, the weights version that gateway's calls ask for: a full sync changes the
    # weights under both gateways at once, but each gateway names the adapter it uses itself.
    version: int = 0


class TrainingLoop:
    def __init__(
        self,
        config: LoopSection,
        env: Environment,
        gateway: GatewayClient,
        trainer: Trainer,
        metrics: MetricsLog,
        *,
        algorithm: AlgorithmSection | None = None,
        sync: SyncSection | None = None,
        seed: int = 0,
        state_path: Path | None = None,
        resume: LoopState | None = None,
        validation: Validation | None = None,
        previous_rewards: Sequence[float] = (),
        source: GroupSource | None = None,
        adapters: bool = False,
    ) -> None:
        self.config = config
        # model.lora: each step's weights are a LoRA adapter the gateway has the replicas load
        # beside the base model they serve (its adapter mode), not a snapshot they reload.
        self.adapters = adapters
        self.algorithm = algorithm or AlgorithmSection()
        self.sync = sync or SyncSection()
        self.env = env
        self.gateway = gateway
        self.trainer = trainer
        self.metrics = metrics
        self.version = 0
        self.controller = StalenessController(config.groups_per_step, config.max_staleness)
        self._ready: asyncio.Queue[Group] = asyncio.Queue()
        self.version_changed = asyncio.Condition()
        self._counters: Counter[str] = Counter()
        self._gen_tokens = 0
        # Throughput is measured between step records, over everything collected meanwhile
        # (groups collected while the previous step trained count too).
        self._rate_mark = (time.monotonic(), 0)
        self._seed = seed
        self._state_path = state_path
        self._validation = validation
        self._val_task: asyncio.Task[dict[str, float]] | None = None
        self._sync_task: asyncio.Task[dict[str, float]] | None = None
        self._val_reported = False
        self._export_layout: ExportLayout | None = None  # what the trainer was last told
        self._group: CollectiveWeights | None = None  # the collective transport's, once formed
        self._group_members: list[str] = []  # the gateway's replicas when it was formed
        self._weights_dir = ""  # where the replicas' current version came from ("": the start)
        self._rewards = list(previous_rewards)
        # The task cursor (loop_state.py): serials dispatched and not yet trained or dropped.
        self._pending: set[int] = set()
        self._dropped: list[int] = []
        self._next_serial = 0
        self._first_step = 1
        self._resume = resume
        if resume is not None:
            self._first_step = resume.step + 1
            self._next_serial = resume.next_serial
            self._counters.update(resume.counters)
            # Every group trained so far holds its slot; the pending ones take theirs again.
            self.controller.groups_started = resume.step * config.groups_per_step
        # The loop's own dispatch unless the run's groups come from elsewhere (sources.py).
        self.source: GroupSource = source or DispatchSource(
            env,
            gateway,
            config,
            self.algorithm,
            redispatch=resume.pending if resume is not None else (),
        )

    async def run(self) -> RunSummary:
        started = time.monotonic()
        if self._resume is not None:
            await self._resync(self._resume.step)
        async with asyncio.TaskGroup() as tg:
            if self._validation is not None and self._resume is None:
                self._start_validation(tg)
            dispatcher = tg.create_task(self.source.run(self), name="group-source")
            try:
                for step in range(self._first_step, self.config.steps + 1):
                    self._rewards.append(await self._step(step, tg))
            finally:
                dispatcher.cancel()
                if self._val_task is not None:
                    self._val_task.cancel()
        return RunSummary(
            steps=len(self._rewards),
            rewards=self._rewards,
            version=self.version,
            elapsed_s=time.monotonic() - started,
            counters=dict(self._counters),
        )

    async def _choose_snapshot_layout(self) -> None:
        """Have the trainer write this step's snapshot in the layout the replicas load fastest.
        Asked before every batch (the gateway answers from what it knows of each replica), so
        a replica added during the run without the direct load turns snapshots back to HF.
        An adapter has no layout to choose."""
        if self.sync.snapshot_layout == "hf" or self.adapters:
            return
        try:
            layout = await self.gateway.weights_layout()
        except GatewayClientError as exc:
            log.warning("no snapshot layout from the gateway (%s): snapshots in HF layout", exc)
            layout = WeightsLayout(transposed={}, hf_because={"gateway": str(exc)})
        export = ExportLayout(transposed=layout.transposed)
        if export == self._export_layout:
            return
        self._export_layout = export
        self.trainer.set_export_layout(export)
        log.info(
            "snapshots: %d linear weights in the replicas' kernel layout%s",
            len(layout.transposed),
            f"; HF layout because {layout.hf_because}" if layout.hf_because else "",
        )

    async def _resync(self, step: int) -> None:
        """Bring fresh (or stale) replicas to the resumed step's weights before any dispatch."""
        weights = self.trainer.snapshot_dir(step)
        log.info("resume: syncing replicas to %s (version %d)", weights, step)
        await self._sync(str(weights), step)

    # -- what a source of groups uses (sources.py's GroupSink) ---------------------------------

    @property
    def next_serial(self) -> int:
        return self._next_serial

    def started(self, serial: int) -> None:
        self._pending.add(serial)
        self._next_serial = max(self._next_serial, serial + 1)

    def count(self, key: str, n: int = 1) -> None:
        self._counters[key] += n

    async def offer(self, group: Group) -> None:
        reason = drop_reason(
            group,
            min_group_size=self.config.min_group_size,
            drop_zero_variance=self.algorithm.drop_zero_variance,
        )
        if reason is not None:
            self._counters[Count.groups_dropped(reason)] += 1
            await self.release(group.serial)
            return
        await self._ready.put(group)

    async def release(self, serial: int) -> None:
        self._pending.discard(serial)
        self._dropped.append(serial)
        async with self.version_changed:
            self.controller.cancelled()
            self.version_changed.notify_all()

    async def collect(
        self, task_id: str, group_id: str, version: int, results: Sequence[RolloutResult]
    ) -> Group:
        group = Group(task_id, group_id, version, rollouts=[])
        for result in results:
            # The viewer counts a group's rollouts by the same rule (records/advantages.py).
            reward = group_reward(result.status, result.reward)
            if reward is None:
                reason = (result.error or "unknown").split(":")[0]
                group.failures[reason] = group.failures.get(reason, 0) + 1
                self._counters[Count.ROLLOUTS_FAILED] += 1
                continue
            samples = await self.gateway.samples(result.session_id)
            self._counters[Count.RERENDER_SPLITS] += samples.splits
            self._gen_tokens += sum(sum(s.loss_mask) for s in samples.samples)
            group.rollouts.append(Rollout(reward, samples))
        return group

    # -- trainer side ---------------------------------------------------------------------------

    async def _take_groups(self, step: int) -> list[Group]:
        """B groups for `step`, in completion order, after the max-off-policy bound."""
        groups: list[Group] = []
        while len(groups) < self.config.groups_per_step:
            group, stale = drop_stale_rollouts(
                await self._ready.get(), step, self.config.off_policy_bound
            )
            if stale:
                self._counters[Count.ROLLOUTS_STALE] += stale
                if drop_reason(
                    group,
                    min_group_size=self.config.min_group_size,
                    drop_zero_variance=self.algorithm.drop_zero_variance,
                ):
                    self._counters[Count.GROUPS_DROPPED_STALE] += 1
                    await self.release(group.serial)
                    continue
            groups.append(group)
        return groups

    def _save_state(self, step: int, groups: Sequence[Group]) -> None:
        trained = [g.serial for g in groups]
        self._pending.difference_update(trained)
        state = LoopState(
            step=step,
            version=self.version,
            next_serial=self._next_serial,
            pending=sorted(self._pending),
            trained=trained,
            dropped=sorted(self._dropped),
            counters=dict(self._counters),
        )
        self._dropped.clear()
        if self._state_path is not None:
            append_state(self._state_path, state)

    async def _step(self, step: int, tg: asyncio.TaskGroup) -> float:
        wait_started = time.monotonic()
        groups = await self._take_groups(step)
        wait_s = time.monotonic() - wait_started

        samples = [
            s
            for g in groups
            for s in group_to_train_samples(
                g,
                estimator=self.algorithm.estimator,
                negative_weight=self.algorithm.negative_advantage_weight,
            )
        ]
        versions = [v for g in groups for v in g.token_versions()]
        # The trainer at step k starts from weights version k-1: staleness counts versions behind.
        staleness = [(step - 1) - v for v in versions]
        # Before the batch goes out: a trainer checkpoint of this step implies its state line.
        self._save_state(step, groups)
        await self._choose_snapshot_layout()
        result: StepResult = await self.trainer.train_step(TrainBatch(step=step, samples=samples))
        train_s = result.metrics.get("step_time_s", 0.0)

        # Time the trainer side spends on syncs: waiting for the previous one to land, and for
        # this step's when it is not overlapped with the next step.
        blocked_started = time.monotonic()
        sync = await self._finish_sync()
        if step % self.config.sync_every == 0:
            self._sync_task = tg.create_task(
                self._sync_and_validate(result.weights_dir, step, tg), name=f"sync-{step}"
            )
            if not self._overlaps_sync(step):
                # After an overlapped one (the last step), the newer sync's figures win.
                sync.update(await self._finish_sync())
        sync[Time.SYNC_S] = time.monotonic() - blocked_started

        rewards = [r for g in groups for r in g.rewards]
        reward_mean = sum(rewards) / len(rewards)
        now = time.monotonic()
        mark_time, mark_tokens = self._rate_mark
        self._rate_mark = (now, self._gen_tokens)
        record: dict[str, Any] = {
            STEP: step,
            VERSION: self.version,
            Reward.MEAN: reward_mean,
            Reward.MIN: min(rewards),
            Reward.MAX: max(rewards),
            Batch.GROUPS: len(groups),
            Batch.ROLLOUTS: sum(len(g.rollouts) for g in groups),
            Batch.SAMPLES: len(samples),
            Batch.LOSS_TOKENS: sum(sum(s.loss_mask) for s in samples),
            Staleness.MEAN: sum(staleness) / max(len(staleness), 1),
            Staleness.MAX: max(staleness, default=0),
            Staleness.MIN_VERSION: min(versions, default=0),
            Staleness.HIST: staleness_counts(step, versions),
            Perf.GEN_TOKENS_PER_S: (self._gen_tokens - mark_tokens) / max(now - mark_time, 1e-9),
            Time.STEP_S: now - mark_time,
            Time.WAIT_FOR_GROUPS_S: wait_s,
            Time.TRAIN_S: train_s,
            **sync,
            **self._finished_validation(),
            **{TRAIN_PREFIX + k: v for k, v in result.metrics.items()},
            **{count_key(k): v for k, v in self._counters.items()},
        }
        self.metrics.write(record)
        # Only now may the trainer checkpoint this step: a checkpoint implies this record.
        self.trainer.commit(step)
        return reward_mean

    def _overlaps_sync(self, step: int) -> bool:
        # η = 0 must not overlap: step k+1's rollouts may only start on step k's weights, so it
        # would wait for the sync anyway, counted as waiting for groups. The last step's sync
        # lands before the run ends.
        return self.sync.overlap and self.config.max_staleness > 0 and step < self.config.steps

    async def _finish_sync(self) -> dict[str, float]:
        """Wait for the sync in flight, if any; its metrics (empty when there was none)."""
        task, self._sync_task = self._sync_task, None
        return dict(await task) if task is not None else {}

    async def _sync_and_validate(
        self, weights_dir: str, step: int, tg: asyncio.TaskGroup
    ) -> dict[str, float]:
        metrics = await self._sync(weights_dir, step)
        if self._validation is not None and step % self.config.val_every == 0:
            if step < self.config.steps:
                self._start_validation(tg)
        return metrics

    # -- validation -----------------------------------------------------------------------------

    def _start_validation(self, tg: asyncio.TaskGroup) -> None:
        assert self._validation is not None
        self._val_task = tg.create_task(
            self._validate(self._validation, self.version), name=f"validation-v{self.version}"
        )
        self._val_reported = False

    async def _validate(self, validation: Validation, version: int) -> dict[str, float]:
        if self.adapters and validation.version != version:
            # No round runs on it meanwhile: nothing of its own is cut.
            await validation.gateway.pause(self.sync.mode, self.sync.pause_timeout_s)
            await validation.gateway.load_adapter(self._weights_dir, version)
            await validation.gateway.resume(version)
            validation.version = version
        return await run_validation(
            validation.gateway,
            self.env,
            validation.tasks,
            version=version,
            concurrency=self.config.val_concurrency,
            timeout_s=self.config.rollout_timeout_s,
        )

    def _finished_validation(self) -> dict[str, float]:
        """The last round's metrics, once, on the first record after it ends."""
        task = self._val_task
        if task is None or not task.done() or self._val_reported:
            return {}
        self._val_reported = True
        return task.result()

    async def _wait_validation(self) -> float:
        """A sync must not cut a validation round: wait for it; returns the time waited."""
        task = self._val_task
        if task is None or task.done():
            return 0.0
        started = time.monotonic()
        await asyncio.shield(task)
        return time.monotonic() - started

    # -- weight sync ----------------------------------------------------------------------------

    async def _stage(self, weights_dir: str) -> float:
        """Let the replicas prepare the load while serving; a failure only costs the speed-up
        (the load then does everything itself)."""
        started = time.monotonic()
        try:
            report = await self.gateway.stage_weights(weights_dir, self.sync.stage_slice_s)
        except GatewayClientError as exc:
            log.warning("staging %s failed (the load will do it all): %s", weights_dir, exc)
        else:
            if report.not_staged:
                log.info("not staged on %s", report.not_staged)
        return time.monotonic() - started

    async def _load(self, weights_dir: str, version: int) -> LoadReport:
        """Load `version` into every replica (the gateway is paused).

        Adapters: the gateway has every replica load the adapter in `weights_dir` under the
        version's name. Disk: the gateway has every replica read the snapshot in `weights_dir`.
        Collective: `_load_collective`."""
        if self.adapters:
            return await self.gateway.load_adapter(weights_dir, version)
        if self.sync.transport == "disk":
            return await self.gateway.load_weights(weights_dir, version)
        try:
            return await self._load_collective(version, last_try=False)
        except Exception as exc:
            # Most often a replica that died since the last sync: it never joined, so no
            # member could. By now the gateway's health checks have taken it out of the
            # members of a new group.
            log.warning("collective sync to version %d failed (%s); trying once more", version, exc)
            await asyncio.sleep(_COLLECTIVE_RETRY_WAIT_S)
            return await self._load_collective(version, last_try=True)

    async def _load_collective(self, version: int, *, last_try: bool) -> LoadReport:
        """The gateway's receive on the replicas and the trainer's send, at the same time, as
        they must (each member of the group waits for the others). On the last try whichever
        fails first fails the load and the other is cancelled (its own collectives time out on
        the trainer and the replicas), so nobody waits out the other; before it, both are
        waited for, so that the trainer is free to send again."""
        source = await self._weights_group()
        group = CollectiveGroup.model_validate(source.model_dump(exclude={"transport"}))
        receive = asyncio.ensure_future(self.gateway.load_collective(source, version))
        send = asyncio.ensure_future(
            self.trainer.send_weights(SendWeights(step=version, group=group))
        )
        when = asyncio.FIRST_EXCEPTION if last_try else asyncio.ALL_COMPLETED
        done, pending = await asyncio.wait({receive, send}, return_when=when)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # The gateway's error first (it names the replica); each done task's read, so none is
        # reported as never retrieved.
        errors = [task.exception() for task in (receive, send) if task in done]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            self._group = None  # every member drops a group a transfer failed in
            raise error
        sent = send.result()
        log.info("sent version %d: %d bytes, %.2fs", version, sent.bytes, sent.send_s)
        report = receive.result()
        if report.failed:
            self._group = None
        return report

    async def _weights_group(self) -> CollectiveWeights:
        """The collective transport's group: one rank for the trainer and one per replica of
        the gateway. Formed at the first sync and kept; formed again under a new id after a
        failed load (its members dropped it) and when the gateway's replicas have changed (one
        replaced or added), since a formed group takes no new member. The id is new in every
        run too, so a replica still holding a killed run's group never mistakes it for this
        one's."""
        # The replicas a collective load goes to (gateway/sync/controller.py): the healthy.
        status = await self.gateway.status()
        replicas = [r.url for r in status.replicas if r.healthy]
        if self._group is not None and replicas == self._group_members:
            return self._group
        section = self.sync.collective
        if section.port == 0 or section.backend == "auto":
            raise RunFailed("sync.collective's port and backend are chosen at launch")
        formed_before = self._group is not None
        self._group = CollectiveWeights(
            transport="collective",
            address=section.address,
            port=section.port,
            world_size=1 + len(replicas),
            backend=section.backend,
            timeout_s=section.timeout_s,
            join_timeout_s=section.join_timeout_s,
            group_id=uuid.uuid4().hex[:16],
        )
        self._group_members = replicas
        if formed_before:
            log.info("weights group formed again (%s): %s", self._group.group_id, replicas)
        return self._group

    async def _sync(self, weights_dir: str, version: int) -> dict[str, float]:
        """(Stage ->) pause (abort | keep | drain) -> load on every replica and verify -> resume.

        `sync/duration_s` is the pause to the resume (what agents wait through); staging,
        before it, runs while they are served (`sync/stage_s`).

        A replica that fails to load leaves the rotation (the gateway's doing); if none loads,
        the gateway resumes at the version the replicas still hold and the run stops, saying
        which version is being served, rather than train on while serving stale weights.
        """
        val_wait = await self._wait_validation()
        stage_s = await self._stage(weights_dir) if self.sync.stage else 0.0
        started = time.monotonic()
        pause = await self.gateway.pause(self.sync.mode, self.sync.pause_timeout_s)
        try:
            load = await self._load(weights_dir, version)
        except GatewayClientError as exc:
            await self.gateway.resume(self.version)
            raise SyncFailed(
                f"weight sync to version {version} failed; replicas still serve version "
                f"{self.version}: {exc.message}"
            ) from exc
        except BaseException:
            # Cancelled (Ctrl-C) or the trainer failed mid-load: a replica may hold neither
            # version, and the gateway's refusal to resume (or its answer coming too late,
            # still loading) must not replace the reason for the stop with a traceback.
            try:
                await self.gateway.resume(self.version)
            except Exception as exc:
                log.warning("could not resume the gateway at version %d: %s", self.version, exc)
            raise
        if load.failed:
            self._counters[Count.REPLICAS_DROPPED] += len(load.failed)
            log.warning(
                "replicas out of rotation after failing to load %d: %s", version, load.failed
            )
        resume_started = time.monotonic()
        await self.gateway.resume(version)
        resume_s = time.monotonic() - resume_started
        self._weights_dir = weights_dir
        async with self.version_changed:
            self.version = version
            self.version_changed.notify_all()
        self._counters[Count.SYNCS] += 1
        self._counters[Count.INTERRUPTED_SEGMENTS] += pause.interrupted
        self._counters[Count.INTERRUPTED_TOKENS_KEPT] += pause.tokens_kept
        return {
            Sync.VERSION: float(version),
            Sync.DURATION_S: time.monotonic() - started,
            Sync.STAGE_S: stage_s,
            Time.SYNC_WAITED_FOR_VAL_S: val_wait,
            Sync.PAUSE_LATENCY_S: pause.latency_s,
            Sync.LOAD_S: load.load_s,
            Sync.RESUME_S: resume_s,
            Sync.INTERRUPTED: float(pause.interrupted),
            Sync.TOKENS_KEPT: float(pause.tokens_kept),
        }
