"""EngineConfig: every knob of the engine in one plain dataclass.

Built from `LLM(...)` keyword arguments, CLI flags or configs/*.yaml, then passed down as one
object; each part copies what it needs in `__init__`. Each field is the one place its setting
is written (conveyor/config/settings.py): its help and choices make the `conveyor serve` flag, the
line of configs/default.yaml and the row of docs/configuration.md. Checks raise ValueError
with a message a user can act on. `num_kv_blocks` and `max_model_len` may be left None: the
engine resolves them from memory and the checkpoint before it builds the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.config.settings import (
    MODEL,
    PARALLELISM,
    SCHEDULING,
    check_choices,
    lazy_choices,
    setting,
)
from conveyor.pooling_params import POOLING_TYPES
from conveyor.validation import check_int, check_number, check_positive_int

LINEAR_BACKENDS = ("auto", "torch", "onednn", "cpu")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = setting(
        None,
        "Hugging Face checkpoint folder or .gguf file",
        section=MODEL,
        unset="the embedded demo model",
        flag={"metavar": "PATH"},
    )
    tokenizer: str | None = setting(
        None, "tokenizer folder", section=MODEL, unset="the model's", flag={"metavar": "DIR"}
    )
    scheduler: str = setting(
        "fifo",
        "scheduling policy (docs/scheduling.md)",
        section=SCHEDULING,
        choices=lazy_choices("conveyor.core.policies", "available_policies"),
    )
    max_num_seqs: int = setting(64, "most requests in one step's batch", section=SCHEDULING)
    max_num_batched_tokens: int = setting(
        2048, "token budget of one step (prefill chunks + decode tokens)", section=SCHEDULING
    )
    long_prefill_token_threshold: int = setting(
        256,
        "a prompt with more than this many tokens left to compute is a long prefill: it "
        "computes at most this many a step, and beside decodes and short prompts the long "
        "prefills take what costs about half of their step time (measured), so one long "
        "prompt never stalls them (core/long_prefills.py); 0: off, any prompt may take the whole "
        "step's budget",
        section=SCHEDULING,
    )
    max_num_partial_prefills: int = setting(
        4, "most prompts a step leaves unfinished (chunked prefills in progress) at once",
        section=SCHEDULING,
    )  # fmt: skip
    max_long_partial_prefills: int = setting(
        1,
        "most long prefills in progress at once; a long waiting request is passed over "
        "meanwhile and shorter ones behind it are admitted (at most max_num_partial_prefills)",
        section=SCHEDULING,
    )
    block_size: int = setting(
        16, "tokens per KV cache block", section=SCHEDULING, choices=(8, 16, 32, 64, 128)
    )
    num_kv_blocks: int | None = setting(
        None, "KV cache blocks", section=SCHEDULING, unset="as many as kv_cache_space_gb holds"
    )
    # Never more blocks than max_num_seqs sequences of max_model_len tokens can use.
    kv_cache_space_gb: float | None = setting(
        None,
        "KV cache memory (GiB) when num_kv_blocks is not given",
        section=SCHEDULING,
        unset="on CPU 1 GiB (1/8 GiB for the demo model), on CUDA what "
        "gpu_memory_utilization leaves",
        flag={"metavar": "GB"},
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA, with neither num_kv_blocks nor kv_cache_space_gb given: the fraction of the "
        "device's memory the engine may use (weights, activations and KV cache), as vLLM's",
        section=SCHEDULING,
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse the K/V of full blocks whose tokens (and every token before them) were "
        "computed before: shared system prompts, conversation history, n > 1 samples",
        section=SCHEDULING,
    )
    max_model_len: int | None = setting(
        None,
        "cap on prompt + output tokens",
        section=MODEL,
        unset="the checkpoint's maximum, capped by what the KV cache holds for one request; "
        "an explicit value above that is a start-up error",
    )
    attention_backend: str = setting(
        "auto",
        "attention kernels (model/attention/); auto: triton on CUDA, cpu on CPU",
        section=MODEL,
        choices=lazy_choices("conveyor.model.attention.registry", "available_backends"),
    )
    enforce_eager: bool = setting(
        False,
        "CUDA: run every step eagerly; by default decode steps of up to max_num_seqs requests "
        "replay CUDA graphs captured at start-up (model/decode_graphs.py)",
        section=MODEL,
    )
    linear_backend: str = setting(
        "auto",
        "GEMMs (model/cpu/linear.py): cpu (our C kernel on weights packed once at load, float32 "
        "or bfloat16), onednn (weights prepacked once for oneDNN, float32), torch "
        "(nn.Linear); auto: on CPU cpu where the build has a vector GEMM, else onednn in "
        "float32, else torch; torch elsewhere",
        section=MODEL,
        choices=LINEAR_BACKENDS,
    )
    quant_activation_passes: int = setting(
        2,
        "GGUF weights kept quantized (model/cpu/quant_linear.py): activations quantized per block "
        "of 32 to 8 bits in 2 passes (the second holds the first's rounding error: close to "
        "fp32's results) or 1 (llama.cpp's arithmetic, about half the integer work)",
        section=MODEL,
        choices=(1, 2),
    )
    dtype: str = setting(
        "auto",
        "compute dtype; auto: on CPU bfloat16 for a bf16 checkpoint where the CPU has native "
        "bf16 dot products, else float32; on CUDA the checkpoint's float16 or bfloat16, "
        "else bfloat16",
        section=MODEL,
        choices=DTYPES,
        flag={"metavar": "DTYPE"},
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype; auto: the model's; int8: a scale per token and head, about half of "
        "fp16's bytes, so about twice the blocks in the same memory",
        section=MODEL,
        choices=KV_CACHE_DTYPES,
        flag={"metavar": "DTYPE"},
    )
    device: str = setting("auto", "where the model runs", section=MODEL, choices=DEVICES)
    data_parallel_size: int = setting(
        1,
        "whole engine replicas behind one server (`conveyor serve`), each on its own GPU or "
        "CPU cores; requests go to the least loaded (entrypoints/data_parallel.py)",
        section=PARALLELISM,
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks the model is split over (conveyor/parallel/), one process each; gloo on CPU, "
        "NCCL on CUDA",
        section=PARALLELISM,
    )
    seed: int = setting(0, "seed of requests that bring none of their own", section=SCHEDULING)
    # Scheduling policy knobs (see core/policies.py). Times are seconds of the engine clock.
    aging_bound_s: float = setting(
        10.0,
        "sjf, preemptive-sjf, length-aware: a request that has waited this long since "
        "arrival is no longer overtaken by later arrivals (aging; inf turns it off)",
        section=SCHEDULING,
    )
    preemption_threshold: float = setting(
        0.5,
        "preemptive-sjf: a waiting request preempts a running one when its expected "
        "remaining output is at most this fraction of the running one's",
        section=SCHEDULING,
    )
    preemption_cooldown_s: float = setting(
        0.5,
        "preemptive-sjf: no request is preempted by the policy within this long of joining "
        "the batch, so it always makes progress between preemptions",
        section=SCHEDULING,
    )
    grammar_compile_timeout: float = setting(
        5.0,
        "seconds a structured-output grammar may take to compile; one that takes longer "
        "fails its request with a 400 naming this limit (inf: no limit)",
        section=SCHEDULING,
    )
    pooling_type: str | None = setting(
        None,
        "embeddings (/v1/embeddings, LLM.embed): pooling of the final hidden states",
        section=MODEL,
        choices=POOLING_TYPES,
        unset="the checkpoint's sentence-transformers config, else last",
    )

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
        ):
            check_positive_int(name, getattr(self, name))
        # Every field with choices (the scheduler, block_size, the backends, dtypes, ...): here,
        # not when the scheduler is built, which comes after the weights and the KV cache.
        check_choices(self)
        if self.num_kv_blocks is not None:
            check_positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            check_positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_space_gb is not None:
            check_number("kv_cache_space_gb", self.kv_cache_space_gb, "> 0", lambda v: v > 0)
        check_number(
            "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]", lambda v: 0 < v <= 1
        )
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        check_positive_int("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} with tensor_parallel_size="
                f"{self.tensor_parallel_size}: replicas of a tensor-parallel engine are not "
                "supported yet; use one of the two."
            )
        check_int("seed", self.seed)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, lo=0)
        check_positive_int("max_num_partial_prefills", self.max_num_partial_prefills)
        check_positive_int("max_long_partial_prefills", self.max_long_partial_prefills)
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be at most "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})."
            )
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
        check_number(
            "grammar_compile_timeout", self.grammar_compile_timeout, "> 0", lambda v: v > 0
        )
