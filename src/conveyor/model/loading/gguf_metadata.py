"""A GGUF file's model metadata, checked against its tensors before anything is allocated.

The metadata sizes everything the engine builds: `block_count` layers, a rotary table of
`context_length` rows, heads of `embedding_length / head_count` values. A value that does not
match the tensors would build a model the weights cannot fill (or one of 2^31 layers), so
each is checked against the tensor shapes it implies (numpy order: rows first; Llama's names,
which a family's GGUFNames may rename):

    token_embd.weight        [vocab, embedding_length]       output.weight: the same
    blk.N.attn_q.weight      [head_count * head_dim, embedding_length]
    blk.N.attn_k / attn_v    [head_count_kv * head_dim, embedding_length]
    blk.N.ffn_gate / ffn_up  [feed_forward_length, embedding_length]
    blk.N for N in 0 .. block_count - 1, no other N

(head_dim: `attention.key_length`, else embedding_length / head_count.) Values with no
tensor to match (context_length, rope and norm constants, token ids) get a range. Each
failure is one ValueError line: the key, its value, what it should be. Imports no torch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from conveyor.model.loading.gguf_file import GGUFFile, GGUFTensor

# The longest context a file may claim: that of the longest llama / qwen2 / qwen3 models
# released (Gradient's Llama-3 8B 4194k: 4,194,304; Qwen2.5-1M: 1,010,000). The rotary table
# has a row per position (a few GiB at this bound with 128-wide heads, not 2^31 rows).
MAX_GGUF_CONTEXT = 1 << 22
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class GGUFModelShape:
    """The checked values the model is built from."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    sliding_window: int | None


def describe(value: Any) -> str:
    """A metadata value as an error message shows it: the value itself, or its kind."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (bool, np.bool_)):
        return f"the boolean {bool(value)}"
    if isinstance(value, (int, float, np.number)):
        return str(value)
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)} values"
    return f"a {type(value).__name__}"


class _Checker:
    def __init__(
        self,
        file: str | os.PathLike[str],
        reader: GGUFFile,
        arch: str,
        gguf_name: Callable[[str], str],
    ) -> None:
        self.file, self.metadata, self.arch = file, reader.metadata, arch
        self.tensors = {t.name: t for t in reader.tensors}
        self.embed = gguf_name("model.embed_tokens.weight")
        self.output = gguf_name("lm_head.weight")
        layer = "model.layers.0."
        leaves = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
        modules = ("self_attn.",) * 3 + ("mlp.",) * 3
        self.layer0 = {
            leaf: gguf_name(f"{layer}{module}{leaf}.weight")
            for module, leaf in zip(modules, leaves, strict=True)
        }

    def fail(self, key: str, value: Any, should: str) -> ValueError:
        return ValueError(f"GGUF file {self.file}: {key} is {describe(value)}; {should}.")

    def same(self, name: str, expected: int, why: str) -> None:
        """`name`, when given, must be the integer `expected`."""
        if f"{self.arch}.{name}" in self.metadata:
            value = self.integer(name, 0, 1 << 62)
            if value != expected:
                raise self.fail(f"{self.arch}.{name}", value, f"it should be {expected} ({why})")

    def integer(self, name: str, lo: int, hi: int, default: int | None = None) -> int:
        key = f"{self.arch}.{name}"
        value = self.metadata.get(key, default)
        if value is None:
            raise ValueError(f"GGUF file {self.file} has no {key} (an integer); it is required.")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise self.fail(key, value, "it must be an integer")
        if not lo <= value <= hi:
            raise self.fail(key, value, f"it must be an integer from {lo} to {hi}")
        return int(value)

    def real(self, name: str, default: float, lo: float, hi: float) -> float:
        key = f"{self.arch}.{name}"
        value = self.metadata.get(key, default)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise self.fail(key, value, "it must be a number")
        if not (math.isfinite(value) and lo < value < hi):
            raise self.fail(key, value, f"it must be a finite number above {lo:g} and below {hi:g}")
        return float(value)

    def match(self, name: str, value: int, tensor: str, axis: int, factor: int = 1) -> None:
        """`value * factor` must be `tensor`'s size along `axis` (when the file has it)."""
        found = self.tensors.get(tensor)
        if found is None or len(found.shape) <= axis:
            return
        size = found.shape[axis]
        if value * factor != size:
            what = "rows" if axis == 0 else "columns"
            should = size // factor if size % factor == 0 else None
            per = f", {factor} per head" if factor != 1 else ""
            hint = f"it should be {should}" if should else "no integer fits"
            raise self.fail(
                f"{self.arch}.{name}", value, f"{tensor} has {size} {what}{per}, so {hint}"
            )

    def tensor(self, name: str) -> GGUFTensor:
        found = self.tensors.get(name)
        if found is None:
            raise ValueError(f"GGUF file {self.file} has no {name} tensor.")
        return found


def check_gguf_metadata(
    file: str | os.PathLike[str], reader: GGUFFile, arch: str, gguf_name: Callable[[str], str]
) -> GGUFModelShape:
    """Check the model metadata of `reader` (architecture `arch`) against its tensors.

    Args:
        gguf_name: the family's GGUF tensor name of an HF name (GGUFNames.gguf_name).

    Returns:
        The checked values.
    Raises:
        ValueError: the first value that is missing, of the wrong type, out of range or
            inconsistent with the tensors (one line: key, value, what it should be).
    """
    c = _Checker(file, reader, arch, gguf_name)
    t = c.layer0  # layer 0's weights' names, by HF leaf
    embed = c.tensor(c.embed)
    if len(embed.shape) != 2:
        raise ValueError(
            f"GGUF file {file}: {c.embed} has shape {list(embed.shape)}; it should be "
            "[vocab, embedding_length]."
        )
    vocab = embed.shape[0]
    hidden = c.integer("embedding_length", 0, 1 << 62)  # the tensor says what it should be
    c.match("embedding_length", hidden, c.embed, 1)
    c.integer("embedding_length", 1, 1 << 20)
    layers = sorted({int(m.group(1)) for n in c.tensors if (m := _BLOCK.match(n))})
    blocks = c.integer("block_count", 1, 1 << 62)
    contiguous = layers == list(range(len(layers)))  # blk.0 ... blk.N-1, none missing
    if not contiguous:
        raise c.fail(
            f"{arch}.block_count",
            blocks,
            f"the file's layer tensors are numbered {layers[:8]}..., not 0 to N - 1",
        )
    if blocks != len(layers):
        held = f"blk.0 to blk.{len(layers) - 1}" if layers else "none"
        raise c.fail(
            f"{arch}.block_count",
            blocks,
            f"the file holds tensors for {len(layers)} layers ({held}), so it should be "
            f"{len(layers)}",
        )
    heads = c.integer("attention.head_count", 1, hidden)
    kv_heads = c.integer("attention.head_count_kv", 1, heads, default=heads)
    if heads % kv_heads:
        raise c.fail(
            f"{arch}.attention.head_count_kv",
            kv_heads,
            f"it must divide attention.head_count ({heads})",
        )
    key_length = f"{arch}.attention.key_length"
    if key_length not in c.metadata and hidden % heads:
        raise c.fail(
            f"{arch}.attention.head_count",
            heads,
            f"without attention.key_length it must divide embedding_length ({hidden})",
        )
    head_dim = c.integer("attention.key_length", 2, 1 << 12, default=hidden // heads)
    if head_dim % 2:
        raise c.fail(key_length, head_dim, "rotary embeddings need an even head size")
    c.same("attention.value_length", head_dim, "conveyor needs values as wide as keys")
    c.same("rope.dimension_count", head_dim, "rotary embeddings over the whole head")
    c.match("attention.head_count", heads, t["q_proj"], 0, head_dim)
    c.match("attention.head_count_kv", kv_heads, t["k_proj"], 0, head_dim)
    c.match("attention.head_count_kv", kv_heads, t["v_proj"], 0, head_dim)
    for leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        c.match("embedding_length", hidden, t[leaf], 1)
    ffn = c.integer("feed_forward_length", 0, 1 << 62)  # the tensors say what it should be
    for leaf in ("gate_proj", "up_proj"):
        c.match("feed_forward_length", ffn, t[leaf], 0)
    c.match("feed_forward_length", ffn, t["down_proj"], 1)
    c.integer("feed_forward_length", 1, 1 << 20)
    c.same("vocab_size", vocab, f"{c.embed}'s rows")
    c.match("embedding_length", hidden, c.output, 1)
    output = c.tensors.get(c.output)
    if output is not None and output.shape[0] != vocab:
        raise ValueError(
            f"GGUF file {file}: {c.output} has {output.shape[0]} rows but {c.embed} "
            f"{vocab}; both should have one per token."
        )
    _check_tokens(c, vocab)
    context = c.integer("context_length", 1, MAX_GGUF_CONTEXT, default=2048)
    window = c.integer("attention.sliding_window", 0, MAX_GGUF_CONTEXT, default=0)
    factor = None
    if c.metadata.get(f"{arch}.rope.scaling.type") == "linear":
        factor = c.real("rope.scaling.factor", 1.0, 0.0, 1e6)
    return GGUFModelShape(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=c.real("attention.layer_norm_rms_epsilon", 1e-6, 0.0, 1.0),
        rope_theta=c.real("rope.freq_base", 10000.0, 0.0, math.inf),
        rope_scaling_factor=factor,
        sliding_window=window or None,
    )


def _check_tokens(c: _Checker, vocab: int) -> None:
    """The vocabulary (when the file has one) has a token per embedding row, and its special
    token ids are tokens."""
    tokens = c.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise c.fail("tokenizer.ggml.tokens", tokens, "it must be an array of strings")
    if len(tokens) != vocab:
        raise ValueError(
            f"GGUF file {c.file}: tokenizer.ggml.tokens lists {len(tokens)} tokens but "
            f"{c.embed} has {vocab} rows; they should be equal."
        )
    merges = c.metadata.get("tokenizer.ggml.merges")
    if merges is not None and (
        not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)
    ):
        raise c.fail("tokenizer.ggml.merges", merges, "it must be an array of strings")
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        key = f"tokenizer.ggml.{name}_token_id"
        value = c.metadata.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise c.fail(key, value, "it must be a token id (an integer)")
        if not 0 <= value < vocab:
            raise c.fail(key, value, f"it must be a token id from 0 to {vocab - 1}")
    for name in ("token_type", "scores"):
        key = f"tokenizer.ggml.{name}"
        values = c.metadata.get(key)
        if values is not None and len(values) != vocab:
            raise ValueError(
                f"GGUF file {c.file}: {key} has {len(values)} values; it should have one per "
                f"token ({vocab})."
            )
