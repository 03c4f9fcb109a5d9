from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.sampling_params import MAX_STOP_STRINGS, SamplingParams

MULTIBYTE_TEXT = "Café naïve 😀🎉 résumé Ångström 日本語 👍🏽 façade"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_tokenizer_dir)


def stream(
    tok: Tokenizer,
    ids: list[int],
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
) -> tuple[IncrementalDetokenizer, list[str], list[str | None]]:
    """Feed ids one at a time, taking a delta after each; returns (detok, deltas, matches)."""
    detok = IncrementalDetokenizer(tok, prompt or [], params or SamplingParams())
    deltas: list[str] = []
    matches: list[str | None] = []
    for token_id in ids:
        matches.append(detok.update([token_id]))
        deltas.append(detok.get_delta(finished=detok.stopped))
        if detok.stopped:
            break
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, matches


def test_decode_matches_transformers_decode(tok: Tokenizer, tiny_tokenizer_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = tok.encode("Hello <|im_start|> world " + MULTIBYTE_TEXT)
    assert ids == hf.encode("Hello <|im_start|> world " + MULTIBYTE_TEXT)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_id == hf.eos_token_id == 0
    assert tok.eos_token_ids == [0]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_equals_full_decode_for_random_ids(
    tok: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 25))]
        detok, deltas, _ = stream(tok, ids, params)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == expected
        assert "".join(deltas) == expected


def test_multibyte_text_streams_without_replacement_chars(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The test only means something if some tokens are partial UTF-8 sequences.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok, deltas, _ = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == MULTIBYTE_TEXT


def test_first_output_token_is_decoded_after_the_prompt(tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox 😀 jumps", add_special_tokens=False)
    prompt, output = ids[:5], ids[5:]
    detok, deltas, _ = stream(tok, output, prompt=prompt)
    assert "".join(deltas) == detok.output_text == tok.decode(output)


def test_finish_flushes_an_incomplete_utf8_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(ids[:cut])
    held = detok.get_delta(finished=False)
    assert "\ufffd" not in held
    assert held + detok.get_delta(finished=True) == tok.decode(ids[:cut])


def assert_stop_never_leaks(deltas: list[str], stop: str) -> None:
    emitted = ""
    for d in deltas:
        emitted += d
        assert stop not in emitted


def test_stop_string_split_across_tokens_is_truncated_and_never_streamed(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    stop = "k brown f"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # the stop string spans several tokens
    detok, deltas, matches = stream(tok, ids, SamplingParams(stop=stop))
    assert detok.output_text == "The quic"
    assert "".join(deltas) == detok.output_text
    assert_stop_never_leaks(deltas, stop)
    assert matches[-1] == stop and all(m is None for m in matches[:-1])
    assert detok.stop_string == stop
    # The match is reported by the token that completes it, not later.
    assert stop in tok.decode(ids[: len(matches)]) and stop not in tok.decode(
        ids[: len(matches) - 1]
    )


def test_include_stop_str_in_output_keeps_the_stop_string(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop="fox j", include_stop_str_in_output=True)
    detok, deltas, matches = stream(tok, ids, params)
    assert detok.output_text == "The quick brown fox j"
    assert "".join(deltas) == detok.output_text
    assert matches[-1] == "fox j"


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "Hello world! The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    stops = ["lazy", "jumps", "quick brown"]
    detok, deltas, matches = stream(tok, ids, SamplingParams(stop=stops))
    assert detok.output_text == "Hello world! The "
    assert matches[-1] == "quick brown"
    for stop in stops:
        assert_stop_never_leaks(deltas, stop)
    assert "".join(deltas) == detok.output_text


def test_many_stop_strings_match_as_a_full_search_would(tok: Tokenizer) -> None:
    # The per-token check only tries stop strings ending in a new character; the outcome must
    # be a full search's after each token: at the first token that completes any match, the
    # earliest match, and at one position the stop string given first.
    rng = random.Random(0)
    text = "Hello world! The quick brown fox jumps over the lazy dog. " * 3  # ASCII
    ids = tok.encode(text, add_special_tokens=False)
    prefixes = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    words = text.split()
    for _ in range(30):
        stops = [f"{w}#{i}" for i, w in enumerate(rng.sample(words, 8))]  # never match
        for _ in range(rng.randint(1, 6)):
            start = rng.randrange(len(text) - 8)
            stops.append(text[start : start + rng.randint(1, 8)])
        rng.shuffle(stops)
        stops = list(dict.fromkeys(stops))[:MAX_STOP_STRINGS]
        seen = next(p for p in prefixes if any(s in p for s in stops))
        found = {s: seen.find(s) for s in stops if s in seen}
        first = min(found.values())
        expected = next(s for s in stops if found.get(s) == first)
        detok, deltas, _ = stream(tok, ids, SamplingParams(stop=stops))
        assert detok.stop_string == expected, stops
        assert detok.output_text == text[:first]
        assert "".join(deltas) == detok.output_text


def test_stop_string_in_multibyte_text_never_leaks(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    stop = "🎉 rés"
    detok, deltas, _ = stream(tok, ids, SamplingParams(stop=[stop, "nothing"]))
    assert detok.output_text == MULTIBYTE_TEXT[: MULTIBYTE_TEXT.index(stop)]
    assert "".join(deltas) == detok.output_text
    assert_stop_never_leaks(deltas, stop)
    assert all("\ufffd" not in d for d in deltas)


def test_stop_strings_are_ignored_before_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("STOP here. The end", add_special_tokens=False)
    detok, deltas, _ = stream(tok, ids, SamplingParams(stop="STOP", min_tokens=len(ids)))
    assert detok.stop_string is None
    assert "".join(deltas) == detok.output_text == "STOP here. The end"


def test_stop_token_text_is_left_out_when_it_ends_the_request(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hello", add_special_tokens=False), tok.eos_token_id]
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "Hello"
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids)
    assert detok.output_text == "Hello<|endoftext|>"


def test_chat_template_renders_messages(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
    ]
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1  # <|im_start|> is one special token
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == rendered.rsplit("<|im_start|>", 1)[0]


def test_chat_template_gets_developer_as_system_and_text_parts_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    ids = tok.apply_chat_template([{"role": "developer", "content": parts}])
    rendered = "<|im_start|>system\nBe\nbrief.<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(rendered, add_special_tokens=False)


def test_chat_template_error_is_a_value_error_naming_it(tok: Tokenizer) -> None:
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ValueError, match="refused these messages: Conversation roles must"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)


def test_chat_without_template_is_a_value_error(tiny_tokenizer_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_directory_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_generation_config_adds_eos_token_ids(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_id == 0
    assert tok.eos_token_ids == [0, 2]


def test_id_to_token_text_is_the_single_token_decode(tok: Tokenizer) -> None:
    for token_id in tok.encode("Hello world", add_special_tokens=False):
        assert tok.id_to_token_text(token_id) == tok.decode([token_id])
    assert tok.id_to_token_text(0) == "<|endoftext|>"


class _FailingStream:
    def step(self, tokenizer: object, token_id: int) -> str | None:
        raise Exception("Invalid prefix encountered")


def test_decode_stream_error_restarts_without_losing_text(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = []
    for n, token_id in enumerate(ids):
        if n % 4 == 3:
            detok._stream = _FailingStream()  # what DecodeStream does on a changed prefix
        detok.update([token_id])
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == MULTIBYTE_TEXT
