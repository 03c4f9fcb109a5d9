"""Hostile GGUF files: every metadata value is checked against the tensors before anything is
allocated, and each bad value, bad string or truncated array is one clear ValueError line
(issue 27, item 10).

Each case writes the same tiny llama checkpoint (hidden 64, 2 layers, 4 heads of 16, 2 KV
heads, ffn 128) as a GGUF file with one value changed (tests/gguf_files.py's `metadata`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as V
from tests.gguf_files import write_gguf
from tests.hf_checkpoints import write_checkpoint

from conveyor import LLM
from conveyor.model.loading.gguf_file import GGUFFile
from conveyor.model.loading.gguf_loader import GGUF_ARCHITECTURES, read_gguf_config

U32, F32, STR = V.UINT32, V.FLOAT32, V.STRING
BIG = 2**31 - 1
# (metadata {key: (value, type)}, the error it must give)
CASES = {
    "context_length-2^31-1": (
        {"{arch}.context_length": (BIG, U32)},
        r"llama\.context_length is 2147483647; it must be an integer from 1 to 4194304\.",
    ),
    "block_count-2^31-1": (
        {"{arch}.block_count": (BIG, U32)},
        r"llama\.block_count is 2147483647; the file holds tensors for 2 layers "
        r"\(blk\.0 to blk\.1\), so it should be 2\.",
    ),
    "block_count-1": (
        {"{arch}.block_count": (1, U32)},
        r"llama\.block_count is 1; the file holds tensors for 2 layers .* should be 2\.",
    ),
    "block_count-string": (
        {"{arch}.block_count": ("two", STR)},
        r"llama\.block_count is 'two'; it must be an integer\.",
    ),
    "embedding_length-0": (
        {"{arch}.embedding_length": (0, U32)},
        r"llama\.embedding_length is 0; token_embd\.weight has 64 columns, so it should be 64\.",
    ),
    "embedding_length-48": (
        {"{arch}.embedding_length": (48, U32)},
        r"llama\.embedding_length is 48; token_embd\.weight has 64 columns, so it should be 64",
    ),
    "head_count-0": (
        {"{arch}.attention.head_count": (0, U32)},
        r"llama\.attention\.head_count is 0; it must be an integer from 1 to 64\.",
    ),
    "head_count-8": (
        {"{arch}.attention.head_count": (8, U32)},
        r"llama\.attention\.head_count is 8; blk\.0\.attn_q\.weight has 64 rows, 16 per head, "
        r"so it should be 4\.",
    ),
    "head_count_kv-0": (
        {"{arch}.attention.head_count_kv": (0, U32)},
        r"llama\.attention\.head_count_kv is 0; it must be an integer from 1 to 4\.",
    ),
    "head_count_kv-3": (
        {"{arch}.attention.head_count_kv": (3, U32)},
        r"llama\.attention\.head_count_kv is 3; it must divide attention\.head_count \(4\)\.",
    ),
    "head_count_kv-4": (
        {"{arch}.attention.head_count_kv": (4, U32)},
        r"head_count_kv is 4; blk\.0\.attn_k\.weight has 32 rows, 16 per head, so it should be 2",
    ),
    "key_length-odd": (
        {"{arch}.attention.key_length": (15, U32)},
        r"llama\.attention\.key_length is 15; rotary embeddings need an even head size\.",
    ),
    "value_length": (
        {"{arch}.attention.value_length": (8, U32)},
        r"llama\.attention\.value_length is 8; it should be 16",
    ),
    "feed_forward_length-7": (
        {"{arch}.feed_forward_length": (7, U32)},
        r"feed_forward_length is 7; blk\.0\.ffn_gate\.weight has 128 rows, so it should be 128\.",
    ),
    "feed_forward_length-0": (
        {"{arch}.feed_forward_length": (0, U32)},
        r"feed_forward_length is 0; blk\.0\.ffn_gate\.weight has 128 rows, so it should be 128\.",
    ),
    "vocab_size": (
        {"{arch}.vocab_size": (10, U32)},
        r"llama\.vocab_size is 10; it should be \d+ \(token_embd\.weight's rows\)\.",
    ),
    "rms_epsilon-0": (
        {"{arch}.attention.layer_norm_rms_epsilon": (0.0, F32)},
        r"layer_norm_rms_epsilon is 0\.0; it must be a finite number above 0 and below 1\.",
    ),
    "rope_freq_base-nan": (
        {"{arch}.rope.freq_base": (float("nan"), F32)},
        r"llama\.rope\.freq_base is nan; it must be a finite number above 0",
    ),
    "rope_scaling_factor-0": (
        {
            "{arch}.rope.scaling.type": ("linear", STR),
            "{arch}.rope.scaling.factor": (0.0, F32),
        },
        r"llama\.rope\.scaling\.factor is 0\.0; it must be a finite number above 0",
    ),
    "eos_token_id": (
        {"tokenizer.ggml.eos_token_id": (BIG, U32)},
        r"tokenizer\.ggml\.eos_token_id is 2147483647; it must be a token id from 0 to \d+\.",
    ),
    "architecture-array": (
        {"general.architecture": ([1, 2], V.ARRAY)},
        r"has architecture an array of 2 values; conveyor loads "
        + re.escape(", ".join(GGUF_ARCHITECTURES))
        + r" GGUF files\.",
    ),
    "rope_scaling_type-number": (
        {"{arch}.rope.scaling.type": (3, U32)},
        r"llama\.rope\.scaling\.type is 3; it must be a string",
    ),
    "merges-numbers": (
        {"tokenizer.ggml.merges": ([1, 2], V.ARRAY)},
        r"tokenizer\.ggml\.merges is an array of 2 values; it must be an array of strings\.",
    ),
    "alignment-0": (
        {"general.alignment": (0, U32)},
        r"general\.alignment is 0; it must be a power of two",
    ),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tokenizer_dir):
    return write_checkpoint(tmp_path_factory.mktemp("hf"), "llama", tiny_tokenizer_dir)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_metadata_value_is_one_clear_error(case, hf_dir, tmp_path) -> None:
    metadata, message = CASES[case]
    file = write_gguf(hf_dir, tmp_path / "bad.gguf", QType.F32, metadata=metadata)
    with pytest.raises(ValueError, match=message) as info:
        read_gguf_config(file)
    assert "\n" not in str(info.value)


def test_the_unchanged_file_passes_every_check(hf_dir, tmp_path) -> None:
    config = read_gguf_config(write_gguf(hf_dir, tmp_path / "good.gguf", QType.F32))
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)


_PEAK_RSS = """
import gc, json, resource, sys
from conveyor import LLM
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
good, *bad = sys.argv[1:]
LLM(good, num_kv_blocks=16)  # torch, the tokenizer and the kernels are loaded: the baseline
gc.collect()
baseline = peak()
errors = []
for path in bad:
    try:
        LLM(path, num_kv_blocks=16)
    except ValueError as exc:
        errors.append(str(exc))
print(json.dumps([errors, baseline, peak()]))
"""


def test_huge_context_and_block_counts_fail_before_allocating(hf_dir, tmp_path) -> None:
    """Before: 2^31-1 context_length or block_count made LLM use more than 8 GB. Now both
    fail before the process grows past what loading a good file of the same model took."""
    good = write_gguf(hf_dir, tmp_path / "good.gguf", QType.F32)
    files = [good] + [
        write_gguf(hf_dir, tmp_path / f"{key}.gguf", QType.F32, metadata={key: (BIG, U32)})
        for key in ("{arch}.context_length", "{arch}.block_count")
    ]
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    errors, baseline_kib, peak_kib = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == 2
    assert "context_length is 2147483647" in errors[0]
    assert "block_count is 2147483647" in errors[1]
    # A 2^31-row table would be 16 GiB; the two refusals may add a little Python garbage.
    grown = peak_kib - baseline_kib
    assert grown < 256 * 1024, f"peak RSS grew {grown} KiB over {baseline_kib} KiB"


def _patched(file, old: bytes, new: bytes):
    data = file.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    file.write_bytes(data.replace(old, new))
    return file


def test_a_string_that_is_not_utf8_is_named(hf_dir, tmp_path) -> None:
    file = write_gguf(hf_dir, tmp_path / "s.gguf", QType.F32)
    _patched(file, b"tiny-llama", b"tiny-\xd0\xd0ama")
    with pytest.raises(
        ValueError, match=r"the value of general\.name is not valid UTF-8 \(byte 0xd0 at file"
    ):
        LLM(str(file))


def test_a_key_that_is_not_utf8_is_named(hf_dir, tmp_path) -> None:
    file = write_gguf(hf_dir, tmp_path / "k.gguf", QType.F32)
    _patched(file, b"general.name", b"general.\xffame")
    with pytest.raises(ValueError, match=r"metadata key #\d+ is not valid UTF-8 \(byte 0xff"):
        GGUFFile(file)


def test_a_truncated_array_is_named(hf_dir, tmp_path) -> None:
    file = write_gguf(hf_dir, tmp_path / "t.gguf", QType.F32)
    data = file.read_bytes()
    start = data.index(b"tokenizer.ggml.tokens")
    file.write_bytes(data[: start + 200])  # inside the token list
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.tokens.* \(truncated\?\)"):
        GGUFFile(file)


def test_an_array_count_beyond_the_file_is_named(hf_dir, tmp_path) -> None:
    file = write_gguf(hf_dir, tmp_path / "c.gguf", QType.F32)
    data = bytearray(file.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = data.index(key) + len(key) + 4 + 4  # past the key, ARRAY, INT32: the count
    data[at : at + 8] = (2**40).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(
        ValueError,
        match=r"the 1099511627776 INT32 values of tokenizer\.ggml\.token_type at byte \d+ need "
        r"4398046511104 bytes, but the file has \d+ left \(truncated\?\)",
    ):
        GGUFFile(file)


def test_a_tensor_with_a_zero_dimension_is_named(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "z.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((0, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ValueError, match=r"tensor token_embd\.weight has dimensions \[32, 0\]; each must be"
    ):
        GGUFFile(tmp_path / "z.gguf")


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_copied_tensors_pages_leave_the_resident_set_and_still_read_back(tmp_path) -> None:
    """The loader drops each tensor's file pages once it copied them (gguf_file.drop_pages),
    so a load does not end with the whole file resident on top of the weights."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((1024, 2048)).astype(np.float32)  # 8 MiB
    writer = gguf.GGUFWriter(str(tmp_path / "one.gguf"), "llama")
    writer.add_tensor("big", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFFile(tmp_path / "one.gguf")
    (tensor,) = reader.tensors
    assert tensor.offset % 32 == 0 and np.array_equal(tensor.data, values)  # every page read
    before = _rss_file_kib()
    reader.drop_pages(tensor)
    assert before - _rss_file_kib() >= 7 * 1024  # the 8 MiB, less pages shared at the edges
    assert np.array_equal(tensor.data, values)  # faulted back in from the file
