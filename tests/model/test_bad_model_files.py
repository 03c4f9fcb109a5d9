"""Model files that cannot serve are refused at load with one clear line (issue 49, item 7).

Before, of 50 crafted GGUF files, four printed a traceback (no tokens, no merges, duplicate
tokens, empty tokens) and two loaded and then answered 500 to every request (NaN weights; F32
data labelled BF16). Now the tokenizer's metadata is checked before transformers builds the
tokenizer (engine/gguf_tokenizer.py), and every weight is checked for values that are not
finite as it is loaded (model/loading/finite_weights.py): floats in full, quantized blocks by
their float16 scales; an HF safetensors checkpoint gets the same check.

Each case is the tiny llama checkpoint of tests/model/test_gguf_metadata.py written with one fault.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as V
from safetensors.torch import load_file, save_file
from tests.gguf_files import write_gguf
from tests.hf_checkpoints import write_checkpoint
from tests.serve_process import conveyor_command, free_port

from conveyor import LLM
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.loading.finite_weights import BLOCK_SCALES
from conveyor.model.loading.gguf_file import GGUFFile
from conveyor.model.loading.gguf_loader import GGUF_TYPES

TOKENS = "tokenizer.ggml.tokens"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tokenizer_dir):
    return write_checkpoint(tmp_path_factory.mktemp("hf"), "llama", tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def tokens(hf_dir, tmp_path_factory) -> list[str]:
    file = write_gguf(hf_dir, tmp_path_factory.mktemp("good") / "good.gguf", QType.F32)
    return list(GGUFFile(file).metadata[TOKENS])


def _with_tokens(tokens: list[str], i: int, token: str) -> dict:
    changed = [*tokens[:i], token, *tokens[i + 1 :]]
    return {"metadata": {TOKENS: (changed, V.ARRAY)}}


def _nan_in_one_weight(name: str, values: np.ndarray) -> np.ndarray:
    if name == "blk.1.ffn_down.weight":
        values = values.copy()
        values[7, 3] = np.nan  # one value: a sampled scan would most likely miss it
    return values


def _f32_bytes_labelled_bf16(name: str, values: np.ndarray):
    """A 2-D weight's float32 bytes under the BF16 type: each value's low half reads as a
    bfloat16 of random exponent (some inf or NaN), its high half as a rounded copy."""
    if values.ndim != 2:
        return values
    return values.view(np.uint8)[:, : values.shape[1] * 2].copy(), QType.BF16


# name -> (write_gguf's arguments, given the good file's tokens; the error, a regex)
CASES = {
    "no-tokens": (
        lambda tokens: {"drop": (TOKENS,)},
        r"GGUF file \S+ has no tokenizer\.ggml\.tokens, so it has no tokenizer: pass --tokenizer",
    ),
    "no-merges": (
        lambda tokens: {"drop": ("tokenizer.ggml.merges",)},
        r"GGUF file \S+: its 'gpt2' \(byte-level BPE\) tokenizer has no tokenizer\.ggml\.merges",
    ),
    "duplicate-tokens": (
        lambda tokens: _with_tokens(tokens, 300, tokens[200]),
        r"GGUF file \S+: tokenizer\.ggml\.tokens\[300\] repeats tokens\[200\] \('.+'\); each "
        r"token must be unique\.",
    ),
    "empty-token": (
        lambda tokens: _with_tokens(tokens, 300, ""),
        r"GGUF file \S+: tokenizer\.ggml\.tokens\[300\] is an empty string; each token must "
        r"have text\.",
    ),
    "nan-weight": (
        lambda tokens: {"edit": _nan_in_one_weight},
        r"GGUF file \S+: tensor blk\.1\.ffn_down\.weight \(F32\) holds nan at \[7, 3\]",
    ),
    "f32-labelled-bf16": (
        lambda tokens: {"edit": _f32_bytes_labelled_bf16},
        r"GGUF file \S+: tensor \S+ \(BF16\) holds (nan|inf|-inf) at \[\d+, \d+\]",
    ),
}


def _write(case: str, hf_dir: Path, tokens: list[str], out: Path) -> Path:
    arguments, _ = CASES[case]
    return write_gguf(hf_dir, out / f"{case}.gguf", QType.F32, **arguments(tokens))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_file_that_cannot_serve_is_one_clear_error_at_load(case, hf_dir, tokens, tmp_path):
    file = _write(case, hf_dir, tokens, tmp_path)
    with pytest.raises(ValueError, match=CASES[case][1]) as info:
        Tokenizer.from_pretrained(file)  # the server process: the tokenizer only
        LLM(str(file), num_kv_blocks=16)  # the engine: the weights too
    assert "\n" not in str(info.value)


def test_quantized_blocks_with_a_scale_that_is_not_finite_are_refused(hf_dir, tmp_path):
    file = write_gguf(hf_dir, tmp_path / "q.gguf", QType.Q8_0)
    data = bytearray(file.read_bytes())
    tensor = next(t for t in GGUFFile(file).tensors if t.name == "blk.0.attn_q.weight")
    block = 5  # Q8_0: 34 bytes a block, its float16 scale first; rows of 64 values, 2 blocks
    data[tensor.offset + 34 * block : tensor.offset + 34 * block + 2] = b"\x00\x7c"  # +inf
    file.write_bytes(bytes(data))
    with pytest.raises(
        ValueError,
        match=r"tensor blk\.0\.attn_q\.weight \(Q8_0\) has a block scale of inf \(row 2, "
        r"block 1\)",
    ):
        LLM(str(file), num_kv_blocks=16)


@pytest.mark.parametrize(
    ("scale", "codes", "what"),
    [(0xFF, 0x00, r"the E8M0 NaN \(0xFF\)"), (254, 0x70, r"the scale 2\^127, which takes")],
)
def test_mxfp4_blocks_with_a_scale_that_is_not_finite_are_refused(
    hf_dir, tmp_path, scale, codes, what
):
    """An E8M0 scale byte of 0xFF (its NaN), or one that takes a value of its block past
    float32's range (6 x 2^127: code 7 in a high nibble); 2^127 with codes of 0 and 0.5 only
    would be finite, and loads."""
    file = write_gguf(hf_dir, tmp_path / "q.gguf", QType.MXFP4)
    data = bytearray(file.read_bytes())
    tensor = next(t for t in GGUFFile(file).tensors if t.name == "blk.0.attn_q.weight")
    at = tensor.offset + 17 * 5  # MXFP4: 17 bytes a block, its scale first; rows of 2 blocks
    data[at : at + 17] = bytes([scale]) + bytes([codes] * 16)
    file.write_bytes(bytes(data))
    with pytest.raises(
        ValueError,
        match=rf"tensor blk\.0\.attn_q\.weight \(MXFP4\) has a block holding {what}.* \(row 2, "
        r"block 1\)",
    ):
        LLM(str(file), num_kv_blocks=16)
    data[at : at + 17] = bytes([254]) + bytes([0x10] * 16)  # 0 and 0.5 x 2^127: finite
    file.write_bytes(bytes(data))
    LLM(str(file), num_kv_blocks=16, linear_backend="torch")


def test_a_safetensors_weight_with_nan_is_refused(tiny_tokenizer_dir, tmp_path):
    folder = write_checkpoint(tmp_path / "hf", "llama", tiny_tokenizer_dir, dtype=torch.bfloat16)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name][2, 9] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor {name} \(bfloat16\) holds nan at \[2, 9\]"):
        LLM(str(folder), num_kv_blocks=16)


@pytest.mark.slow
def test_serve_with_a_bad_file_exits_non_zero_with_one_line_and_no_traceback(
    hf_dir, tokens, tmp_path
):
    for case in ("no-merges", "f32-labelled-bf16"):
        file = _write(case, hf_dir, tokens, tmp_path)
        port = str(free_port())
        command = [*conveyor_command(), "serve", "--model", str(file), "--port", port]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0
        assert "Traceback" not in done.stderr + done.stdout
        errors = [line for line in done.stderr.splitlines() if "GGUF file" in line]
        assert len(errors) == 1, done.stderr
        assert re.search(CASES[case][1], errors[0]), errors[0]


def test_every_gguf_type_conveyor_loads_has_its_values_or_scales_checked() -> None:
    floats = {"F32", "F16", "BF16"}
    assert set(GGUF_TYPES) <= floats | set(BLOCK_SCALES) | {"MXFP4"}  # (its E8M0 scales)
    for name, (size, offsets) in BLOCK_SCALES.items():
        assert GGML_QUANT_SIZES[QType[name]][1] == size, name  # the block's bytes
        assert all(0 <= o <= size - 2 for o in offsets), name
