"""GGUF files: conveyor's greedy tokens equal transformers' on the same file.

Each case writes a random HF checkpoint of one family (tests/hf_checkpoints.py), lays it out as
a GGUF file of one tensor type (tests/gguf_files.py), then runs transformers'
`from_pretrained(folder, gguf_file=...)` and `LLM(file.gguf)` on the same prompts. The K-quants
need rows of 256 values, so their case uses a wider model.
"""

from __future__ import annotations

import random
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from tests.gguf_files import write_gguf
from tests.hf_checkpoints import greedy_reference, write_checkpoint
from tests.logprobs_close import check_logprobs_close

from conveyor import LLM, SamplingParams
from conveyor.engine.gguf_tokenizer import gguf_tokenizer
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.cpu import cpu_kernels
from conveyor.model.cpu.quant_linear import GEMM_ROWS, QUANT_TYPES, QuantEmbedding, QuantLinear
from conveyor.model.loading.checkpoint import check_checkpoint

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
# (family, weights' type, token_embd's type or None, config overrides)
CASES = {
    "llama-q8_0": ("llama", QType.Q8_0, None, {}),
    "llama-q4_0": ("llama", QType.Q4_0, None, {}),
    "qwen2-q4_1-embed-q8_0": ("qwen2", QType.Q4_1, QType.Q8_0, {}),
    # transformers' GGUF reader leaves Qwen3's head_dim at Qwen3Config's 128 (it ignores
    # attention.key_length), as every released Qwen3 has; conveyor reads key_length.
    "qwen3-f16": ("qwen3", QType.F16, None, {"head_dim": 128}),
    "llama-bf16": ("llama", QType.BF16, None, {}),
    "qwen2-f32": ("qwen2", QType.F32, None, {}),
    "llama-q4_k-embed-q6_k": ("llama", QType.Q4_K, QType.Q6_K, WIDE),
    # Q5_K weights; Q5_0 is what llama.cpp's Q4_K_M falls back to for widths not a multiple
    # of 256 (dequantized at load).
    "qwen2-q5_k-embed-q5_0": ("qwen2", QType.Q5_K, QType.Q5_0, WIDE),
    # MXFP4 (E8M0 scales, E2M1 values): what llama.cpp's MXFP4_MOE files hold
    "llama-mxfp4-embed-q8_0": ("llama", QType.MXFP4, QType.Q8_0, {}),
}
PROMPTS = 4


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_case(request, tmp_path_factory, tiny_tokenizer_dir):
    family, qtype, embed_qtype, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = write_checkpoint(root / "hf", family, tiny_tokenizer_dir, **overrides)
    folder = root / "gguf"
    folder.mkdir()
    file = write_gguf(hf_dir, folder / f"{request.param}.gguf", qtype, embed_qtype)
    rng = random.Random(7)
    vocab = transformers.AutoConfig.from_pretrained(hf_dir).vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(PROMPTS)]
    max_tokens = [rng.randint(8, 20) for _ in range(PROMPTS)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=file.name, dtype=torch.float32
    )
    expected = greedy_reference(hf, prompts, max_tokens)
    return request.param, hf_dir, file, prompts, max_tokens, expected


def _kept_quantized(name: str) -> bool:
    return CASES[name][1].name in QUANT_TYPES


def test_gguf_greedy_tokens_equal_transformers_on_the_same_file(gguf_case):
    name, _, file, prompts, max_tokens, expected = gguf_case
    # The folder form for one case, the file itself for the others. Exact parity is for the
    # dequantized weights: linear_backend "onednn" (the default keeps QUANT_TYPES
    # quantized, judged below).
    model = str(file.parent) if name == "llama-q8_0" else str(file)
    backend = "onednn" if _kept_quantized(name) else "auto"
    llm = LLM(model, num_kv_blocks=64, dtype="float32", linear_backend=backend)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def _counted(fn, calls: list[int]):
    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted


def test_quantized_gguf_weights_stay_quantized_and_their_greedy_output_is_close(
    gguf_case, monkeypatch
):
    name, _, file, prompts, max_tokens, _ = gguf_case
    if not _kept_quantized(name) or cpu_kernels.load() is None:
        pytest.skip("a type that is dequantized at load (or no C kernels here)")
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=5) for m in max_tokens]
    # three prompts of 100 tokens and more: their first step, GEMM_ROWS rows or more, takes
    # a long prefill's GEMM (the model's context is 256)
    tokens = [t for p in prompts for t in p] * 100
    long_prompts = [tokens[i : i + 100 + 10 * i] for i in range(3)]
    assert sum(map(len, long_prompts)) >= GEMM_ROWS
    runs = {}
    # the file's blocks (activations in 2 passes, and in llama.cpp's 1), and the file
    # dequantized
    for backend, passes in (("auto", 2), ("auto", 1), ("onednn", 2)):
        llm = LLM(
            str(file), num_kv_blocks=64, dtype="float32", linear_backend=backend,
            quant_activation_passes=passes,
        )  # fmt: skip
        model = llm.llm_engine.runner.model
        quantized = [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
        # every linear, and the embedding and the (tied or not) head where their type is kept
        # (the Q5_0 embedding is dequantized, and tied, so is its head)
        _, qtype, embed_qtype, _ = CASES[name]
        ends = 2 if (embed_qtype or qtype).name in QUANT_TYPES else 0
        assert len(quantized) == (4 * model.config.num_hidden_layers + ends if backend == "auto"
                                  else 0)  # fmt: skip
        assert all(m.passes == passes for m in quantized if isinstance(m, QuantLinear))
        runs[backend, passes] = llm.generate(prompts, params, use_tqdm=False)
        if passes == 2:
            gemms: list[int] = []
            monkeypatch.setattr(QuantLinear, "_gemm", _counted(QuantLinear._gemm, gemms))
            runs[backend, "long"] = llm.generate(long_prompts, params[:3], use_tqdm=False)
            monkeypatch.undo()
            # (AVX-512 without BF16 keeps its integer kernels: no GEMM there)
            linears = [m for m in quantized if isinstance(m, QuantLinear)]
            assert bool(gemms) == (backend == "auto" and linears[0].gemm_rows is not None)
    check_logprobs_close(runs["auto", 2], runs["onednn", 2])
    check_logprobs_close(runs["auto", 1], runs["onednn", 2])
    check_logprobs_close(runs["auto", "long"], runs["onednn", "long"])


def test_a_llama3_gguf_applies_its_rope_freqs_like_the_hf_model(tmp_path, tiny_tokenizer_dir):
    """Llama 3.1+ files carry llama3 rope scaling as rope_freqs.weight. transformers' GGUF
    loader does not read that tensor, so the reference is the HF checkpoint the file was
    written from (rope_type llama3, original context 64): prompts run past position 64."""
    hf_dir = write_checkpoint(tmp_path / "hf", "llama3-rope", tiny_tokenizer_dir)
    file = write_gguf(hf_dir, tmp_path / "llama3.gguf", QType.F32)
    (freqs,) = [t for t in gguf.GGUFReader(file).tensors if t.name == "rope_freqs.weight"]
    assert freqs.data.min() == 1.0 and freqs.data.max() == 8.0  # short kept, long slowed 8x
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rng = random.Random(3)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (40, 70, 100)]
    max_tokens = [40, 30, 20]
    expected = greedy_reference(hf, prompts, max_tokens)
    llm = LLM(str(file), num_kv_blocks=64, dtype="float32")
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_gguf_tokenizer_and_chat_template_come_from_the_file(gguf_case):
    _, hf_dir, file, _, _, _ = gguf_case
    ours = Tokenizer.from_pretrained(file)
    original = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = "Hello world! The quick brown fox, 😀 日本語"
    assert ours.encode(text) == original.encode(text)
    assert ours.eos_token_id == original.eos_token_id
    messages = [{"role": "user", "content": "Hello world!"}]
    assert ours.apply_chat_template(messages) == original.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _gguf_with(path, arch, tensors):
    """A GGUF file with only these tensors ({name: (array, raw type or None)})."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (value, raw) in tensors.items():
        w.add_tensor(name, value, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_gguf_architecture_is_named(tmp_path):
    path = _gguf_with(
        tmp_path / "g.gguf", "gemma2", {"token_embd.weight": (np.ones((4, 32), np.float32), None)}
    )
    with pytest.raises(
        ValueError, match=r"architecture 'gemma2'; conveyor loads llama, qwen2, qwen3"
    ):
        LLM(str(path))


def test_an_unsupported_gguf_tensor_type_is_named(tmp_path):
    q2k = np.zeros((4, 84), np.uint8)  # one Q2_K block (84 bytes) per row of 256 values
    path = _gguf_with(tmp_path / "g.gguf", "llama", {"blk.0.attn_q.weight": (q2k, QType.Q2_K)})
    with pytest.raises(
        ValueError, match=r"blk\.0\.attn_q\.weight .* is Q2_K, which conveyor cannot"
    ):
        LLM(str(path))


def test_a_folder_with_two_gguf_files_asks_for_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        _gguf_with(
            tmp_path / name, "llama", {"token_embd.weight": (np.ones((4, 32), np.float32), None)}
        )
    with pytest.raises(ValueError, match=r"several GGUF files \(a\.gguf, b\.gguf\); pass the one"):
        check_checkpoint(str(tmp_path))


def test_a_gguf_named_file_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"is not a GGUF file"):
        check_checkpoint(str(fake))


def test_the_gguf_tokenizer_is_transformers_own_built_without_torch(gguf_case):
    """engine/gguf_tokenizer.py reads the file with conveyor's reader (no torch, for the
    server process) and gives what transformers' from_pretrained(gguf_file=...) gives."""
    _, _, file, _, _, _ = gguf_case
    ours = gguf_tokenizer(file)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(file.parent), gguf_file=file.name
    )
    texts = ["Hello world! The quick brown fox, 😀 日本語", "  two  spaces\n\ttab", ""]
    texts.append(f"{theirs.eos_token} after eos {theirs.bos_token or ''}")
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    ids = theirs.encode(texts[0])
    assert ours.decode(ids) == theirs.decode(ids)
    code = (
        "import sys; from conveyor.engine.tokenizer import Tokenizer; "
        f"Tokenizer.from_pretrained({str(file)!r}); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
