"""LLM.generate and LLM.chat on the demo model: prompt forms, order, n, sampling, stops, chat
templates and bad input; `conveyor generate --chat`."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor.cli import main


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(str(demo_model_dir), max_num_seqs=16, num_kv_blocks=256, seed=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_every_prompt_form_gives_the_same_greedy_tokens(llm):
    text = "def fibonacci(n):"
    ids = llm.get_tokenizer().encode(text)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outs = [llm.generate(f, GREEDY, use_tqdm=False) for f in forms]
    assert all(len(o) == 1 for o in outs)
    tokens = [o[0].outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]
    assert len(tokens[0]) == 8
    assert outs[0][0].prompt == text and outs[0][0].prompt_token_ids == ids
    assert outs[0][0].outputs[0].finish_reason == "length"


def test_outputs_come_back_in_input_order_with_per_prompt_params(llm):
    prompts = [f"Request number {i} says" for i in range(12)]
    lengths = [1 + (7 * i) % 13 for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    # Batched results equal one-at-a-time results.
    for p, m, o in zip(prompts[:3], lengths[:3], outs[:3], strict=True):
        alone = llm.generate(
            p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), use_tqdm=False
        )
        assert alone[0].outputs[0].token_ids == o.outputs[0].token_ids


def test_n_samples_are_distinct_and_reproducible_with_a_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_seeded_sampling_is_the_same_alone_or_in_a_full_batch(llm):
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True
    )
    alone = llm.generate("The weather today", seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompts = [f"noise prompt {i}" for i in range(15)]
    outs = llm.generate(
        [*prompts[:7], "The weather today", *prompts[7:]],
        [noise] * 7 + [seeded] + [noise] * 8,
        use_tqdm=False,
    )
    assert outs[7].outputs[0].token_ids == alone


def test_stop_string_is_excluded_from_the_text(llm):
    base = llm.generate("import os", GREEDY, use_tqdm=False)[0].outputs[0]
    # Stop on a piece of the greedy continuation that starts after its first character.
    stop = base.text[3:6]
    assert stop
    out = llm.generate(
        "import os",
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=stop),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_logprobs(llm):
    base = llm.generate("class Foo:", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[2]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, stop_token_ids=[stop_id], logprobs=3, ignore_eos=True
    )
    out = llm.generate("class Foo:", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert len(lp) == 3
        assert lp[tok].logprob <= 0.0
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_min_tokens_keeps_generating_past_stop_tokens(llm):
    base = llm.generate("x = 1", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[stop_id], ignore_eos=True
    )
    out = llm.generate("x = 1", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4
    assert stop_id not in out.token_ids[:4]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_engine_config_is_a_value_error(demo_model_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(demo_model_dir), max_num_seqs=0)
    with pytest.raises(ValueError, match="scheduler"):
        LLM(str(demo_model_dir), scheduler="no-such-policy", num_kv_blocks=8)


def test_prompt_too_long_for_the_context_is_rejected_up_front(llm):
    max_len = llm.llm_engine.max_model_len
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * max_len], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_context_is_what_the_kv_cache_holds_and_longer_prompts_are_rejected(demo_model_dir):
    small = LLM(str(demo_model_dir), num_kv_blocks=4, block_size=16)  # 64 slots
    assert small.llm_engine.max_model_len == 64  # the model's 2048 capped to the cache
    with pytest.raises(ValueError, match="maximum context length is 64"):
        small.generate(["fits", [7] * 70], SamplingParams(max_tokens=10), use_tqdm=False)
    assert not small.llm_engine.has_unfinished_requests()
    # The engine still serves requests that fit; max_tokens is clamped to what is left.
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    out = small.generate([[7] * 60], params, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")


def test_a_max_model_len_beyond_the_kv_cache_is_a_start_up_error(demo_model_dir):
    with pytest.raises(ValueError, match=r"max_model_len 512 is more than the KV cache holds"):
        LLM(str(demo_model_dir), num_kv_blocks=4, max_model_len=512)


@pytest.mark.parametrize(
    "prompt", [[], [""], [[-1, 3]], [[10**9]], [{"text": "x"}], [3.5], [[1, "a"]]]
)
def test_malformed_prompts_are_value_errors(llm, prompt):
    with pytest.raises(ValueError):
        llm.generate(prompt if prompt != [] else [[]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_mismatched_sampling_params_list_is_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_progress_bar_can_be_turned_off(llm, capsys):
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_default_model_is_the_embedded_demo(monkeypatch, tmp_path, demo_model_dir):
    import conveyor.model.loading.demo as demo

    monkeypatch.setattr(demo, "demo_model_path", lambda: demo_model_dir)
    out = LLM(num_kv_blocks=32).generate("hi", GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
OTHER_CHAT = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}]


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    tok = llm.get_tokenizer()
    rendered = [tok.apply_chat_template(c) for c in (CHAT, OTHER_CHAT)]
    expected = llm.generate(rendered, GREEDY, use_tqdm=False)
    one = llm.chat(CHAT, GREEDY, use_tqdm=False)
    both = llm.chat([CHAT, OTHER_CHAT], GREEDY, use_tqdm=False)
    assert len(one) == 1 and len(both) == 2
    for out, exp in zip([one[0], *both], [expected[0], *expected], strict=True):
        assert out.prompt_token_ids == exp.prompt_token_ids
        assert out.outputs[0].token_ids == exp.outputs[0].token_ids
        assert out.outputs[0].text == exp.outputs[0].text
    assert one[0].prompt == "<|im_start|>system\nBe brief.<|im_end|>\n" + (
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    bare = llm.chat(CHAT, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert bare.prompt_token_ids + header == one[0].prompt_token_ids


def test_chat_renders_the_developer_role_as_system(llm):
    developer = [{"role": "developer", "content": "Be brief."}, CHAT[1]]
    as_developer = llm.chat(developer, GREEDY, use_tqdm=False)[0]
    as_system = llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    assert as_developer.prompt_token_ids == as_system.prompt_token_ids
    assert as_developer.outputs[0].token_ids == as_system.outputs[0].token_ids


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "non-empty list"),
        ("Hi!", "non-empty list"),
        (["Hi!"], r"messages\[0\] must be a dict"),
        ([{"content": "Hi!"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
        ([[CHAT[0]], [CHAT[0], {"role": None}]], r"messages\[1\] needs a 'role'"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            r"messages\[0\].content\[0\] must be a \{'type': 'text'",
        ),
    ],
)
def test_chat_rejects_malformed_messages_naming_the_problem(llm, messages, problem):
    with pytest.raises(ValueError, match=problem):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_cli_generate_chat_prints_the_llm_chat_replies(llm, demo_model_dir, capsys):
    prompts = ["Hi!", "Tell me a story."]
    argv = ["generate", "--chat", "--model", str(demo_model_dir), "--max-tokens", "8", *prompts]
    assert main(argv) == 0
    params = SamplingParams(temperature=0.0, max_tokens=8)
    replies = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    expected = ""
    for prompt, out in zip(prompts, replies, strict=True):
        c = out.outputs[0]
        expected += f"--- {prompt!r} ({c.finish_reason}, {len(c.token_ids)} tokens)\n{c.text}\n"
    assert capsys.readouterr().out == expected


def test_the_largest_seed_with_n_samples_gives_distinct_reproducible_samples(llm):
    # Sample i used to draw from seed + i: 2^63 - 1 + 1 left the seed's range (a ValueError).
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=2**63 - 1, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 4
    smallest = SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=-(2**63), ignore_eos=True)
    assert len(llm.generate("Once upon a time", smallest, use_tqdm=False)[0].outputs) == 4


def test_seeds_that_agree_in_their_low_32_bits_give_different_samples(llm):
    # torch's CPU generator keeps only a seed's low 32 bits: -1 and 2^63 - 1 (and s, s + 2^32)
    # drew the same stream. Per-sample seeds are hashed from the whole 64-bit seed.
    def sample(seed: int, n: int = 1) -> list[tuple[int, ...]]:
        params = SamplingParams(n=n, temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
        out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
        return [tuple(c.token_ids) for c in out.outputs]

    assert sample(-1) != sample(2**63 - 1)
    assert sample(5) != sample(5 + 2**32)
    # Sample 1 of seed s is no longer sample 0 of seed s + 1.
    assert sample(7, n=2)[1] != sample(8)[0]
    with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 9223"):
        SamplingParams(seed=2**63)
