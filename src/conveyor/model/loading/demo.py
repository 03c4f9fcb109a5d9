"""The embedded demo checkpoint: a small random Llama with a real BPE tokenizer, built offline.

`conveyor serve` without `--model` and the tests need a checkpoint that exists on every machine
without a download. We build one from nothing in a few seconds:

    config.json              LlamaForCausalLM, DEMO_CONFIG below (GQA, tied embeddings)
    model.safetensors        float32 weights from a fixed torch CPU generator seed
    generation_config.json   eos ids: <|im_end|> (ends a chat turn) and <|endoftext|>
    tokenizer.json           byte-level BPE trained at build time on Python's own stdlib text
    tokenizer_config.json    eos token, pad token, ChatML chat template

The weights are random, so the text is gibberish, but every part of the serving path (paged
attention, GQA, RoPE, tied logits, tokenizer, chat template, stop tokens) runs for real, and
transformers loads the same folder, so our outputs can be compared with its outputs exactly.

Determinism: the same bytes every time on the same machine. The tokenizer corpus is a fixed,
sorted list of stdlib files, so it depends on the Python version; the cache folder name says it.
Heavy libraries (torch, tokenizers, transformers) are imported inside the functions that build,
so `demo_model_path()` on a warm cache costs nothing but a few `stat` calls.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# Bump when anything below changes the written bytes: cached folders are keyed by it.
DEMO_RECIPE_VERSION = "2"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# The BPE trainer gives special tokens the first ids in this order: 0, 1, 2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# The whole model recipe, written as config.json. Both rope keys are kept: transformers 5 reads
# `rope_parameters`, older readers (and most other engines) read `rope_theta`.
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "dtype": "float32",
    "torch_dtype": "float32",
    "bos_token_id": 0,  # <|endoftext|>, as Qwen does; never prepended by the tokenizer
    "eos_token_id": 2,  # <|im_end|>
}

GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": 0,
    "eos_token_id": [2, 0],  # <|im_end|> ends a chat turn, <|endoftext|> a document
    "pad_token_id": 0,
}

# ChatML. `content` may be a string or a list of OpenAI-style parts ({"type": "text", ...}).
# ChatML. With `tools`, a system turn lists them first and asks for Hermes-style calls
# (<tool_call>{"name": ..., "arguments": ...}</tool_call>), as Qwen2.5 does; an assistant turn's
# `tool_calls` print in that form, and `tool` turns print like any other role.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions. "
    "Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- args if args is string else (args | tojson) }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Weight scales. transformers' default (normal, std 0.02 everywhere) gives a random Llama that
# mostly repeats its last input token, which would hide attention and position bugs from tests.
# With these scales greedy output changes when the first prompt token changes, the top token
# usually leads by more than one logit, and activations stay below ~20 (safe in fp16/bf16).
_WEIGHT_SEED = 0
_EMBED_STD = 0.5
_LINEAR_STD = 0.08
_NORM_JITTER = 0.1  # norm weights are 1 + N(0, 0.1), so a loader that swaps two norms is caught

# Tokenizer corpus: stdlib sources (code, comments, docstrings) plus pydoc's prose topics.
# Fixed and sorted; a module missing from a slim install is skipped. Capped for build speed.
_CORPUS_MODULES = (
    "_pydecimal", "argparse", "ast", "asyncio.base_events", "calendar", "collections",
    "configparser", "dataclasses", "datetime", "difflib", "doctest", "email.message", "enum",
    "fractions", "functools", "http.client", "http.server", "inspect", "ipaddress",
    "json.decoder", "json.encoder", "logging", "os", "pathlib", "pickle", "pydoc", "shutil",
    "socket", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "zipfile",
)  # fmt: skip
_CORPUS_MAX_CHARS = 3_000_000

DEMO_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def write_demo_model(path: str | os.PathLike[str]) -> Path:
    """Write the demo checkpoint in Hugging Face format (takes ~2-4 s).

    Args:
        path: target directory; created if missing. It must be empty or hold only the demo's
            own files (which are overwritten), so a real checkpoint is never clobbered.

    Returns:
        The directory as a Path.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory.")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in DEMO_FILES)
        if foreign:
            raise ValueError(
                f"{out} is not empty (found {', '.join(foreign[:5])}); "
                "choose an empty or new directory for the demo model."
            )
    out.mkdir(parents=True, exist_ok=True)

    _write_json(out / "config.json", DEMO_CONFIG)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    _save_weights(out / "model.safetensors")
    _save_tokenizer(_train_tokenizer(), out)
    return out


def demo_model_path() -> Path:
    """Return the cached demo checkpoint, building it on first use.

    The folder is `$CONVEYOR_CACHE_DIR` (default `~/.cache/conveyor`) /
    `demo-llama-v{recipe}-py{major}{minor}`. It is built in a temporary sibling folder and
    renamed into place, so a reader never sees a half-written checkpoint; when two processes
    build at once, one rename wins and the other process drops its copy and uses the winner's.

    Returns:
        Path of a complete demo checkpoint directory.
    """
    final = _cache_dir() / (
        f"demo-llama-v{DEMO_RECIPE_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"
    )
    if _is_complete(final):
        return final
    # Training the BPE and drawing the weights take seconds: say why a first `conveyor serve`
    # is silent meanwhile.
    logger.info("Building the demo model checkpoint in %s (first run only, a few seconds)", final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable like any download
    try:
        write_demo_model(tmp)
        _move_into_place(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op once the rename has succeeded
    return final


def _cache_dir() -> Path:
    env = os.environ.get("CONVEYOR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "conveyor"


def _is_complete(folder: Path) -> bool:
    # Complete folders only ever appear through an atomic rename, so "all files present" means
    # "fully written" unless someone edited the cache by hand (handled in _move_into_place).
    return all((folder / name).is_file() for name in DEMO_FILES)


def _move_into_place(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)  # replaces a missing or empty `final`, fails on a non-empty one
        return
    except OSError:
        if _is_complete(final):
            return  # a concurrent builder won the race; its folder is as good as ours
    # `final` is an incomplete leftover (hand-edited cache): move it aside, then retry once.
    stale = final.parent / f".{final.name}.stale-{uuid.uuid4().hex}"
    with contextlib.suppress(FileNotFoundError):  # another process moved it already
        os.rename(final, stale)
    shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):
            raise


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _make_weights() -> dict[str, torch.Tensor]:
    """Random float32 weights, in Hugging Face Llama names, from one seeded CPU generator.

    Tensors are drawn in sorted-name order so the bytes never depend on dict order. No
    `lm_head.weight`: the embeddings are tied (tie_word_embeddings), as transformers saves it.
    """
    import torch

    c = DEMO_CONFIG
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim = c["num_attention_heads"] * head_dim
    kv_dim = c["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    gen = torch.Generator(device="cpu").manual_seed(_WEIGHT_SEED)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + _NORM_JITTER * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = _EMBED_STD * noise
        else:
            weights[name] = _LINEAR_STD * noise
    return weights


def _save_weights(path: Path) -> None:
    from safetensors.torch import save_file

    save_file(_make_weights(), str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates the file owner-only; match the json files


def _corpus() -> list[str]:
    """Documents for BPE training: builtins' docstrings, pydoc topics, then stdlib sources."""
    docs = [builtins.__doc__ or ""]
    for name in sorted(dir(builtins)):
        doc = getattr(getattr(builtins, name), "__doc__", None)
        if isinstance(doc, str):
            docs.append(doc)
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship Python without pydoc_data
        topics = {}
    docs.extend(topics[key] for key in sorted(topics))

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for module in _CORPUS_MODULES:
        base = stdlib.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                docs.append(candidate.read_text(encoding="utf-8", errors="replace"))
                break

    capped, total = [], 0
    for doc in docs:
        if total >= _CORPUS_MAX_CHARS:
            break
        capped.append(doc[: _CORPUS_MAX_CHARS - total])
        total += len(capped[-1])
    return capped


def _train_tokenizer() -> Tokenizer:
    """Train a GPT-2 style byte-level BPE (any UTF-8 text round-trips) with our special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_CONFIG["vocab_size"],
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:  # DEMO_CONFIG's ids rely on this
            raise RuntimeError(f"demo tokenizer put {token} at {tokenizer.token_to_id(token)}")
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEMO_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must give text back
    )
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where every
    # reader (older transformers, other engines) looks for it.
    fast.save_pretrained(str(out), save_jinja_files=False)
    # transformers 5 records its internal class name `TokenizersBackend`; the public alias
    # loads with transformers 4 and 5 alike.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, config)
