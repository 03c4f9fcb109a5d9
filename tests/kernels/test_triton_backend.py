"""LLM(attention_backend="triton") end to end: the same greedy tokens as the torch reference.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the model is tiny (2 layers, head size 16) and the outputs short; the
small token budget chunks the prompts, so steps mix prefill chunks with decodes.
"""

from __future__ import annotations

import pytest
import torch
from tests.hf_checkpoints import write_checkpoint

from conveyor import LLM, SamplingParams
from conveyor.model.attention.triton_attention import TritonAttentionBackend

pytestmark = pytest.mark.interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[(7 * i + 3) % 500 + 10 for i in range(n)] for n in (30, 7, 19)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_model_dir):
    import conveyor.kernels.launchers as kernels

    if DEVICE == "cpu" and not kernels.INTERPRETED:
        pytest.skip("no GPU and TRITON_INTERPRET was not set when conveyor.kernels loaded")
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", demo_model_dir)


def _greedy(path, backend: str, kv_cache_dtype: str) -> list[list[int]]:
    llm = LLM(
        str(path),
        attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        device=DEVICE,
        dtype="float32",  # both backends exact up to summation order
        block_size=16,
        num_kv_blocks=16,
        max_num_batched_tokens=24,
    )
    attn = llm.llm_engine.runner.model.model.layers[0].self_attn
    assert isinstance(attn.backend, TritonAttentionBackend) == (backend == "triton")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_triton_backend_gives_the_torch_backends_greedy_tokens(checkpoint, kv_cache_dtype):
    got = _greedy(checkpoint, "triton", kv_cache_dtype)
    assert got == _greedy(checkpoint, "torch", kv_cache_dtype)
    assert [len(t) for t in got] == [4, 4, 4]
