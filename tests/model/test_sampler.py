from __future__ import annotations

import itertools

import pytest
import torch

from conveyor.core.sequence import Sequence
from conveyor.model.sampling.logits_processors import apply_penalties, top_k_top_p
from conveyor.model.sampling.sampler import Sampler
from conveyor.sampling_params import SamplingParams

_ids = itertools.count()


def req(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
    request_id: str | None = None,
    **params: object,
) -> Sequence:
    r = Sequence(
        request_id if request_id is not None else f"r{next(_ids)}",
        prompt or [1, 2, 3],
        SamplingParams(**params),  # type: ignore[arg-type]
        max_tokens=1000,
        eos_token_id=eos,
    )
    r.output_token_ids.extend(output or [])
    return r


def random_logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def freqs(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def test_greedy_is_argmax_and_does_not_touch_logits() -> None:
    logits = random_logits(16, 100)
    before = logits.clone()
    out = Sampler(100, seed=0)(logits, [req(temperature=0.0) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)


def test_greedy_ties_pick_the_first_maximum() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0]])
    out = Sampler(4, seed=0)(logits, [req(temperature=0.0), req(temperature=0.0, logprobs=1)])
    assert out.token_ids == [1, 0]


@pytest.mark.parametrize(
    "params",
    [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5, "min_p": 0.1}],
    ids=["top_k=1", "tiny_top_p", "combined"],
)
def test_filters_that_keep_one_token_are_greedy(params: dict[str, object]) -> None:
    logits = random_logits(32, 200, seed=1)
    sampler = Sampler(200, seed=3)
    for _ in range(5):
        out = sampler(logits, [req(temperature=1.5, **params) for _ in range(32)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = random_logits(10, 50, seed=2)
    requests = [req(temperature=0.0 if i % 2 else 1.0) for i in range(10)]
    out = Sampler(50, seed=0)(logits, requests)
    greedy = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 10, 2)] == greedy[1::2]


def test_temperature_scales_the_sampled_distribution() -> None:
    vocab = 5
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sampler = Sampler(vocab, seed=0)
    n = 4000
    logits = base.expand(n, vocab).contiguous()
    for temperature in (0.5, 1.0, 2.0):
        tokens: list[int] = []
        for _ in range(5):
            tokens += sampler(logits, [req(temperature=temperature) for _ in range(n)]).token_ids
        expected = torch.softmax(base / temperature, dim=-1)
        # 20k draws: the standard error of each frequency is <= 0.0036, so 0.02 is > 5 sigma.
        assert torch.allclose(freqs(tokens, vocab), expected, atol=0.02)


def test_top_k_top_p_and_min_p_sample_only_from_their_sets() -> None:
    vocab = 4
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 10000
    logits = probs.log().expand(n, vocab).contiguous()
    sampler = Sampler(vocab, seed=1)
    cases = [
        ({"top_k": 2}, torch.tensor([0.625, 0.375, 0.0, 0.0])),
        ({"top_p": 0.7}, torch.tensor([0.625, 0.375, 0.0, 0.0])),  # 0.5 + 0.3 covers 0.7
        ({"top_k": 3, "top_p": 0.9}, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95),
        ({"min_p": 0.25}, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95),  # 0.15 >= 0.25 * 0.5
        ({"min_p": 0.7}, torch.tensor([1.0, 0.0, 0.0, 0.0])),
    ]
    for params, expected in cases:
        tokens = sampler(logits, [req(temperature=1.0, **params) for _ in range(n)]).token_ids
        got = freqs(tokens, vocab)
        assert torch.equal(got == 0, expected == 0), params
        assert torch.allclose(got, expected, atol=0.03), params


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    requests = [
        # prompt has token 0 and 1, output has 2 twice and 1 once
        req(
            prompt=[0, 1],
            output=[2, 2, 1],
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
        ),
        req(prompt=[4], output=[3], temperature=0.0),  # no penalties: unchanged
    ]
    apply_penalties(logits, requests)
    expected_row0 = [
        2.0 / 2,  # in prompt, positive: divided
        -1.0 * 2 - 0.5 * 1 - 0.25,  # in prompt and output once: multiplied, then penalised
        0.5 / 2 - 0.5 * 2 - 0.25,  # output twice
        3.0,  # never seen
        -2.0,
    ]
    assert torch.allclose(logits[0], torch.tensor(expected_row0))
    assert torch.equal(logits[1], torch.ones(5))


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    sampler = Sampler(3, seed=0)
    # 2.0 / 1.5 = 1.33 < 1.5 while 2.0 / 1.25 = 1.6 > 1.5
    for penalty, expected in ((1.5, 1), (1.25, 0)):
        r = req(prompt=[0], temperature=0.0, repetition_penalty=penalty)
        assert sampler(logits, [r]).token_ids == [expected]
    # presence 0.6 on an output token: 2.0 - 0.6 = 1.4 < 1.5
    out = sampler(logits, [req(prompt=[2], output=[0], temperature=0.0, presence_penalty=0.6)])
    assert out.token_ids == [1]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]] * 4)
    requests = [
        req(output=[3], eos=0, temperature=0.0, min_tokens=2),  # eos masked
        req(output=[3], eos=0, temperature=0.0, min_tokens=2, stop_token_ids=[1]),
        req(output=[3, 3], eos=0, temperature=0.0, min_tokens=2),  # reached: eos allowed
        req(output=[3], eos=0, temperature=0.0, min_tokens=2, ignore_eos=True),
    ]
    out = Sampler(4, seed=0)(logits, requests)
    assert out.token_ids == [1, 2, 0, 0]


def test_seeded_request_is_reproducible_alone_or_in_any_batch() -> None:
    vocab, steps = 64, 6
    step_logits = [random_logits(1, vocab, seed=100 + s)[0] for s in range(steps)]
    params = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}

    alone = Sampler(vocab, seed=0)
    seeded = req(request_id="seeded", **params)
    solo_tokens = []
    for s in range(steps):
        token = alone(step_logits[s].unsqueeze(0), [seeded]).token_ids[0]
        seeded.output_token_ids.append(token)
        solo_tokens.append(token)

    batched = Sampler(vocab, seed=99)
    seeded = req(request_id="seeded", **params)
    others = [req(temperature=1.0) for _ in range(5)] + [
        req(temperature=0.7, seed=7, top_k=5),
        req(temperature=0.0),
        req(temperature=1.2, min_p=0.05, logprobs=2),
    ]
    batch_tokens = []
    for s in range(steps):
        batch = [*others[: 3 + s % 3], seeded, *others[3 + s % 3 :]]
        logits = random_logits(len(batch), vocab, seed=s)
        logits[batch.index(seeded)] = step_logits[s]
        token = batched(logits, batch).token_ids[batch.index(seeded)]
        seeded.output_token_ids.append(token)
        batch_tokens.append(token)
    assert batch_tokens == solo_tokens
    assert len(set(solo_tokens)) > 1  # really sampled, not greedy


def test_removed_request_restarts_its_generator() -> None:
    logits = random_logits(1, 1000, seed=5)
    sampler = Sampler(1000, seed=0)
    first = [sampler(logits, [req(request_id="a", seed=3)]).token_ids[0] for _ in range(4)]
    sampler.remove_requests(["a", "unknown"])
    again = [sampler(logits, [req(request_id="a", seed=3)]).token_ids[0] for _ in range(4)]
    assert first == again


def test_logprobs_are_raw_log_softmax_with_rank() -> None:
    logits = random_logits(4, 30, seed=6)
    requests = [
        req(temperature=0.0, logprobs=5),
        req(temperature=2.0, logprobs=3, repetition_penalty=1.8, top_k=10),
        req(temperature=1.0),  # no logprobs asked
        req(temperature=1.0, logprobs=0, presence_penalty=2.0, output=[0, 1]),
    ]
    out = Sampler(30, seed=0)(logits, requests)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 3), (3, 0)):
        lp = out.logprobs[row]
        assert lp is not None
        token = out.token_ids[row]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert lp.rank == 1 + int((raw[row] > raw[row, token]).sum())
        top = raw[row].topk(n) if n else None
        assert lp.top_ids == (top.indices.tolist() if top else [])
        assert lp.top_logprobs == pytest.approx(top.values.tolist() if top else [], abs=1e-6)
    assert out.logprobs[0].rank == 1


def test_logits_for_the_wrong_batch_size_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(10, seed=0)(torch.zeros(2, 10), [req()])


def reference_top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Filtered copy of one row by the textbook definition: full sort, top-k, renormalise,
    keep the smallest prefix whose mass reaches top_p."""
    values, order = row.sort(descending=True)
    k = top_k if top_k > 0 else row.numel()
    probs = values[:k].softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    n_keep = int((before < top_p).sum()) if top_p < 1.0 else k
    out = torch.full_like(row, float("-inf"))
    out[order[:n_keep]] = row[order[:n_keep]]
    return out


def test_top_k_top_p_on_a_large_vocab_matches_a_full_sort() -> None:
    vocab = 5000  # larger than the top-p candidate window, so the window and fallback run
    peaked = random_logits(1, vocab, seed=7) * 4  # nucleus inside the window
    flat = random_logits(1, vocab, seed=8) * 0.05  # nucleus needs most of the vocab
    cases = [(peaked, -1, 0.9), (flat, -1, 0.9), (flat, 50, 1.0), (peaked, 300, 0.8)]
    cases += [(flat, -1, 1.0), (peaked, 7, 0.3)]
    logits = torch.cat([c[0] for c in cases])
    params = [SamplingParams(top_k=k, top_p=p) for _, k, p in cases]
    got = top_k_top_p(logits.clone(), params)
    for i, (_, k, p) in enumerate(cases):
        assert torch.equal(got[i], reference_top_k_top_p(logits[i], k, p)), cases[i][1:]
    # The flat row's nucleus is wider than the candidate window: the fallback was needed.
    assert int(torch.isfinite(got[1]).sum()) > 1024
