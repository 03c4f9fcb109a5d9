"""The embedded demo checkpoint: transformers loads it, its tokenizer is real, builds are exact."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor import __version__
from conveyor.cli import main
from conveyor.model.loading import demo
from conveyor.model.loading.demo import DEMO_CONFIG, DEMO_FILES, demo_model_path, write_demo_model

# 8192 * 256 embeddings (tied) + 4 layers * (q 256x256, k/v 128x256, o 256x256, three 768x256
# MLP matrices, two norms) + final norm.
DEMO_NUM_PARAMS = 5_245_184


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "ckpt")


@pytest.fixture(scope="module")
def hf_tokenizer(demo_dir: Path):
    return AutoTokenizer.from_pretrained(demo_dir, local_files_only=True)


def _assert_same_bytes(a: Path, b: Path) -> None:
    for name in DEMO_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def hf_model_and_info(demo_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        demo_dir, local_files_only=True, output_loading_info=True
    )


def test_transformers_loads_demo_model_with_every_weight(hf_model_and_info) -> None:
    model, info = hf_model_and_info
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == DEMO_NUM_PARAMS
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (8192, 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 32)
    assert cfg.rope_parameters["rope_theta"] == DEMO_CONFIG["rope_theta"]


def test_demo_model_predictions_depend_on_context_not_just_last_token(hf_model_and_info) -> None:
    # HF's default std-0.02 init makes a model that mostly repeats its input token, which would
    # hide attention and position bugs from parity tests; the demo's weight scales must not.
    model = hf_model_and_info[0].eval()
    prompt = torch.arange(100, 132)
    other = prompt.clone()
    other[0] = 7  # change only the first token
    with torch.no_grad():
        pred = model(torch.stack([prompt, other])).logits.argmax(-1)
    assert (pred[0] == prompt).float().mean() < 0.25
    assert len(set(pred[0].tolist())) >= 16
    assert (pred[0, -8:] != pred[1, -8:]).sum() >= 4  # 24+ positions away, still different


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!  Two  spaces,\ttabs\nand\n\nnewlines. def f(x):\n    return x * 2\n",
        " leading space, trailing space ",
        "Café, naïve, résumé — “quotes” … 日本語のテキスト, 中文, Ελληνικά, emoji 😀👍🏽🚀",
    ],
)
def test_tokenizer_round_trips_text(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.encode(text) == ids  # no BOS/EOS added by default
    assert hf_tokenizer.decode(ids) == text
    assert max(ids) < DEMO_CONFIG["vocab_size"]


def test_tokenizer_is_a_trained_bpe_that_merges_common_words(hf_tokenizer) -> None:
    text = "The return value of the function is a list of strings."
    ids = hf_tokenizer.encode(text)
    assert len(ids) <= len(text) // 3
    assert len(hf_tokenizer) == DEMO_CONFIG["vocab_size"]


def test_special_tokens_eos_and_generation_config(demo_dir: Path, hf_tokenizer) -> None:
    ids = [hf_tokenizer.convert_tokens_to_ids(t) for t in demo.SPECIAL_TOKENS]
    assert ids == [0, 1, 2]
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.eos_token_id == 2
    assert hf_tokenizer.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    assert json.loads((demo_dir / "config.json").read_text())["eos_token_id"] == 2


def test_chat_template_renders_chatml(demo_dir: Path, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = hf_tokenizer.apply_chat_template(messages[:1], return_dict=False)
    assert ids == hf_tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n")
    # The template lives in tokenizer_config.json, where every reader looks for it.
    config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == demo.CHAT_TEMPLATE


def test_cli_demo_model_writes_the_same_bytes_in_a_new_process(
    demo_dir: Path, tmp_path: Path
) -> None:
    target = tmp_path / "from-cli"
    result = subprocess.run(
        [sys.executable, "-m", "conveyor.cli", "demo-model", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert Path(result.stdout.strip()) == target.resolve()
    assert sorted(p.name for p in target.iterdir()) == sorted(DEMO_FILES)
    _assert_same_bytes(target, demo_dir)


def test_cli_version_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"conveyor {__version__}"
    assert main([]) == 2  # a command is required
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo-model", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_write_demo_model_refuses_a_file_or_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_demo_model(tmp_path / "file")
    with pytest.raises(ValueError, match="not empty"):
        write_demo_model(tmp_path)


def test_demo_model_path_builds_once_then_reuses_the_cache(
    demo_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="conveyor"):
        first = demo_model_path()
    # The first build is slow: `conveyor serve` says what it is doing (and where) meanwhile.
    building = f"Building the demo model checkpoint in {first} (first run only, a few seconds)"
    assert caplog.messages == [building]
    caplog.clear()
    assert first.parent == tmp_path / "cache"
    assert f"v{demo.DEMO_RECIPE_VERSION}" in first.name
    _assert_same_bytes(first, demo_dir)  # a second build in this process: identical bytes
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp folder left

    def fail(path: object) -> Path:
        raise AssertionError("rebuilt a cached demo model")

    monkeypatch.setattr(demo, "write_demo_model", fail)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="conveyor"):
        assert demo_model_path() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert caplog.messages == []  # a cached checkpoint is used silently


def _fake_checkpoint(folder: Path, marker: str) -> Path:
    folder.mkdir(parents=True)
    for name in DEMO_FILES:
        (folder / name).write_text(marker)
    return folder


def test_losing_a_concurrent_build_race_keeps_the_winners_folder(tmp_path: Path) -> None:
    final = _fake_checkpoint(tmp_path / "demo", "winner")
    loser = _fake_checkpoint(tmp_path / ".demo.tmp-1", "loser")
    demo._move_into_place(loser, final)
    assert (final / "config.json").read_text() == "winner"


def test_an_incomplete_cached_folder_is_replaced(tmp_path: Path) -> None:
    final = _fake_checkpoint(tmp_path / "demo", "old")
    os.remove(final / "model.safetensors")
    fresh = _fake_checkpoint(tmp_path / ".demo.tmp-1", "new")
    demo._move_into_place(fresh, final)
    assert demo._is_complete(final)
    assert (final / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
