"""Trainer step benchmark: one RL step's time, tokens/s and peak device memory for a
Qwen3-shaped model with random weights (built offline), through the real trainer process tree
(torchrun, FSDP2, the policy loss, AdamW, the snapshot export the replicas load).

The batch looks like an agent's: `--groups` GRPO groups of `--group-size` rollouts, each group
sharing a `--prompt` token prompt, responses of `--response` tokens on average (uniform in
[R/2, 3R/2]), advantages +-1 within a group. The first step is a warm-up and is not counted.

    python -m benchmarks.trainer_step --shape qwen3-0.6b --device cuda
    python -m benchmarks.trainer_step --shape tiny --device cpu --groups 2 --response 64

On CUDA, peak memory is the device's used memory (all processes: the trainer's, and this
process's own CUDA context, measured before the trainer starts and subtracted), polled every
20 ms; it includes what the caching allocator holds. Results: a JSON line on stdout and, with
`--json`, that file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lockgate.coordinator.launch.trainer import TrainerProcess
from lockgate.trainer.batch import TrainBatch, TrainSample
from lockgate.trainer.config import TrainerConfig
from lockgate.trainer.tiny_models.builder import ensure_tiny_model

# The published architectures of Qwen3-0.6B and Qwen3-1.7B (config.json of each), with their
# real 151,936-token vocabulary: the logits over it are a large share of a step's memory.
_QWEN3_0_6B: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3_0_6B,
    # 1.7B differs only in width
    "qwen3-1.7b": {**_QWEN3_0_6B, "hidden_size": 2048, "intermediate_size": 6144},
}


def build_model(shape: str, root: Path, model_dir: Path | None = None) -> tuple[Path, int]:
    """The model dir of `shape` (random weights, the tiny model's tokenizer files) and its
    parameter count. `tiny` is the test model itself; `model_dir` an existing model."""
    if model_dir is not None:
        out = model_dir
    elif shape == "tiny":
        out = ensure_tiny_model()
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        out = root / shape
        config = Qwen3Config(
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            attention_bias=False,
            use_sliding_window=False,
            **SHAPES[shape],
        )
        config.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(0)
        where = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(where):  # random init of ~1e9 weights is minutes on a few CPU cores
            model = Qwen3ForCausalLM(config).to(torch.float32)
        model.save_pretrained(str(out), safe_serialization=True)
        del model
        tiny = ensure_tiny_model()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tiny / name).exists():
                shutil.copy(tiny / name, out / name)
    config_json = json.loads((out / "config.json").read_text())
    return out, parameter_count(config_json)


def parameter_count(c: dict[str, Any]) -> int:
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * head_dim  # q/k/v/o + q_norm, k_norm
    mlp = 3 * h * c["intermediate_size"]
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
    return layers * (attention + mlp + 2 * h) + embeddings + h


def make_batch(
    step: int, vocab: int, groups: int, group_size: int, prompt: int, response: int
) -> TrainBatch:
    rng = random.Random(step)
    samples = []
    for _ in range(groups):
        shared = [rng.randrange(vocab) for _ in range(prompt)]
        for i in range(group_size):
            n = rng.randint(response // 2, response * 3 // 2)
            advantage = 1.0 if i % 2 else -1.0
            samples.append(
                TrainSample(
                    input_ids=shared + [rng.randrange(vocab) for _ in range(n)],
                    loss_mask=[0] * prompt + [1] * n,
                    rollout_logprobs=[0.0] * prompt + [-8.0] * n,
                    advantages=[0.0] * prompt + [advantage] * n,
                )
            )
    return TrainBatch(step=step, samples=samples)


class DeviceMemoryPeak:
    """Polls the device's used memory in a thread; `peak_gib` is above the starting level."""

    def __init__(self) -> None:
        self.enabled = torch.cuda.is_available()
        self.base = self._used() if self.enabled else 0
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._used())

    def __enter__(self) -> DeviceMemoryPeak:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()

    @property
    def peak_gib(self) -> float | None:
        return (self.peak - self.base) / 2**30 if self.enabled else None


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    started = time.perf_counter()
    model_dir, params = build_model(args.shape, root, args.model_dir)
    build_s = time.perf_counter() - started
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    config = TrainerConfig(
        model_dir=model_dir,
        world_size=1,
        device=args.device,
        lr=1e-6,
        micro_batch_tokens=args.micro_batch_tokens,
        activation_checkpointing=args.activation_checkpointing,
        micro_batch_packing=args.packing,
        ppo_mode=args.ppo_mode,
        num_threads=args.threads,
    )
    run_dir = root / "run"
    with DeviceMemoryPeak() as memory:
        started = time.perf_counter()
        trainer = TrainerProcess(config, run_dir, run_dir / "trainer.log")
        trainer.start()
        start_s = time.perf_counter() - started
        steps = []
        try:
            for step in range(1, args.steps + 1):
                batch = make_batch(
                    step, vocab, args.groups, args.group_size, args.prompt, args.response
                )
                tokens = sum(len(s.input_ids) for s in batch.samples)
                result = await trainer.train_step(batch)
                m = result.metrics
                steps.append(
                    {
                        "step": step,
                        "tokens": tokens,
                        "step_time_s": m["step_time_s"],
                        "export_time_s": m["export_time_s"],
                        "micro_batches": m["micro_batches"],
                    }
                )
                print(
                    f"step {step}/{args.steps}: {tokens} tokens, train {m['step_time_s']:.2f} s "
                    f"({tokens / m['step_time_s']:.0f} tok/s), export {m['export_time_s']:.2f} s",
                    flush=True,
                )
        finally:
            trainer.stop()
    timed = steps[1:] or steps
    step_s = statistics.mean(s["step_time_s"] for s in timed)
    tokens = statistics.mean(s["tokens"] for s in timed)
    return {
        "shape": str(args.model_dir) if args.model_dir else args.shape,
        "packing": args.packing,
        "parameters": params,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "batch": {
            "groups": args.groups,
            "group_size": args.group_size,
            "prompt": args.prompt,
            "response_mean": args.response,
        },
        "micro_batch_tokens": args.micro_batch_tokens,
        "activation_checkpointing": args.activation_checkpointing,
        "ppo_mode": args.ppo_mode,
        "build_s": round(build_s, 1),
        "trainer_start_s": round(start_s, 1),
        "step_time_s": round(step_s, 3),
        "tokens_per_s": round(tokens / step_s),
        # 6 N per token (forward + backward of the weights; attention's own FLOPs left out)
        "model_tflops": round(6 * params * tokens / step_s / 1e12, 1),
        "export_time_s": round(statistics.mean(s["export_time_s"] for s in timed), 2),
        "peak_device_memory_gib": memory.peak_gib and round(memory.peak_gib, 1),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="qwen3-0.6b")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--steps", type=int, default=4, help="including one warm-up step")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--packing", choices=["auto", "packed", "per_sample"], default="auto")
    parser.add_argument("--model-dir", type=Path, help="an existing model instead of --shape")
    parser.add_argument("--ppo-mode", choices=["bypass", "decoupled"], default="bypass")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rank")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainer-step-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
