"""Shared pytest fixtures.

Triton kernels: without a CUDA GPU they can only run in Triton's CPU interpreter, which
triton.jit picks at decoration time (when conveyor.kernels is first imported). Setting
TRITON_INTERPRET here, before any test module is imported, makes that the only mode the
session's kernels ever have. Nothing else reads the variable, so other tests are unchanged;
with a GPU it is left alone and the `interpreter` tests run compiled on CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before torch loads libgomp: the suite's own torch work (transformers references, in-process
# engines) waits as conveyor does (conveyor/omp_env.py), not spinning against the servers it
# starts on the same cores.
import conveyor  # noqa: F401

# isort: split
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_device() -> str:
    """Where the Triton kernels run: "cuda", else "cpu" in the interpreter (the test is
    skipped when conveyor.kernels loaded before TRITON_INTERPRET was set)."""
    import conveyor.kernels.launchers as triton_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not triton_kernels.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    return device


_TINY_TOKENIZER_TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, Ångström and façade: accents everywhere.",
    "Emoji time 😀🎉🚀 and more emoji 👍🏽 in a sentence.",
    "日本語のテキストと中文文本 mixed with English words.",
    "STOP here. The end of the story is near; stop, please stop.",
    "def add(a, b):\n    return a + b  # some code\n",
]

_CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer (no download), saved in HF format.

    Special tokens: `<|endoftext|>` (eos, id 0), `<|im_start|>` (1), `<|im_end|>` (2); it has a
    ChatML chat template. Load it with `AutoTokenizer.from_pretrained(dir)`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_TOKENIZER_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = _CHATML_TEMPLATE
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded demo checkpoint, written once per test session into a temp folder."""
    from conveyor.model.loading.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="module")
def kernels():
    """The CPU C kernels (model/cpu/cpu_kernels.py); skipped where they cannot be built (no C
    compiler). tests/kernels/test_kernels.py has its own `kernels`: the Triton ones."""
    from conveyor.model.cpu import cpu_kernels

    k = cpu_kernels.load()
    if k is None:
        pytest.skip("the CPU C kernels cannot be built here (no C compiler)")
    return k
