"""The trainer rank program: `torchrun ... -m lockgate.trainer.rl.main --run-dir DIR`.

Every rank loads the policy (and, with a KL penalty, a frozen reference copy), shards it with
FSDP2, resumes from the newest checkpoint if asked, and then serves steps through the file
protocol in `protocol.py`: wait for step k's batch, train, export a weight snapshot, answer;
checkpoint a due step once the coordinator has committed it.
Rank 0 decides what comes next (a checkpoint, a batch or STOP) and tells the others, so all
ranks always agree on which collective they enter.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from lockgate.trainer import protocol
from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.checkpoint import (
    save_checkpoint,
)
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.export import prune_snapshots, snapshot_image
from lockgate.trainer.model import load_policy
from lockgate.trainer.parallel import Distributed, init_distributed, shard_model
from lockgate.trainer.precision import choose_compute_dtype, read_cpu_info
from lockgate.trainer.rank import (
    die_with_launcher,
    export_adapter,
    export_model,
    full_state_dict,
    record_failure,
    restore_or_clear,
)
from lockgate.trainer.step import build_optimizer, train_step
from lockgate.trainer.weights_sender import WeightsSender

log = logging.getLogger("lockgate.trainer")
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1


Next = Literal["batch", "checkpoint", "stop"]


def _next_action(run_dir: Path, step: int, due: int, world: Distributed) -> Next:
    """Block until there is something to do: checkpoint the due step (0: none) once committed,
    train step's batch, or stop. Rank 0 decides for all, so every rank enters the same
    collective.
    """
    decision: list[Next] = ["stop"]
    if world.is_main:
        while True:
            batch = protocol.batch_path(run_dir, step).exists()
            stop = not batch and (run_dir / protocol.STOP).exists()
            # Read after looking for the batch and STOP: the coordinator commits a step before
            # it writes either, so a commit that came first is never missed.
            if due and protocol.committed_step(run_dir) >= due:
                decision = ["checkpoint"]
                break
            if batch:
                decision = ["batch"]
                break
            if stop:
                break
            time.sleep(_POLL_S)
    dist.broadcast_object_list(decision, src=0)  # type: ignore[arg-type]
    return decision[0]


def _export(
    model: torch.nn.Module,
    config: TrainerConfig,
    run_dir: Path,
    step: int,
    world: Distributed,
    sender: WeightsSender | None,
) -> str:
    """Collective: step's weights where the replicas will take them from: a snapshot (its
    path), with LoRA the adapter dir in the snapshot's place, or with the collective transport
    the image rank 0 holds for the sender (no path)."""
    out = protocol.snapshot_dir(run_dir, step)
    if config.lora is not None:
        export_adapter(model, config.lora, config.model_dir, out, world)
    else:
        layout = protocol.export_layout(run_dir) if world.is_main else None
        if config.weights == "collective":
            state = full_state_dict(model)
            if sender is not None:
                sender.hold(step, snapshot_image(state, layout))
            return ""
        export_model(model, config.model_dir, out, world, layout)
    if world.is_main:
        prune_snapshots(out.parent, config.keep_snapshots, step)
    return str(out)


def _reference_model(config: TrainerConfig, world: Distributed) -> torch.nn.Module | None:
    """The frozen initial policy for the KL penalty, sharded like the policy; None without one."""
    if config.kl_coef == 0:
        return None
    # model_dir holds the initial weights even when the policy resumes from a checkpoint.
    reference = load_policy(config.model_dir, world.device).eval().requires_grad_(False)
    shard_model(reference, world.mesh, compute_dtype=config.compute_dtype)
    return reference


def _train_one(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    config: TrainerConfig,
    run_dir: Path,
    step: int,
    world: Distributed,
    sender: WeightsSender | None,
) -> StepResult:
    batch = TrainBatch.model_validate_json(protocol.batch_path(run_dir, step).read_text())
    if batch.step != step:
        raise ValueError(f"batch file of step {step} holds step {batch.step}")
    metrics = train_step(policy, optimizer, batch, config, world, reference)
    started = time.perf_counter()
    weights = _export(policy, config, run_dir, step, world, sender)
    metrics["export_time_s"] = time.perf_counter() - started
    return StepResult(step=step, weights_dir=weights, metrics=metrics)


def _start_rank(config: TrainerConfig, world: Distributed) -> TrainerConfig:
    """Set this rank's threads and seed; `config` with `compute_dtype: auto` resolved for its
    device and CPU, the choice logged once."""
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    choice = choose_compute_dtype(
        config.compute_dtype,
        device=world.device.type,
        cpu=read_cpu_info(),
        packed=world.pack,
        float32_rollouts=True,
    )
    if world.is_main:
        log.info(choice.line())
    return config.model_copy(update={"compute_dtype": choice.dtype})


def serve(run_dir: Path) -> None:
    config = TrainerConfig.model_validate_json(protocol.config_path(run_dir).read_text())
    world = init_distributed(config.device, config.micro_batch_packing)
    config = _start_rank(config, world)
    policy = load_policy(config.model_dir, world.device, config.lora)
    shard_model(
        policy,
        world.mesh,
        activation_checkpointing=config.activation_checkpointing,
        compute_dtype=config.compute_dtype,
    )
    reference = _reference_model(config, world)
    optimizer = build_optimizer(policy, config)
    resumed = restore_or_clear(
        protocol.checkpoints_dir(run_dir),
        resume=config.resume,
        fresh_from=config.model_dir,
        policy=policy,
        optimizer=optimizer,
        world=world,
    )
    sender = _weights_sender(config, run_dir, world)
    if resumed:
        # The snapshot of step N may have been pruned since; the coordinator syncs replicas to it.
        _export(policy, config, run_dir, resumed, world, sender)
    _announce_ready(run_dir, world, resumed)

    step, due = resumed + 1, 0
    checkpoint_s: float | None = None  # the last checkpoint's time, reported with the next step
    while (action := _next_action(run_dir, step, due, world)) != "stop":
        if action == "checkpoint":
            started = time.perf_counter()
            save_checkpoint(
                protocol.checkpoints_dir(run_dir),
                due,
                policy,
                optimizer,
                world,
                keep=config.keep_checkpoints,
            )
            checkpoint_s, due = time.perf_counter() - started, 0
            continue
        if due:
            log.warning(
                "step %d's batch came before step %d was committed: no checkpoint", step, due
            )
            due = 0
        try:
            result = _train_one(policy, reference, optimizer, config, run_dir, step, world, sender)
        except Exception:
            protocol.write_atomic(
                protocol.error_path(run_dir, step), f"rank {world.rank}:\n{traceback.format_exc()}"
            )
            raise
        if checkpoint_s is not None:
            result.metrics["checkpoint_time_s"], checkpoint_s = checkpoint_s, None
        if world.is_main:
            protocol.write_atomic(protocol.result_path(run_dir, step), result.model_dump_json())
            log.info(
                "step %d: loss %.4f, %.2fs",
                step,
                result.metrics["loss"],
                result.metrics["step_time_s"],
            )
        if config.checkpoint_every and step % config.checkpoint_every == 0:
            due = step
        step += 1
    if due:
        log.info("stopping with step %d uncommitted: no checkpoint of it", due)
    if sender is not None:
        sender.stop()
    dist.destroy_process_group()


def _announce_ready(run_dir: Path, world: Distributed, resumed: int) -> None:
    """Collective: once every rank holds the model, rank 0 says so (protocol.py `ready`)."""
    dist.barrier()
    if world.is_main:
        protocol.write_atomic(
            run_dir / protocol.READY, protocol.ready_text(world.world_size, resumed)
        )
        log.info(
            "trainer ready: %d rank(s) on %s, next step %d",
            world.world_size,
            world.device.type,
            resumed + 1,
        )


def _weights_sender(
    config: TrainerConfig, run_dir: Path, world: Distributed
) -> WeightsSender | None:
    """Rank 0's sender of the collective transport, serving requests; None elsewhere."""
    if config.weights != "collective" or not world.is_main:
        return None
    shutil.rmtree(protocol.send_request_path(run_dir, 0).parent, ignore_errors=True)
    sender = WeightsSender(run_dir)
    sender.start()
    return sender


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    parser = argparse.ArgumentParser(prog="python -m lockgate.trainer.rl.main")
    parser.add_argument("--run-dir", type=Path, required=True, help="holds config.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        serve(args.run_dir)
    except Exception as exc:
        record_failure(args.run_dir / protocol.FAILED, exc)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
