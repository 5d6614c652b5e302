"""float32 against bfloat16 compute on this CPU: training steps of the tiny offline model through
the trainer's own path (FSDP2 over gloo in a world of one, the dtype as `compute_dtype` sets it,
packed rows, AdamW), and tokens/s for each, beside the CPU's name and flags and what
`compute_dtype: auto` picks here (trainer/precision.py).

    python -m benchmarks.cpu_dtype                  # 1 thread, 8 rows of 256 tokens
    python -m benchmarks.cpu_dtype --threads 2 --steps 20
    python -m benchmarks.cpu_dtype --shape deepresearch   # the recipe's ~3.5M shape, 256 wide
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 -m benchmarks.cpu_dtype \
        --shape deepresearch                              # two ranks of 8 rows, as the drills

Under torchrun every rank trains its own `--rows` (FSDP2 over gloo) and tokens/s counts all.

The first `--warmup` steps are not counted. Figures go to benchmarks/README.md, "CPU kinds and
the dtype `auto` picks".
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from lockgate.examples.deepresearch.model import SHAPE as DEEPRESEARCH_SHAPE
from lockgate.trainer.config import ComputeDtype
from lockgate.trainer.model import forward_logits, load_policy
from lockgate.trainer.parallel import Distributed, init_distributed, shard_model
from lockgate.trainer.precision import REPORTED_FLAGS, choose_compute_dtype, read_cpu_info
from lockgate.trainer.tiny_models.builder import TinyModelSpec, ensure_tiny_model


def _tokens_per_s(dtype: ComputeDtype, args: argparse.Namespace, world: Distributed) -> float:
    torch.manual_seed(0)
    spec = (
        TinyModelSpec(name="bench-deepresearch-shape", shape=DEEPRESEARCH_SHAPE)
        if args.shape == "deepresearch"
        else None
    )
    model = load_policy(ensure_tiny_model(spec=spec), world.device)
    shard_model(model, world.mesh, compute_dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (args.rows, args.length))
    lengths = [args.length] * args.rows
    timed_s = 0.0
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        logits = forward_logits(model, ids, lengths, pack=True)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            timed_s += time.perf_counter() - started
    return world.world_size * args.rows * args.length * args.steps / timed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", choices=["tiny", "deepresearch"], default="tiny")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.set_num_threads(args.threads)
    world = init_distributed("cpu", "packed")
    cpu = read_cpu_info()
    auto = choose_compute_dtype("auto", device="cpu", cpu=cpu, packed=True, float32_rollouts=False)
    # Each dtype twice, alternating, the faster of its two kept: neither gains from going second.
    rates: dict[str, float] = {}
    for dtype in ("float32", "bfloat16", "bfloat16", "float32"):
        rates[dtype] = max(rates.get(dtype, 0.0), _tokens_per_s(dtype, args, world))
    if not world.is_main:
        return
    print(
        json.dumps(
            {
                "cpu": cpu.model_name,
                "flags": [f for f in REPORTED_FLAGS if f in cpu.flags],
                "shape": args.shape,
                "ranks": world.world_size,
                "threads": args.threads,
                "rows": f"{args.rows}x{args.length}",
                "tokens_per_s": {k: round(v) for k, v in rates.items()},
                "auto_picks": auto.dtype,
                "faster": max(rates, key=lambda k: rates[k]),
            }
        )
    )


if __name__ == "__main__":
    main()
