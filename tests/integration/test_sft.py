"""`lockgate sft`: the assistant-only mask token by token, the step plan, and real runs
(torchrun on gloo with the tiny model): the loss falls, a resumed run continues the same loss
trajectory, world size 2 trains the same steps, the final dir is the trained model, and bad
input is a one-line error."""

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

from lockgate.coordinator.config import read_config_file
from lockgate.trainer.sft import data as sft_data
from lockgate.trainer.sft.config import SFTConfig
from lockgate.trainer.sft.data import (
    ChatTokenizer,
    TemplateMismatch,
    end_of_turn_id,
    load_tokenizer,
    plan_steps,
    read_examples,
    render_with_mask,
    tokenize_file,
)
from tests.support.trainer_runs import needs_gpu

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> ChatTokenizer:
    return load_tokenizer(tiny_model_dir)


# -- the mask (pure) ----------------------------------------------------------------------------


def test_the_mask_is_one_exactly_on_what_each_assistant_turn_generates(
    tokenizer: ChatTokenizer,
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "look it up",
            "tool_calls": [
                _call(1, "search", '{"query": "France capital"}'),
                _call(2, "search", {"query": "Paris"}),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Paris is the capital."},
        {"role": "tool", "tool_call_id": "c2", "content": "Paris: 2.1M people."},
        {"role": "assistant", "content": "Paris."},
    ]
    ids, mask = render_with_mask(tokenizer, messages, [SEARCH], end_of_turn_id(tokenizer, None))

    turn_1 = (
        "<think>\nlook it up\n</think>\n\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "France capital"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call><|im_end|>'
    )
    turn_2 = "<think>\n\n</think>\n\nParis.<|im_end|>"
    system = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{json.dumps(SEARCH)}\n</tools>\n\nFor each "
        "function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    pieces = [
        (system + "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", 0),
        (turn_1, 1),
        (
            "\n<|im_start|>user\n<tool_response>\nParis is the capital.\n</tool_response>\n"
            "<tool_response>\nParis: 2.1M people.\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
            0,
        ),
        (turn_2, 1),
        ("\n", 0),
    ]
    # Every token's text, in order, must tile the hand-written pieces; its mask is its piece's.
    tokens = [tokenizer.decode([t]) for t in ids]
    assert "".join(tokens) == "".join(text for text, _ in pieces)
    expected, at = [], 0
    bounds = []
    for text, trained in pieces:
        bounds.append((at, at + len(text), trained))
        at += len(text)
    at = 0
    for token in tokens:
        (trained,) = [m for lo, hi, m in bounds if lo <= at and at + len(token) <= hi]
        expected.append(trained)
        at += len(token)
    assert mask == expected
    # Both turns end on the trained end-of-turn token; the template's newline after it is not.
    ends = [t for t in range(len(ids) - 1) if mask[t] and not mask[t + 1]]
    assert [tokens[t] for t in ends] == ["<|im_end|>", "<|im_end|>"]
    assert [tokens[t + 1] for t in ends] == ["\n", "\n"]


def test_tool_call_arguments_as_a_json_string_or_an_object_train_the_same_tokens(
    tokenizer: ChatTokenizer,
) -> None:
    as_string = CHATS[0]["messages"]
    as_object = json.loads(json.dumps(as_string))
    call = as_object[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    eot = end_of_turn_id(tokenizer, None)
    a = render_with_mask(tokenizer, as_string, [SEARCH], eot)
    b = render_with_mask(tokenizer, as_object, [SEARCH], eot)
    assert a == b


def test_a_template_that_re_renders_history_is_an_error_naming_the_line(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = _write_jsonl(tmp_path / "chats.jsonl", [CHATS[3], REPLAYED])
    with pytest.raises(TemplateMismatch, match=r"chats\.jsonl line 2: message 1 \(assistant\)"):
        tokenize_file(path, tokenizer, max_length=512, overlong="drop", end_of_turn=None)


def test_forked_workers_render_what_one_process_renders_in_file_order(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of two lines over two workers, whatever the file's length.
    monkeypatch.setattr(sft_data, "_PARALLEL_FROM", 1)
    monkeypatch.setattr(sft_data, "_CHUNK", 2)
    path = _write_jsonl(tmp_path / "chats.jsonl", CHATS * 3)
    args: dict[str, Any] = {"max_length": 4096, "overlong": "drop", "end_of_turn": None}
    one, one_stats = tokenize_file(path, tokenizer, **args)
    two, two_stats = tokenize_file(path, tokenizer, workers=2, **args)
    assert two == one and two_stats == one_stats
    assert [e.line for e in two] == list(range(1, 3 * len(CHATS) + 1))
    # A worker's error reaches the caller as it is, naming its line.
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*CHATS, REPLAYED])
    with pytest.raises(TemplateMismatch, match=rf"bad\.jsonl line {len(CHATS) + 1}: message 1"):
        tokenize_file(bad, tokenizer, workers=2, **args)


def test_overlong_chats_are_truncated_or_dropped_and_counted(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    path = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    full, _ = tokenize_file(path, tokenizer, max_length=4096, overlong="drop", end_of_turn=None)
    # Two tokens short of the shortest tool chat: all four lose their answer's end, the two
    # plain chats fit.
    limit = min(len(e.input_ids) for e in full if len(e.input_ids) > 100) - 2
    cut, stats = tokenize_file(
        path, tokenizer, max_length=limit, overlong="truncate", end_of_turn=None
    )
    assert (stats.truncated, stats.dropped_overlong, stats.examples) == (4, 0, 6)
    for e, f in zip(cut, full, strict=True):
        n = min(limit, len(f.input_ids))
        assert (e.input_ids, e.loss_mask) == (f.input_ids[:n], f.loss_mask[:n])
    kept, stats = tokenize_file(
        path, tokenizer, max_length=limit, overlong="drop", end_of_turn=None
    )
    assert (stats.truncated, stats.dropped_overlong) == (0, 4)
    assert [e.line for e in kept] == [4, 6]


def test_the_step_plan_is_a_seeded_shuffle_per_epoch_with_conversation_or_token_batches() -> None:
    lengths = [5, 7, 3, 9, 4, 6, 8]
    plan = plan_steps(
        lengths, batch_size=3, batch_unit="conversations", epochs=2, shuffle=True, seed=1
    )
    assert [len(s.indices) for s in plan] == [3, 3, 1, 3, 3, 1]
    assert [s.epoch for s in plan] == [1, 1, 1, 2, 2, 2]
    for epoch in (1, 2):
        seen = [i for s in plan if s.epoch == epoch for i in s.indices]
        assert sorted(seen) == list(range(7))
    orders = [[i for s in plan if s.epoch == e for i in s.indices] for e in (1, 2)]
    assert orders[0] != orders[1]  # reshuffled each epoch
    again = plan_steps(
        lengths, batch_size=3, batch_unit="conversations", epochs=2, shuffle=True, seed=1
    )
    assert again == plan
    by_tokens = plan_steps(
        lengths, batch_size=12, batch_unit="tokens", epochs=1, shuffle=False, seed=0
    )
    assert [s.indices for s in by_tokens] == [[0, 1], [2, 3], [4, 5], [6]]


def test_the_shipped_example_parses_and_its_chats_render(tokenizer: ChatTokenizer) -> None:
    path = ROOT / "examples/sft/config.yaml"
    config = SFTConfig.model_validate(read_config_file(path, ["loop.epochs=2"]))
    assert config.loop.epochs == 2 and config.model.path is None
    data = config.resolved(path.parent, Path("unused")).data
    examples, stats = tokenize_file(
        data.path, tokenizer, max_length=data.max_length, overlong="drop", end_of_turn=None
    )
    assert stats.examples == stats.conversations == len(examples) > 0


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


@needs_gpu
def test_on_a_gpu_sft_trains_the_cpu_steps_in_bf16_and_saves_fp32_weights(
    full_run: Path, tmp_path: Path
) -> None:
    # `auto` compute on cuda is bf16 over fp32 master weights: near the CPU's fp32 losses.
    config = _config(tmp_path, loop={"max_steps": 4}, trainer={"device": "cuda"})
    _ok(_lockgate_sft(config))
    gpu = _records(tmp_path / "out")
    assert len(gpu) == 4
    for a, b in zip(gpu, _records(full_run)[:4], strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=0.03)
        assert a["sft/trained_tokens"] == b["sft/trained_tokens"]
    assert gpu[-1]["sft/loss"] < gpu[0]["sft/loss"]
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


def test_a_chat_the_template_re_renders_stops_the_cli_with_its_line(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _write_jsonl(tmp_path / "chats.jsonl", [*CHATS, REPLAYED])
    result = _lockgate_sft(config)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "chats.jsonl line 7: message 1 (assistant)" in lines[0], lines
    assert not (tmp_path / "out" / "config.json").exists()  # nothing was started


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
