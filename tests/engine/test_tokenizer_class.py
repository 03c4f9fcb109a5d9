"""engine/tokenizer_class.py picks the tokenizer class AutoTokenizer picks, for every
combination of family, tokenizer_class and tokenizer.json kind it replays; anything else is
left to AutoTokenizer; and an HF folder's tokenizer loads without importing torch."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto import tokenization_auto

from conveyor.engine import tokenizer_class
from conveyor.engine.tokenizer import Tokenizer

TEXTS = ["Hello world! The quick  brown fox.", " leading space\nand a newline", "Café 日本語 😀"]
HUB_CLASSES = [
    "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizer", "LlamaTokenizerFast",
    "GPT2Tokenizer", "GPT2TokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast", None,
]  # fmt: skip


@pytest.fixture(scope="module")
def metaspace_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE tokenizer with a SentencePiece-style (Metaspace) pre-tokenizer."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(TEXTS * 8, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    path = tmp_path_factory.mktemp("metaspace_tokenizer")
    fast.save_pretrained(str(path))
    return path


def _folder(
    tmp: Path, base: Path, model_type: str, hub: str | None, in_config: bool = False, **extra
) -> Path:
    """A copy of the tokenizer folder `base` with config.json's model_type, its class `hub`
    in tokenizer_config.json (in config.json instead when in_config) and `extra` fields."""
    folder = tmp / f"{model_type}-{hub}-{in_config}-{base.name}"
    shutil.copytree(base, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("tokenizer_class", None)
    if hub is not None and not in_config:
        config["tokenizer_class"] = hub
    config.update(extra)
    config_path.write_text(json.dumps(config))
    model_config = {"model_type": model_type}
    if hub is not None and in_config:
        model_config["tokenizer_class"] = hub
    (folder / "config.json").write_text(json.dumps(model_config))
    return folder


def test_the_registered_classes_are_transformers_own() -> None:
    for model_type, (registered, hub_is_wrong) in tokenizer_class._REGISTERED.items():
        assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) == registered
        wrong = tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert (model_type in wrong) == hub_is_wrong


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_the_class_and_tokens_are_autotokenizers(
    kind: str, model_type: str, tiny_tokenizer_dir: Path, metaspace_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    base = tiny_tokenizer_dir if kind == "byte_level" else metaspace_tokenizer_dir
    for hub, in_config in itertools.product(HUB_CLASSES, (False, True)):
        folder = _folder(tmp_path, base, model_type, hub, in_config)
        name = tokenizer_class.auto_tokenizer_class(folder)
        want = AutoTokenizer.from_pretrained(str(folder))
        # No class named anywhere: left to AutoTokenizer (its choice then reads config.json's
        # class through transformers' config classes).
        assert name == (type(want).__name__ if hub else None), (hub, name, type(want).__name__)
        ours = Tokenizer.from_pretrained(folder).hf
        assert type(ours) is type(want)
        assert [ours.encode(t) for t in TEXTS] == [want.encode(t) for t in TEXTS]


def test_folders_outside_the_replayed_cases_are_left_to_autotokenizer(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    cases = {
        "mistral": _folder(tmp_path, tiny_tokenizer_dir, "mistral", "TokenizersBackend"),
        "another family": _folder(tmp_path, tiny_tokenizer_dir, "gemma", "TokenizersBackend"),
        "another class": _folder(tmp_path, tiny_tokenizer_dir, "llama", "BertTokenizer"),
        "no class": _folder(tmp_path, tiny_tokenizer_dir, "qwen3", None),
    }
    remote = _folder(tmp_path, tiny_tokenizer_dir, "qwen2", "Qwen2Tokenizer", auto_map={})
    cases["remote code"] = remote
    no_json = tmp_path / "no-tokenizer-json"
    shutil.copytree(_folder(tmp_path, tiny_tokenizer_dir, "llama", "LlamaTokenizer"), no_json)
    (no_json / "tokenizer.json").unlink()
    cases["no tokenizer.json"] = no_json
    cases["no config.json"] = tmp_path / "bare"
    shutil.copytree(tiny_tokenizer_dir, cases["no config.json"])
    for case, folder in cases.items():
        assert tokenizer_class.auto_tokenizer_class(folder) is None, case
    # ... and AutoTokenizer's own choice is what loads.
    folder = cases["another class"]
    want = AutoTokenizer.from_pretrained(str(folder))
    assert type(Tokenizer.from_pretrained(folder).hf) is type(want)


def test_an_hf_folders_tokenizer_loads_without_torch(demo_model_dir: Path) -> None:
    code = (
        "import sys; from conveyor.engine.tokenizer import Tokenizer; "
        f"t = Tokenizer.from_pretrained({str(demo_model_dir)!r}); "
        "assert t.encode('hi') and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
