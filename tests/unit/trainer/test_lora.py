"""LoRA's layer (trainer/lora.py) on the tiny model, in one process: B = 0 is the base model,
any adapter is exactly the merged weights W + (alpha / r) * B @ A, only the adapters train,
and the per-sample (shared prefix), packed and activation-checkpointed paths agree. Two FSDP2
ranks against one: test_lora_fsdp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockgate.trainer.config import LoraSpec, TrainerConfig
from lockgate.trainer.lora import LoraLinear, is_lora_name, merge_state_dict
from lockgate.trainer.model import MIN_SHARED_PREFIX, forward_logits, load_policy, pad_batch
from lockgate.trainer.parallel import apply_activation_checkpointing
from lockgate.trainer.step import build_optimizer
from tests.support.lora_models import trained_lora_model

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, alpha=8)


def _batch(vocab: int, lengths: list[int], *, prefix: int = 0) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(1)
    head = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
    rows = [head + torch.randint(0, vocab, (n - prefix,), generator=gen).tolist() for n in lengths]
    return pad_batch(rows, torch.long, CPU), lengths


def test_targets_become_lora_layers_with_the_base_names_kept(tiny_model_dir: Path) -> None:
    base = load_policy(tiny_model_dir, CPU)
    model = load_policy(tiny_model_dir, CPU, SPEC)
    names = dict(model.named_parameters())
    # Every base parameter keeps its HF name and value; two adapter tensors per target module.
    for name, param in base.named_parameters():
        assert torch.equal(names[name], param)
        assert not names[name].requires_grad
    adapters = sorted(n for n in names if is_lora_name(n))
    layers = model.config.num_hidden_layers
    assert len(adapters) == 2 * 7 * layers
    assert all(names[n].requires_grad for n in adapters)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoraLinear)
    assert q.lora_A.weight.shape == (4, q.in_features)
    assert q.lora_B.weight.shape == (q.out_features, 4)
    assert (
        float(q.lora_A.weight.detach().abs().sum()) > 0
    )  # kaiming-uniform A, zero B (peft's init)
    assert float(q.lora_B.weight.detach().abs().sum()) == 0


def test_unknown_target_modules_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="match no linear layer"):
        load_policy(tiny_model_dir, CPU, LoraSpec(target_modules=["qkv"]))


@pytest.mark.parametrize("pack", [True, False])
def test_a_fresh_adapter_is_exactly_the_base_model(tiny_model_dir: Path, pack: bool) -> None:
    base = load_policy(tiny_model_dir, CPU).eval()
    model = load_policy(tiny_model_dir, CPU, SPEC).eval()
    ids, lengths = _batch(base.config.vocab_size, [40, 45, 50], prefix=MIN_SHARED_PREFIX + 2)
    with torch.no_grad():
        ours = forward_logits(model, ids, lengths, pack=pack)
        theirs = forward_logits(base, ids, lengths, pack=pack)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("pack", [True, False])
def test_an_adapter_is_exactly_the_merged_weights(tiny_model_dir: Path, pack: bool) -> None:
    """What vLLM serves for an adapter and what export-hf --merge writes is W + (alpha/r) B@A:
    the trainer's logits (so its logprobs) are that model's, in fp32 to float rounding."""
    model = trained_lora_model(tiny_model_dir, SPEC).eval()
    merged = load_policy(tiny_model_dir, CPU).eval()
    merged.load_state_dict(merge_state_dict(model.state_dict(), SPEC.scaling))
    base = load_policy(tiny_model_dir, CPU).eval()
    ids, lengths = _batch(base.config.vocab_size, [40, 45, 50], prefix=MIN_SHARED_PREFIX + 2)
    with torch.no_grad():
        ours = forward_logits(model, ids, lengths, pack=pack)
        theirs = forward_logits(merged, ids, lengths, pack=pack)
        plain = forward_logits(base, ids, lengths, pack=pack)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    assert float((ours - plain).abs().max()) > 1e-2  # the adapter really changes the model


def _loss(
    model: torch.nn.Module, ids: torch.Tensor, lengths: list[int], pack: bool
) -> torch.Tensor:
    logits = forward_logits(model, ids, lengths, pack=pack)
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = (torch.arange(ids.shape[1] - 1)[None, :] < torch.tensor(lengths)[:, None] - 1).float()
    return -(logprobs * mask).sum() / mask.sum()


def test_one_optimizer_step_changes_only_the_adapters(tiny_model_dir: Path) -> None:
    model = load_policy(tiny_model_dir, CPU, SPEC)
    optimizer = build_optimizer(model, TrainerConfig(model_dir=tiny_model_dir, lr=1e-2))
    adapters = [p for n, p in model.named_parameters() if is_lora_name(n)]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in adapters}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, lengths = _batch(model.config.vocab_size, [20, 30])
    _loss(model, ids, lengths, pack=True).backward()
    optimizer.step()
    for name, param in model.named_parameters():
        moved = not torch.equal(param, before[name])
        # A and B both move: B from its zero start, A through B's new values only next step,
        # but AdamW's first step moves A wherever its gradient is nonzero (it is zero with B = 0).
        if "lora_B" in name:
            assert moved, name
        elif not is_lora_name(name):
            assert not moved, name
            assert param.grad is None, name
    assert len(optimizer.state) == len(adapters)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_three_paths_give_the_same_adapter_gradients(
    tiny_model_dir: Path, checkpointing: bool
) -> None:
    """Packed rows, one sample at a time with a shared-prefix KV cache, and (optionally)
    activation checkpointing: the same adapter gradients, and none on the base."""
    grads = []
    for pack in (True, False):
        model = trained_lora_model(tiny_model_dir, SPEC)
        if checkpointing:
            apply_activation_checkpointing(model)
        ids, lengths = _batch(model.config.vocab_size, [40, 48], prefix=MIN_SHARED_PREFIX + 4)
        _loss(model, ids, lengths, pack).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    packed, alone = grads
    assert set(packed) == set(alone)
    assert packed and all(
        is_lora_name(n.replace("._checkpoint_wrapped_module", "")) for n in packed
    )
    for name, grad in packed.items():
        assert float(grad.abs().sum()) > 0, name
        torch.testing.assert_close(grad, alone[name], atol=1e-6, rtol=1e-4)


def test_dropout_acts_on_the_adapters_input_only_while_training(tiny_model_dir: Path) -> None:
    spec = LoraSpec(rank=4, alpha=8, dropout=0.5)
    model = trained_lora_model(tiny_model_dir, spec)
    plain = trained_lora_model(tiny_model_dir, SPEC)  # the same A and B, no dropout
    ids, lengths = _batch(model.config.vocab_size, [20])
    with torch.no_grad():
        evaluated = forward_logits(model.eval(), ids, lengths, pack=True)
        reference = forward_logits(plain.eval(), ids, lengths, pack=True)
        trained = forward_logits(model.train(), ids, lengths, pack=True)
    assert torch.equal(evaluated, reference)
    assert not torch.allclose(trained, evaluated, atol=1e-4)
