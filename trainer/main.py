"""The trainer rank program: `torchrun ... -m lockgate.trainer.main --run-dir DIR`.

Every rank loads the policy, shards it with FSDP2 and then serves steps through the file
protocol in `protocol.py`: wait for step k's batch, train, export a weight snapshot, answer.
Rank 0 decides what comes next (a batch or STOP) and tells the others, so all ranks always
agree on which collective they enter.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lockgate.trainer import protocol
from lockgate.trainer.batch import StepResult, TrainBatch
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.export import prune_snapshots, write_snapshot
from lockgate.trainer.model import load_policy
from lockgate.trainer.parallel import Distributed, init_distributed, shard_model
from lockgate.trainer.step import train_step

log = logging.getLogger("lockgate.trainer")
_POLL_S = 0.02


def _next_step(run_dir: Path, step: int, world: Distributed) -> bool:
    """Block until step's batch or STOP exists; True for a batch. Rank 0 decides for all."""
    decision = [False]
    if world.is_main:
        while True:
            if protocol.batch_path(run_dir, step).exists():
                decision = [True]
                break
            if (run_dir / protocol.STOP).exists():
                break
            time.sleep(_POLL_S)
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _export(
    model: torch.nn.Module, config: TrainerConfig, run_dir: Path, step: int, world: Distributed
) -> Path:
    # Every rank takes part in gathering the full state dict; only rank 0 receives and writes it.
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out = protocol.snapshot_dir(run_dir, step)
    if world.is_main:
        write_snapshot(state, config.model_dir, out)
        prune_snapshots(out.parent, config.keep_snapshots)
    return out


def serve(run_dir: Path) -> None:
    config = TrainerConfig.model_validate_json((run_dir / "config.json").read_text())
    world = init_distributed()
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    model = load_policy(config.model_dir, world.device)
    shard_model(model, world.mesh)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=config.eps,
    )
    dist.barrier()
    if world.is_main:
        protocol.write_atomic(run_dir / protocol.READY, f"{world.world_size}\n")
        log.info("trainer ready: %d rank(s)", world.world_size)

    step = 1
    while _next_step(run_dir, step, world):
        try:
            batch = TrainBatch.model_validate_json(protocol.batch_path(run_dir, step).read_text())
            metrics = train_step(model, optimizer, batch, config, world)
            export_started = time.perf_counter()
            weights = _export(model, config, run_dir, step, world)
            metrics["export_time_s"] = time.perf_counter() - export_started
        except Exception:
            protocol.write_atomic(
                protocol.error_path(run_dir, step), f"rank {world.rank}:\n{traceback.format_exc()}"
            )
            raise
        if world.is_main:
            result = StepResult(step=step, weights_dir=str(weights), metrics=metrics)
            protocol.write_atomic(protocol.result_path(run_dir, step), result.model_dump_json())
            log.info("step %d: loss %.4f, %.2fs", step, metrics["loss"], metrics["step_time_s"])
        step += 1
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lockgate.trainer.main")
    parser.add_argument("--run-dir", type=Path, required=True, help="holds config.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
