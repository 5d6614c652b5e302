"""Held-out exact match (trainer/sft/exact_match.py): read off one teacher-forced forward pass,
it says whether greedy decoding would write the trained tokens exactly."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lockgate.trainer.sft.exact_match import exact_rows


def test_only_trained_tokens_count_and_each_is_judged_from_the_position_before() -> None:
    # Vocabulary of 4; the logits at position t favour token favoured[t] for position t + 1.
    favoured = torch.tensor([[1, 2, 3, 0]])
    logits = torch.nn.functional.one_hot(favoured, 4).float()
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 0, 3], [0, 1, 0, 3]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1], [0, 1, 1, 1]])
    rows = exact_rows(logits.expand(3, -1, -1), ids, mask)
    # Row 1's wrong token (position 2) is not trained; row 2 trains it.
    assert rows.tolist() == [True, True, False]


def test_a_match_is_what_greedy_decoding_writes_token_for_token() -> None:
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = Qwen2Config(vocab_size=64, num_attention_heads=4, num_key_value_heads=2, **shape)
    model = Qwen2ForCausalLM(config).eval()
    prompt = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        mask = torch.zeros_like(greedy)
        mask[:, prompt.shape[1] :] = 1
        assert exact_rows(model(greedy).logits, greedy, mask).tolist() == [True]
        # Any one generated token changed: greedy would not have written it.
        for t in range(prompt.shape[1], greedy.shape[1]):
            other = greedy.clone()
            other[0, t] = (other[0, t] + 1) % config.vocab_size
            assert exact_rows(model(other).logits, other, mask).tolist() == [False], t
