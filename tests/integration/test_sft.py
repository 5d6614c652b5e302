"""`lockgate sft`, real runs (torchrun on gloo with the tiny model): the loss falls, a resumed run
continues the same loss trajectory, world size 2 trains the same steps, the final dir is the
trained model, and bad input is a one-line error (the mask and the step plan:
tests/unit/trainer/test_sft.py; on a GPU: tests/gpu/test_sft.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lockgate.trainer.sft.data import (
    read_examples,
)

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the notes.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}


def _call(i: int, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_chat(question: str, query: str, found: str, answer: str) -> dict[str, Any]:
    """A research chat: a reasoned tool call, its result, the answer."""
    return {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "search first",
                "tool_calls": [_call(1, "search", json.dumps({"query": query}))],
            },
            {"role": "tool", "tool_call_id": "c1", "content": found},
            {"role": "assistant", "content": answer},
        ],
        "tools": [SEARCH],
    }


CHATS = [
    _tool_chat("Capital of France?", "France capital", "Paris is the capital.", "Paris."),
    _tool_chat("Highest Alp?", "highest alp", "Mont Blanc, 4806 m.", "Mont Blanc."),
    _tool_chat("River of Lyon?", "Lyon river", "The Rhone and the Saone.", "The Rhone."),
    {
        "messages": [
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": "5"},
        ]
    },
    _tool_chat("Oldest bridge?", "old bridge", "Pont Saint-Benezet, 1185.", "Pont Saint-Benezet."),
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]},
]
# Two user turns: Qwen3's template drops the first answer's empty <think> block from history.
REPLAYED = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the mask (pure) ----------------------------------------------------------------------------


# -- real runs ----------------------------------------------------------------------------------

EPOCHS, PER_EPOCH = 12, 2  # six chats, three a step
STEPS = EPOCHS * PER_EPOCH


def _lockgate_sft(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", "sft", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=config.parent,
    )


def _config(folder: Path, **sections: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _write_jsonl(folder / "chats.jsonl", CHATS)
    _write_jsonl(folder / "val.jsonl", CHATS[:2])
    raw: dict[str, Any] = {
        "out_dir": "out",
        "data": {"path": "chats.jsonl", "val_path": "val.jsonl", "max_length": 512},
        "loop": {"epochs": EPOCHS, "batch_size": 3, "log_every": 5},
        "trainer": {
            "lr": 0.003,
            "warmup_steps": 2,
            "device": "cpu",
            "micro_batch_tokens": 256,  # a micro-batch per tool chat: accumulation is exercised
            "checkpoint_every": 8,
        },
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _records(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of STEPS steps; its out dir."""
    config = _config(tmp_path_factory.mktemp("sft-full"))
    result = _lockgate_sft(config)
    _ok(result)
    assert f"sft step {STEPS}/{STEPS}" in result.stderr  # progress reached the terminal
    return config.parent / "out"


def test_the_loss_falls_over_the_run(full_run: Path) -> None:
    losses = [r["sft/loss"] for r in _records(full_run)]
    assert len(losses) == STEPS
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.5 * first, losses
    assert max(r["sft/micro_batches"] for r in _records(full_run)) >= 2
    val = [r["sft/val_loss"] for r in _records(full_run) if "sft/val_loss" in r]
    assert len(val) == 1  # val_every 0: after the last step only


def test_a_resumed_run_continues_the_uninterrupted_loss_trajectory(
    full_run: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, loop={"max_steps": 10})
    _ok(_lockgate_sft(config))
    out = tmp_path / "out"
    assert [r["step"] for r in _records(out)] == list(range(1, 11))
    # Checkpoints at 8 and at the last step, 10; drop 10 so the resume must redo steps 9-10.
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_10", "step_8"]
    subprocess.run(["rm", "-r", str(out / "checkpoints" / "step_10")], check=True)

    refused = _lockgate_sft(config, "--set", "loop.max_steps=null")
    assert refused.returncode == 2 and "--resume" in refused.stderr
    changed = _lockgate_sft(config, "--resume", "--set", "loop.batch_size=2")
    assert changed.returncode == 2 and "batch" in changed.stderr

    _ok(_lockgate_sft(config, "--resume", "--set", "loop.max_steps=null"))
    resumed, uninterrupted = _records(out), _records(full_run)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # 9 and 10 redone once
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["sft/grad_norm"] == pytest.approx(b["sft/grad_norm"], rel=1e-4, abs=1e-6)
        assert a["sft/lr"] == b["sft/lr"]


@pytest.mark.parametrize(
    ("rule", "why", "stop"),
    [
        # Any loss is at or below 100: the first held-out loss, at step 4, stops the run.
        ({"val_every": 4, "stop_at_val_loss": 100.0}, "held-out loss at or below 100.0", 4),
        # Step 2's loss is the first best; step 4's cannot be 99% lower.
        (
            {
                "val_every": 2,
                "stop_on_plateau": {"below": 100.0, "patience": 1, "min_improvement": 0.99},
            },
            "held-out loss plateaued: best ",
            4,
        ),
        # The first full window of 3 training losses, at step 3 (not a held-out step).
        (
            {"val_every": 4, "stop_at_train_loss": 100.0, "train_loss_window": 3},
            "training loss over the last 3 steps ",
            3,
        ),
    ],
    ids=["target", "plateau", "train-window"],
)
def test_a_run_stops_early_and_stays_stopped_when_resumed(
    tmp_path: Path, rule: dict[str, Any], why: str, stop: int
) -> None:
    config = _config(tmp_path, loop=rule)
    result = _lockgate_sft(config)
    _ok(result)
    out = tmp_path / "out"
    assert [r["step"] for r in _records(out)] == list(range(1, stop + 1))
    assert f"sft done: {stop} steps ({why}" in result.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{stop}"]
    assert (out / "final" / "model.safetensors").exists()

    resumed = _lockgate_sft(config, "--resume")
    _ok(resumed)
    assert [r["step"] for r in _records(out)] == list(range(1, stop + 1))  # none trained again
    assert f"sft done: {stop} steps ({why}" in resumed.stderr


def test_a_run_that_misses_its_required_exact_match_fails_in_one_line(tmp_path: Path) -> None:
    # Exact match 1.0 in 4 steps: no run gets there, so the run ends at its cap and fails.
    rule = {"val_every": 2, "max_steps": 4, "stop_at_val_exact_match": 1.0}
    config = _config(tmp_path, loop={**rule, "require": "val_exact_match"})
    result = _lockgate_sft(config)
    assert result.returncode == 1, result.stderr
    out = tmp_path / "out"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "lockgate: sft failed: held-out exact match 0.000 when the run ended at step 4, short "
        "of loop.stop_at_val_exact_match 1.0 (loop.require: val_exact_match)"
    ), last
    assert str(out / "sft.log") in last
    checks = [r for r in _records(out) if "sft/val_loss" in r]
    assert [(r["step"], r["sft/val_exact_match"]) for r in checks] == [(2, 0.0), (4, 0.0)]
    assert "val_exact_match 0.000" in result.stderr  # the progress line carries it
    assert (out / "final" / "model.safetensors").exists()  # the model is there to inspect
    # Without the requirement the same run ends well at its cap.
    _ok(_lockgate_sft(config, "--set", "loop.require=null", "--out", str(tmp_path / "free")))


def test_two_ranks_train_the_same_steps_as_one(full_run: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, loop={"max_steps": 4}, trainer={"world_size": 2})
    _ok(_lockgate_sft(config))
    two = _records(tmp_path / "out")
    one = _records(full_run)[:4]
    for a, b in zip(two, one, strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-4)
        assert a["sft/trained_tokens"] == b["sft/trained_tokens"]


def _saved_dtypes(out: Path) -> set[torch.dtype]:
    return {t.dtype for t in load_file(out / "final" / "model.safetensors").values()}


def test_bf16_compute_trains_near_fp32_and_keeps_fp32_weights(
    full_run: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, loop={"max_steps": 4}, trainer={"compute_dtype": "bfloat16"})
    _ok(_lockgate_sft(config))
    bf16, fp32 = _records(tmp_path / "out"), _records(full_run)[:4]
    first = (bf16[0]["sft/loss"], fp32[0]["sft/loss"])
    # The same step in another precision: close, yet not the fp32 numbers (bf16 really ran).
    assert first[0] == pytest.approx(first[1], rel=0.02) and first[0] != first[1]
    assert bf16[-1]["sft/loss"] < bf16[0]["sft/loss"]
    assert _saved_dtypes(tmp_path / "out") == {torch.float32}


def _masked_ce(model: torch.nn.Module, out: Path) -> float:
    """The val set's cross-entropy mean over assistant tokens, one conversation at a time."""
    total, count = 0.0, 0
    for e in read_examples(out / "data" / "val.jsonl"):
        ids = torch.tensor([e.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
        total -= float(picked[mask].sum())
        count += int(mask.sum())
    return total / count


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_final_dir_is_the_trained_model_in_hf_format(
    full_run: Path, tiny_model_dir: Path
) -> None:
    final = full_run / "final"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (final / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(str(final))
    # The run's own last val loss, computed on its sharded, packed model, is final's.
    recorded = _records(full_run)[-1]["sft/val_loss"]
    assert _masked_ce(model, full_run) == pytest.approx(recorded, rel=1e-4)
    # The same logits as the last checkpoint, loaded onto the untrained model.
    trained = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    probe = torch.tensor([read_examples(full_run / "data" / "val.jsonl")[0].input_ids])
    with torch.no_grad():
        before = trained(input_ids=probe).logits
        state = {"model": trained.state_dict()}
        dcp.load(state, checkpoint_id=full_run / "checkpoints" / f"step_{STEPS}")
        trained.load_state_dict(state["model"])
        assert not torch.allclose(before, model(input_ids=probe).logits, atol=1e-3)
        torch.testing.assert_close(
            trained(input_ids=probe).logits, model(input_ids=probe).logits, atol=1e-6, rtol=1e-6
        )


# -- CLI errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["trainer.lr=lots"], "trainer.lr"),
        (["loop.batch_sise=3"], "loop.batch_sise"),
        (["trainer.lr_schedule=cosine"], "needs decay_steps"),
        (["data.path=missing.jsonl"], "missing.jsonl"),
        (["loop.stop_at_val_loss=0.1"], "needs data.val_path and loop.val_every"),
        (["loop.stop_on_plateau.below=0.1"], "stop_on_plateau needs data.val_path"),
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_2(
    tmp_path: Path, sets: list[str], needle: str
) -> None:
    config = _config(tmp_path)
    result = _lockgate_sft(config, *[a for s in sets for a in ("--set", s)])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lockgate: ") and needle in lines[0], lines


def test_a_chat_the_template_re_renders_trains_through_the_formats_renderer(
    tmp_path: Path,
) -> None:
    # Qwen3's template re-renders history, which once made such a chat a one-line refusal;
    # the format's renderer now masks it (its tokens are checked one by one in
    # tests/unit/trainer/test_sft_formats.py), so the CLI trains it to the end.
    config = _config(tmp_path)
    _write_jsonl(tmp_path / "chats.jsonl", [*CHATS, REPLAYED])
    result = _lockgate_sft(config)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sft done" in result.stderr
    assert (tmp_path / "out" / "final" / "config.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_rank_that_dies_is_a_one_line_failure_quoting_its_error(tmp_path: Path) -> None:
    config = _config(tmp_path, trainer={"device": "cuda"})
    result = _lockgate_sft(config)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lockgate: sft failed: rank 0: RuntimeError: trainer device is cuda")
    assert str(tmp_path / "out" / "sft.log") in last


def test_help_lists_every_option() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.coordinator.cli", "sft", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for option in ("data.path", "data.overlong", "loop.batch_unit", "loop.max_steps"):
        assert option in result.stdout
    for option in ("trainer.lr", "trainer.micro_batch_tokens", "trainer.checkpoint_every"):
        assert option in result.stdout
    assert "trainer.kl_coef" not in result.stdout  # RL-only options are not SFT options
