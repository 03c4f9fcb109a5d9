"""EngineConfig: every knob of the engine in one plain dataclass.

Built from `LLM(...)` keyword arguments, CLI flags or configs/*.yaml, then passed down as one
object; each part copies what it needs in `__init__`. Checks raise ValueError with a message a
user can act on. `num_kv_blocks` and `max_model_len` may be left None: the engine resolves
them from memory and the checkpoint before it builds the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.pooling_params import POOLING_TYPES
from conveyor.validation import check_choice, check_int, check_number, check_positive_int

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
LINEAR_BACKENDS = ("auto", "torch", "onednn", "cpu")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    scheduler: str = "fifo"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    # KV memory when num_kv_blocks is None; None: 1 GiB (1/8 GiB for the demo model). Never
    # more blocks than max_num_seqs sequences of max_model_len tokens can use.
    kv_cache_space_gb: float | None = None
    # CUDA, with neither num_kv_blocks nor kv_cache_space_gb given: the fraction of the
    # device's memory the engine may use (weights, activations and KV cache), as vLLM's.
    gpu_memory_utilization: float = 0.9
    # Reuse the K/V of full blocks whose tokens (and every token before them) were computed
    # before: shared system prompts, conversation history, n > 1 samples of one prompt.
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    attention_backend: str = "auto"
    # GEMMs: "cpu" (our C kernel on weights packed once at load, float32 or bfloat16),
    # "onednn" (weights prepacked once for oneDNN, float32), "torch" (nn.Linear), or "auto"
    # (on CPU: cpu where the build has a vector GEMM, else onednn in float32, else torch;
    # torch elsewhere). model/linear.py.
    linear_backend: str = "auto"
    # GGUF weights kept quantized (model/quant_linear.py): activations quantized per block of
    # 32 to 8 bits in 2 passes (the second holds the first's rounding error: close to fp32's
    # results) or 1 (llama.cpp's arithmetic, about half the integer work).
    quant_activation_passes: int = 2
    dtype: str = "auto"
    # "int8": K/V stored as int8 with a scale per token and head, about half of fp16's bytes,
    # so about twice the blocks for the same kv_cache_space_gb.
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    # Whole engine replicas behind one server (`conveyor serve`), each on its own GPU or CPU
    # cores (entrypoints/data_parallel.py); one LLMEngine is always a single replica.
    data_parallel_size: int = 1
    # Ranks the model is split over (conveyor/parallel/): one worker process per rank > 0.
    tensor_parallel_size: int = 1
    seed: int = 0
    # Scheduling policy knobs (see core/policies.py). Times are seconds of the engine clock.
    # sjf, preemptive-sjf, length-aware: a request that has waited this long since arrival is
    # no longer overtaken by later arrivals (aging; inf turns aging off).
    aging_bound_s: float = 10.0
    # preemptive-sjf: a waiting request preempts a running one when its expected remaining
    # output is at most this fraction of the running one's.
    preemption_threshold: float = 0.5
    # preemptive-sjf: a request is not preempted by the policy within this long of joining the
    # batch, so it always makes progress between preemptions (no thrash).
    preemption_cooldown_s: float = 0.5
    # Seconds a structured-output grammar may take to compile; one that takes longer fails
    # its request (a 400 naming this limit). inf: no limit.
    grammar_compile_timeout: float = 5.0
    # Embeddings (/v1/embeddings, LLM.embed): "last" or "mean" pooling of the final hidden
    # states; None: what the checkpoint's sentence-transformers config says, else "last".
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
        ):
            check_positive_int(name, getattr(self, name))
        check_choice("block_size", self.block_size, (8, 16, 32, 64, 128))
        if self.num_kv_blocks is not None:
            check_positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            check_positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_space_gb is not None:
            check_number("kv_cache_space_gb", self.kv_cache_space_gb, "> 0", lambda v: v > 0)
        check_number(
            "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]", lambda v: 0 < v <= 1
        )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}."
            )
        # Here, not when the scheduler is built: that comes after the weights and the KV cache.
        # (Imported late: core/policies.py imports this module.)
        from conveyor.core.policies import available_policies

        if self.scheduler not in available_policies():
            raise ValueError(
                f"unknown scheduler {self.scheduler!r}; choose one of: "
                f"{', '.join(available_policies())}."
            )
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("linear_backend", self.linear_backend, LINEAR_BACKENDS)
        check_choice("quant_activation_passes", self.quant_activation_passes, (1, 2))
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("device", self.device, DEVICES)
        check_positive_int("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} with tensor_parallel_size="
                f"{self.tensor_parallel_size}: replicas of a tensor-parallel engine are not "
                "supported yet; use one of the two."
            )
        check_int("seed", self.seed)
        check_number(
            "aging_bound_s", self.aging_bound_s, "> 0 (inf turns aging off)", lambda v: v > 0
        )
        check_number(
            "preemption_threshold", self.preemption_threshold, "in (0, 1]", lambda v: 0 < v <= 1
        )
        check_number(
            "preemption_cooldown_s",
            self.preemption_cooldown_s,
            ">= 0 and finite",
            lambda v: 0 <= v < math.inf,
        )
        if self.pooling_type is not None:
            check_choice("pooling_type", self.pooling_type, POOLING_TYPES)
        check_number(
            "grammar_compile_timeout", self.grammar_compile_timeout, "> 0", lambda v: v > 0
        )
