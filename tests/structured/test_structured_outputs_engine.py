"""Structured outputs below the server: params, grammar cache, matcher, sampler, preemption."""

from __future__ import annotations

import pickle

import pytest
import torch
from tests.structured.structured_schemas import Customer, Order, Person

from conveyor import LLM, SamplingParams
from conveyor.core.sequence import Sequence
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.sampling.sampler import Sampler
from conveyor.structured.grammar import GrammarRejectedError, RequestGrammar
from conveyor.structured.grammar_cache import GrammarCache
from conveyor.structured_params import StructuredOutputsParams

PERSON = Person.model_json_schema()


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLM:
    return LLM(str(demo_model_dir), num_kv_blocks=8, max_num_seqs=8)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_model_dir)


def test_sampling_params_take_a_dict_and_check_it() -> None:
    params = SamplingParams(structured_outputs={"json": PERSON})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.key[0] == "json"
    # It crosses the engine process's pipe intact (pickled with the params).
    copy = pickle.loads(pickle.dumps(params))
    assert copy.structured_outputs.key == params.structured_outputs.key
    bad_ones = [
        {}, {"json": PERSON, "regex": "a"}, {"choice": []}, {"json": "{not json"}, {"regex": ""},
        {"structural_tag": "x"}, {"json": PERSON, "disable_any_whitespace": 1},
    ]  # fmt: skip
    for bad in bad_ones:
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


def test_an_uncompilable_schema_is_a_value_error_and_queues_nothing(llm) -> None:
    bad = SamplingParams(structured_outputs={"json": {"type": "no-such-type"}})
    with pytest.raises(ValueError, match=r"structured_outputs\.json cannot be compiled"):
        llm.generate(["a", "b"], [SamplingParams(), bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_failed_compile_fails_that_request_alone(llm) -> None:
    engine = llm.llm_engine
    engine.add_request("bad", "x", SamplingParams(structured_outputs={"regex": "(unclosed"}))
    engine.add_request("good", "x", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "abort" and finished["bad"].error
    assert finished["good"].outputs[0].finish_reason == "length"
    assert len(finished["good"].outputs[0].token_ids) == 3


def test_grammars_are_compiled_once_per_constraint(llm) -> None:
    cache = llm.llm_engine.grammars
    queries, hits = cache.num_queries, cache.num_hits
    params = SamplingParams(max_tokens=60, structured_outputs={"json": PERSON, "regex": None})
    outs = llm.generate(["one", "two", "three"], params, use_tqdm=False)
    for out in outs:
        Person.model_validate_json(out.outputs[0].text)
    assert cache.num_queries - queries == 3
    assert cache.num_hits - hits >= 2  # the first may hit too (an earlier test compiled it)
    assert cache.compile_time_s > 0 and 0 < cache.hit_rate <= 1


def test_preempted_requests_with_a_grammar_still_give_valid_json(llm) -> None:
    """8 blocks of 16 tokens hold two of these at once: the others are preempted and
    recomputed, their matchers carried over with their output tokens."""
    engine = llm.llm_engine
    before = engine.scheduler.num_preemptions
    params = [
        SamplingParams(max_tokens=100, temperature=t, seed=i, structured_outputs={"json": s})
        for i, (s, t) in enumerate([(Order.model_json_schema(), 1.0),
                                    (Customer.model_json_schema(), 0.0)] * 4)
    ]  # fmt: skip
    prompts = [f"request {i}" for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > before
    for out, model in zip(outs, [Order, Customer] * 4, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        model.model_validate_json(out.outputs[0].text)


def _seq(rid: str, params: SamplingParams, grammar: RequestGrammar | None = None) -> Sequence:
    seq = Sequence(rid, [5, 6, 7], params, max_tokens=16, eos_token_id=2)
    seq.grammar = grammar
    return seq


def test_the_bitmask_leaves_unconstrained_rows_exactly_as_they_were(tokenizer) -> None:
    vocab = tokenizer.vocab_size + 64  # the model's logits may be wider than the tokenizer
    cache = GrammarCache(tokenizer.hf, vocab, tokenizer.eos_token_ids)
    compiled = cache.get(StructuredOutputsParams(choice=["yes", "no"])).future.result(timeout=60)
    free = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=0.0)]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, tokenizer.vocab_size :] = 50.0  # ids the tokenizer does not have: never allowed
    batch = [
        _seq("a", free[0]),
        _seq("g1", SamplingParams(temperature=0.0), RequestGrammar(compiled)),
        _seq("b", free[1]),
        _seq("g2", SamplingParams(temperature=1.0, seed=3), RequestGrammar(compiled)),
    ]
    mixed = Sampler(vocab).__call__(logits, batch).token_ids
    alone = Sampler(vocab).__call__(logits[[0, 2]], [_seq("a", free[0]), _seq("b", free[1])])
    assert [mixed[0], mixed[2]] == alone.token_ids
    for token_id in (mixed[1], mixed[3]):  # a first piece of one of the choices
        text = tokenizer.decode([token_id])
        assert text and any(c.startswith(text) for c in ("yes", "no")), text
    cache.shutdown()


def test_the_matcher_follows_the_output_tokens_and_rebuilds_after_a_rollback(tokenizer) -> None:
    cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids)
    compiled = cache.get(StructuredOutputsParams(regex="ab+")).future.result(timeout=60)
    grammar = RequestGrammar(compiled)
    a, b = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    grammar.sync([a, b, b])
    assert grammar.num_accepted == 3
    grammar.sync([a])  # fewer outputs than accepted: rebuilt from scratch, then replayed
    assert grammar.num_accepted == 1
    grammar.sync([a, b, tokenizer.eos_token_id])
    assert grammar.terminated
    with pytest.raises(GrammarRejectedError):
        RequestGrammar(compiled).sync([b])
    cache.shutdown()
