"""The supervised fine-tuning rank program:
`torchrun ... -m lockgate.trainer.sft.main --config OUT/config.json [--resume]`.

`lockgate sft` writes the resolved `SFTConfig` and the tokenized conversations into OUT and
starts this on `trainer.world_size` ranks. Every rank loads the model, shards it with FSDP2 and
walks the same step plan (`sft_data.plan_steps`); each step's conversations are split across
ranks and into token-budget micro-batches exactly as an RL step's samples are (`step.py`), and
one AdamW update follows. The loss is the cross-entropy mean over the step's assistant tokens
(every trained token of the step weighs the same, whichever conversation, micro-batch or rank
it is on). Rank 0 writes `metrics.jsonl` and a progress line; checkpoints (`checkpoint.py`)
come every `checkpoint_every` steps and at the last one, and the model ends as an HF model dir
in `OUT/final/`. With `model.lora` only the adapters train (and are checkpointed); `final/`
then holds the merged model and `OUT/final_adapter/` the adapter (trainer/lora.py).

With `--resume` the newest checkpoint's step N is loaded with its optimizer and RNG; the plan is
a pure function of the data and the config, so step N + 1 trains what it would have trained
in an uninterrupted run, and `metrics.jsonl` is cut back to step N.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from lockgate.trainer.checkpoint import save_checkpoint
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.loss import sample_weights, token_logprobs
from lockgate.trainer.model import forward_logits, load_policy, pad_batch
from lockgate.trainer.parallel import Distributed, init_distributed, shard_model
from lockgate.trainer.precision import choose_compute_dtype, read_cpu_info
from lockgate.trainer.protocol import write_atomic
from lockgate.trainer.rank import (
    die_with_launcher,
    export_adapter,
    export_model,
    record_failure,
    restore_or_clear,
)
from lockgate.trainer.sft.config import SFTConfig, SFTLayout
from lockgate.trainer.sft.data import Example, StepPlan, plan_steps, read_examples
from lockgate.trainer.sft.exact_match import exact_rows
from lockgate.trainer.sft.stop import requirement_missed, stop_reason
from lockgate.trainer.step import (
    accumulate_and_step,
    build_optimizer,
    filler_sample,
    rank_micro_batches,
    set_learning_rate,
)

log = logging.getLogger("lockgate.sft")


def _forward(
    policy: torch.nn.Module, examples: Sequence[Example], idx: list[int], world: Distributed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batch's logits, padded ids and loss mask."""
    ids = pad_batch([examples[i].input_ids for i in idx], torch.long, world.device)
    mask = pad_batch([examples[i].loss_mask for i in idx], torch.float32, world.device)
    lengths = [len(examples[i].input_ids) for i in idx]
    return forward_logits(policy, ids, lengths, pack=world.pack), ids, mask


def _weighted_logprob_sum(
    policy: torch.nn.Module,
    examples: Sequence[Example],
    idx: list[int],
    weights: list[float],
    world: Distributed,
) -> torch.Tensor:
    """sum over the micro-batch's trained tokens of weight(sample) * log p(token)."""
    logits, ids, mask = _forward(policy, examples, idx, world)
    w = torch.tensor(weights, dtype=torch.float32, device=world.device)[:, None]
    return (token_logprobs(logits, ids) * mask * w).sum()


def sft_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    examples: Sequence[Example],
    step: int,
    config: TrainerConfig,
    world: Distributed,
) -> dict[str, float]:
    """One optimizer step on `examples` (the whole step's, on every rank)."""
    lengths = [len(e.input_ids) for e in examples]
    counts = [sum(e.loss_mask) for e in examples]
    # 1 / (the step's trained tokens) each: the loss is the mean over the whole step.
    weights = sample_weights(counts, "token-mean")
    lr = set_learning_rate(optimizer, config, step)
    indices = list(range(len(examples)))
    plan = rank_micro_batches(indices, lengths, config.micro_batch_tokens, world)
    filler = [filler_sample(indices, lengths)]
    loss = torch.zeros((), dtype=torch.float64)

    def micro_loss(mb: list[int] | None) -> torch.Tensor:
        nonlocal loss
        idx = mb if mb is not None else filler
        w = [weights[i] if mb is not None else 0.0 for i in idx]
        part = -_weighted_logprob_sum(policy, examples, idx, w, world)
        loss += part.detach().double().cpu()
        return part

    policy.train()
    grad_norm = accumulate_and_step(
        policy, optimizer, plan, micro_loss, grad_clip=config.grad_clip, world=world
    )
    dist.all_reduce(loss)
    return {
        "loss": float(loss.item()),
        "tokens": float(sum(lengths)),
        "trained_tokens": float(sum(counts)),
        "lr": lr,
        "grad_norm": grad_norm,
        "micro_batches": float(len(plan)),
    }


@torch.no_grad()
def eval_held_out(
    policy: torch.nn.Module, examples: Sequence[Example], config: TrainerConfig, world: Distributed
) -> tuple[float, float]:
    """The cross-entropy mean over the assistant tokens of `examples`, and the fraction of
    them (those with an assistant token) reproduced exactly (`exact_match.exact_rows`), split
    across ranks."""
    policy.eval()
    lengths = [len(e.input_ids) for e in examples]
    indices = list(range(len(examples)))
    # -sum of logprobs, tokens, conversations matched exactly, conversations with a token.
    totals = torch.zeros(4, dtype=torch.float64)
    filler = [filler_sample(indices, lengths)]
    for mb in rank_micro_batches(indices, lengths, config.micro_batch_tokens, world):
        logits, ids, mask = _forward(policy, examples, mb if mb is not None else filler, world)
        if mb is None:
            continue  # the filler keeps this rank's collectives in step; it counts nothing
        totals[0] -= (token_logprobs(logits, ids) * mask).sum().double().cpu()
        totals[1] += float(mask.sum())
        scored = mask.sum(dim=1) > 0
        totals[2] += float((exact_rows(logits, ids, mask) & scored).sum())
        totals[3] += float(scored.sum())
    dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp_min(1.0)), float(totals[2] / totals[3].clamp_min(1.0))


class _Progress:
    """Rank 0's metrics records and progress lines."""

    def __init__(self, layout: SFTLayout, resumed: int, total: int, log_every: int) -> None:
        self.path, self.total, self.log_every = layout.metrics, total, log_every
        self.elapsed = self._keep_records_through(resumed)
        self.window_tokens, self.window_s, self.started, self.done = 0.0, 0.0, time.monotonic(), 0

    def _keep_records_through(self, step: int) -> float:
        """Cut records after `step` (they describe work about to be redone); the elapsed time
        of the last kept one, so `time/elapsed_s` continues across a resume."""
        if not self.path.exists():
            return 0.0
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept))
        return float(json.loads(kept[-1])["time/elapsed_s"]) if kept else 0.0

    def record(self, step: int, epoch: int, metrics: dict[str, float], step_s: float) -> None:
        self.elapsed += step_s
        self.done += 1
        record = {"step": step, "sft/epoch": epoch, **{f"sft/{k}": v for k, v in metrics.items()}}
        record |= {"time/step_s": step_s, "time/elapsed_s": self.elapsed, "time/unix": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.window_tokens += metrics["tokens"]
        self.window_s += step_s
        if step % self.log_every == 0 or step == self.total:
            self._line(step, epoch, metrics)

    def _line(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        per_step = (time.monotonic() - self.started) / self.done
        eta = int(per_step * (self.total - step))
        val = f" val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
        if "val_exact_match" in metrics:
            val += f" val_exact_match {metrics['val_exact_match']:.3f}"
        print(
            f"sft step {step}/{self.total} epoch {epoch}: loss {metrics['loss']:.4f}{val} "
            f"lr {metrics['lr']:.2e} {self.window_tokens / max(self.window_s, 1e-9):.0f} tok/s "
            f"eta {eta // 60}m{eta % 60:02d}s",
            file=sys.stderr,
            flush=True,
        )
        self.window_tokens, self.window_s = 0.0, 0.0


def _plan(config: SFTConfig, examples: Sequence[Example]) -> list[StepPlan]:
    loop = config.loop
    plan = plan_steps(
        [len(e.input_ids) for e in examples],
        batch_size=loop.batch_size,
        batch_unit=loop.batch_unit,
        epochs=loop.epochs,
        shuffle=loop.shuffle,
        seed=config.trainer.seed,
    )
    return plan[: loop.max_steps] if loop.max_steps is not None else plan


def _recorded_losses(
    layout: SFTLayout, through: int, world: Distributed
) -> tuple[list[float], list[tuple[float, float]], list[float]]:
    """The held-out losses, each step's (training loss, trained tokens) and the held-out
    exact matches that rank 0 recorded up to step `through`, on every rank."""
    val: list[float] = []
    steps: list[tuple[float, float]] = []
    exact: list[float] = []
    if world.is_main and through > 0 and layout.metrics.exists():
        records = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line]
        kept = [r for r in records if r["step"] <= through]
        val = [float(r["sft/val_loss"]) for r in kept if "sft/val_loss" in r]
        steps = [(float(r["sft/loss"]), float(r["sft/trained_tokens"])) for r in kept]
        exact = [float(r["sft/val_exact_match"]) for r in kept if "sft/val_exact_match" in r]
    shared = [(val, steps, exact)]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _with_compute_dtype(trainer: TrainerConfig, world: Distributed) -> TrainerConfig:
    """`trainer` with `compute_dtype: auto` resolved for this rank's device and CPU; rank 0
    prints the choice as a progress line, which `lockgate sft` echoes."""
    choice = choose_compute_dtype(
        trainer.compute_dtype,
        device=world.device.type,
        cpu=read_cpu_info(),
        packed=world.pack,
        float32_rollouts=False,
    )
    if world.is_main:
        print(f"sft {choice.line()}", file=sys.stderr, flush=True)
    return trainer.model_copy(update={"compute_dtype": choice.dtype})


def train(config: SFTConfig, *, resume: bool) -> str | None:
    """Run the plan (or resume it); why the run fails `loop.require`, or None."""
    layout = config.layout
    trainer = config.trainer.to_trainer_config(config.model_dir, config.model.lora)
    world = init_distributed(trainer.device, trainer.micro_batch_packing)
    torch.set_num_threads(trainer.num_threads)
    torch.manual_seed(trainer.seed)
    trainer = _with_compute_dtype(trainer, world)
    examples = read_examples(layout.train_data)
    val = read_examples(layout.val_data) if config.data.val_path is not None else []
    plan = _plan(config, examples)
    policy = load_policy(config.model_dir, world.device, trainer.lora)
    shard_model(
        policy,
        world.mesh,
        activation_checkpointing=trainer.activation_checkpointing,
        compute_dtype=trainer.compute_dtype,
    )
    optimizer = build_optimizer(policy, trainer)
    start = restore_or_clear(
        layout.checkpoints,
        resume=resume,
        fresh_from=config.model_dir,
        policy=policy,
        optimizer=optimizer,
        world=world,
    )
    losses, steps, exact = _recorded_losses(layout, start, world)
    progress = _Progress(layout, start, len(plan), config.loop.log_every) if world.is_main else None
    every = config.loop.val_every
    # A run that stopped early checkpointed the step it stopped at: resumed from there, the
    # losses recorded up to it say stop again (from an earlier checkpoint they cannot, or the
    # run would have stopped there).
    last = start
    reason = stop_reason(losses, config.loop, steps, exact) if start else None
    end = start if reason else len(plan)
    for step in range(start + 1, end + 1):
        started = time.perf_counter()
        batch = [examples[i] for i in plan[step - 1].indices]
        metrics = sft_step(policy, optimizer, batch, step, trainer, world)
        steps.append((metrics["loss"], metrics["trained_tokens"]))
        if val and ((every and step % every == 0) or step == len(plan)):
            metrics["val_loss"], metrics["val_exact_match"] = eval_held_out(
                policy, val, trainer, world
            )
            losses.append(metrics["val_loss"])
            exact.append(metrics["val_exact_match"])
        reason = stop_reason(losses, config.loop, steps, exact)
        if progress is not None:
            progress.record(step, plan[step - 1].epoch, metrics, time.perf_counter() - started)
        last = step
        if trainer.checkpoint_every and (
            step % trainer.checkpoint_every == 0 or step == len(plan) or reason
        ):
            save_checkpoint(
                layout.checkpoints, step, policy, optimizer, world, keep=trainer.keep_checkpoints
            )
        if reason:
            break
    _export_final(policy, config, world)
    if world.is_main:
        why = f" ({reason})" if reason else ""
        print(f"sft done: {last} steps{why}, model in {layout.final}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return requirement_missed(losses, exact, config.loop, last)


def _export_final(policy: torch.nn.Module, config: SFTConfig, world: Distributed) -> None:
    """Collective: the trained model as an HF model dir in final/, which every later stage
    loads as it would a fully fine-tuned one; with LoRA the adapters are merged into it and
    also written as an adapter dir in final_adapter/ (what vLLM serves on the base model)."""
    layout, lora = config.layout, config.model.lora
    export_model(policy, config.model_dir, layout.final, world, merge=lora)
    if lora is not None:
        export_adapter(policy, lora, config.model_dir, layout.final_adapter, world)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    parser = argparse.ArgumentParser(prog="python -m lockgate.trainer.sft.main")
    parser.add_argument("--config", type=Path, required=True, help="OUT/config.json")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in OUT"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = SFTConfig.model_validate_json(args.config.read_text())
    try:
        missed = train(config, resume=args.resume)
    except Exception as exc:
        record_failure(config.layout.failed, exc)
        raise
    if missed is not None:
        # Every rank reached the same verdict from the same all-reduced checks; the launcher
        # reports this line as the run's failure.
        write_atomic(config.layout.failed, missed + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
