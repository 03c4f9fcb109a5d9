"""allowed_token_ids and bad_words (vLLM's semantics): their checks, how bad words are
tokenized, and the sampler's mask, greedy and random, batched with rows that have none."""

from __future__ import annotations

import pytest
import torch
from tests.model.test_sampler import random_logits, req

from conveyor.core.limits import PromptError, PromptLimits
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.sampling.logits_processors import apply_token_masks
from conveyor.model.sampling.sampler import Sampler
from conveyor.sampling_params import SamplingParams


def test_allowed_token_ids_keep_only_those_tokens_greedy_and_random() -> None:
    vocab = 50
    logits = random_logits(4, vocab, seed=3)
    best = logits.argmax(dim=-1).tolist()
    allowed = [7, 11, 42]
    rows = [
        req(temperature=0.0, allowed_token_ids=allowed),
        req(temperature=0.0),  # untouched neighbour: its own argmax
        req(temperature=1.0, seed=1, allowed_token_ids=allowed),
        req(temperature=1.0, seed=2, allowed_token_ids=[9]),
    ]
    before = logits.clone()
    for _ in range(20):
        out = Sampler(vocab, seed=0)(logits, rows).token_ids
        assert out[0] == max(allowed, key=lambda t: float(logits[0, t]))
        assert out[1] == best[1]
        assert out[2] in allowed and out[3] == 9
    assert torch.equal(logits, before)  # the mask works on a copy


def test_a_bad_word_bans_its_last_token_after_its_prefix_only() -> None:
    vocab = 10
    logits = torch.zeros(3, vocab)
    words = [[4], [5, 6, 7]]
    rows = [
        req(output=[1, 5, 6], bad_words_token_ids=words),  # 7 completes [5, 6, 7]
        req(output=[5, 1], bad_words_token_ids=words),  # prefix broken: only [4]
        req(output=[], bad_words_token_ids=[[5, 6]]),  # too short for its prefix
    ]
    apply_token_masks(logits, rows)
    banned = [set((logits[i] == float("-inf")).nonzero().flatten().tolist()) for i in range(3)]
    assert banned == [{4, 7}, {4}, set()]


def test_bad_words_are_tokenized_with_and_without_a_leading_space(tiny_tokenizer_dir) -> None:
    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    params = tok.with_bad_words(SamplingParams(bad_words=["  quick", "fox"]))
    ids = params.bad_words_token_ids
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode("quick") in ids and encode("fox") in ids
    for word in ("quick", "fox"):
        plain, spaced = encode(word), encode(" " + word)
        expected = spaced[0] != plain[0] and len(spaced) == len(plain)
        assert (spaced in ids) == expected
    assert SamplingParams().bad_words_token_ids is None
    assert tok.with_bad_words(SamplingParams()).bad_words_token_ids is None


@pytest.mark.parametrize(
    "fields",
    [
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"allowed_token_ids": [True]},
        {"bad_words": [""]},
        {"bad_words": ["   "]},
        {"bad_words": ["x" * 513]},
        {"bad_words": ["a"] * 129},
        {"bad_words_token_ids": [[]]},
    ],
)
def test_bad_masks_are_value_errors_naming_the_field(fields) -> None:
    name = next(iter(fields))
    with pytest.raises(ValueError, match=rf"^{name}"):
        SamplingParams(**fields)


def test_allowed_token_ids_outside_the_vocabulary_are_refused() -> None:
    limits = PromptLimits(max_model_len=64, vocab_size=100, kv_capacity=1024)
    with pytest.raises(PromptError, match=r"allowed_token_ids .*\[0, 100\)") as info:
        limits.check([1, 2], SamplingParams(allowed_token_ids=[3, 100]))
    assert info.value.param == "allowed_token_ids"
