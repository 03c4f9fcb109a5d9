"""ModelRunner: a SchedulerOutput in, one sampled token per finishing request out.

Every step flattens the scheduled requests into one varlen batch (no padding) and runs the
model once, prefill chunks and decode tokens together:

    scheduled:   A (prefill chunk, 4 new)   B (decode, 1 new)   C (decode, 1 new)
    input_ids:   a4 a5 a6 a7 | b9 | c3                               T = 6 tokens
    positions:    4  5  6  7 |  9 |  3
    query_start_loc: [0, 4, 5, 6]     seq_lens: [8, 10, 4]   (context after this step)
    slot of a token at position p of a request with block table bt:
        bt[p // block_size] * block_size + p % block_size

Only requests whose step reaches the end of their known tokens are sampled (A is sampled only
if position 7 is its last token); their logits are computed at the last row of their chunk.
Embedding requests (`sampling_params.pooling`) are never sampled: their chunks' rows go to
the pooler (model/pooler.py), which returns a vector once the prompt's last chunk ran.
"""

from __future__ import annotations

import logging

import torch

from conveyor.core.block_manager import cdiv
from conveyor.core.logprobs import TokenLogprobs
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence
from conveyor.engine.config import EngineConfig
from conveyor.model.attention import AttentionMetadata, build_attention_metadata
from conveyor.model.cpu import cpu_kernels
from conveyor.model.cpu.fused_layers import FusedLayers
from conveyor.model.cpu.linear import linear_factory, pack_linears, resolve_linear_backend
from conveyor.model.cpu.quant_linear import set_activation_passes
from conveyor.model.kv_cache import (
    allocate_kv_caches,
    available_memory_bytes,
    kv_cache_bytes_per_block,
    kv_cache_memory_error,
)
from conveyor.model.kv_sizing import log_kv_cache, profile_cuda_kv_bytes
from conveyor.model.loading.demo import demo_model_path
from conveyor.model.loading.loader import (
    load_model,
    model_config,
    read_hf_config,
    resolve_dtype,
    resolve_model_class,
    weight_bytes,
)
from conveyor.model.models.layers import use_cpu_kernels
from conveyor.model.pooler import Pooler, PoolRows
from conveyor.model.sampling.logits_guard import FiniteLogitsGuard
from conveyor.model.sampling.prompt_logprobs import PromptRows, prompt_logprobs
from conveyor.model.sampling.sampler import Sampler, SamplerOutput
from conveyor.parallel.group import StepBatch, TPGroup
from conveyor.parallel.sharding import Shard

logger = logging.getLogger(__name__)

# What a step returns: sampled requests, their SamplerOutput, prompt logprobs, embeddings.
StepResult = tuple[
    list[Sequence],
    SamplerOutput | None,
    dict[str, list[tuple[int, TokenLogprobs]]],
    dict[str, list[float]],
]

DEFAULT_KV_CACHE_SPACE_GB = 1.0
# The demo model is tiny: 128 MiB holds 2048 blocks (32k tokens), plenty for trying it out.
DEMO_KV_CACHE_SPACE_GB = 0.125


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available.")
    return torch.device(name)


class ModelRunner:
    """Owns the model, the paged KV cache tensors and the sampler."""

    def __init__(
        self, config: EngineConfig, model_path: str | None = None, tp: TPGroup | None = None
    ) -> None:
        """Args:
        config: the engine's settings.
        model_path: the checkpoint folder; None: `config.model`, or the embedded demo
            checkpoint (built on first use) when that is None too.
        tp: this rank's tensor-parallel group (conveyor.parallel; None: the whole model
            here): the rank's slices, its KV heads; rank 0 sends each step to the others.
        """
        if model_path is None:
            model_path = str(config.model or demo_model_path())
        self.model_path = model_path
        self.tp = tp
        self.device = resolve_device(config.device)
        if tp is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.local_rank)
        self.block_size = config.block_size
        # The KV cache is sized from config.json alone, so one that cannot fit in memory is
        # refused before the weights load.
        hf_config = read_hf_config(model_path)
        # "auto": see resolve_dtype (CPU: bfloat16 where it has native bf16 dot products).
        self.dtype = resolve_dtype(config.dtype, self.device, hf_config)
        if config.dtype == "auto":
            logger.info("dtype auto: %s.", str(self.dtype).removeprefix("torch."))
        # Before the weights load, so an impossible choice is reported at once.
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype)
        # self.dtype is the activations'; the weights and the KV cache may be held narrower.
        # On CPU our GEMM takes bfloat16 weights under float32 activations, and the attention
        # kernel a bfloat16 cache: what a decode step streams in half the bytes, every
        # product and sum in float32.
        self.weight_dtype = self.kv_dtype = self.dtype  # kv_dtype: unless kv_cache_dtype int8
        if self.linear_backend == "cpu" and self.dtype == torch.bfloat16:
            self.dtype = torch.float32
            logger.info(
                "dtype bfloat16 on CPU: bfloat16 weights (our GEMM) and KV cache, float32 "
                "activations."
            )
        cls = resolve_model_class(hf_config)  # an unsupported architecture is named first
        kv_config = model_config(hf_config)
        context = kv_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        if config.max_model_len is not None and config.max_model_len > context:
            logger.warning(
                "max_model_len %d is more than the model's context (max_position_embeddings "
                "in config.json); capped to %d.",
                config.max_model_len,
                context,
            )
        kv_dtype = config.kv_cache_dtype
        if tp is not None:  # a rank's cache holds its KV heads only
            shard = Shard.of(kv_config, tp.rank, tp.size, cls.SPEC.tp_splits)
            kv_config = shard.local_config(kv_config)
        bytes_per_block = kv_cache_bytes_per_block(
            kv_config, self.block_size, self.kv_dtype, kv_dtype
        )
        self.kv_cache_space_gb = config.kv_cache_space_gb or (
            DEMO_KV_CACHE_SPACE_GB if config.model is None else DEFAULT_KV_CACHE_SPACE_GB
        )
        # Blocks beyond what max_num_seqs sequences of max_model_len tokens hold at once
        # could never be used: do not allocate them.
        most = config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        # CUDA with no size given: from what the weights and a profiling forward leave.
        profile = (
            self.device.type == "cuda"
            and config.num_kv_blocks is None
            and config.kv_cache_space_gb is None
        )
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        else:
            budget = int(self.kv_cache_space_gb * (1 << 30))
            self.num_kv_blocks = max(1, min(budget // bytes_per_block, most))
        if not profile:
            self._fit_context_to_cache(config)
            self._check_kv_cache_fits(bytes_per_block, config)
        # Our C kernels run the linears: a GGUF file's QUANT_TYPES blocks stay as they are.
        self.model = load_model(
            model_path, self.dtype, self.device, config.attention_backend, tp=tp,
            keep_quantized=self.linear_backend == "cpu", linear_dtype=self.weight_dtype,
        )  # fmt: skip
        set_activation_passes(self.model, config.quant_activation_passes)
        if self.linear_backend in ("onednn", "cpu"):
            pack_linears(self.model, linear_factory(self.linear_backend, self.weight_dtype))
        logger.info("Weights in memory: %.1f MiB.", weight_bytes(self.model) / 2**20)
        # The CPU attention backend's C library also runs the RMSNorms (residual add fused in),
        # the rotary embedding and the sampler's argmax; attention_backend "torch" keeps the
        # forward and the sampler in torch.
        argmax = None
        if self.device.type == "cpu" and config.attention_backend in ("auto", "cpu"):
            kernels = cpu_kernels.load()
            if kernels is not None and self.dtype == torch.float32:
                use_cpu_kernels(self.model, kernels)
                argmax = kernels.argmax
                if hasattr(self.model, "fused_layers"):
                    self.model.fused_layers = FusedLayers.build(self.model, kernels)
                    if self.model.fused_layers is not None:
                        logger.info("Decoder layers: one C call a step (csrc/decoder_layers.c).")
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        if profile:
            kv_bytes = profile_cuda_kv_bytes(
                self.model, self.device, self.dtype, config.max_num_batched_tokens,
                self.block_size, config.gpu_memory_utilization, kv_dtype,
            )  # fmt: skip
            if kv_bytes < bytes_per_block:
                raise ValueError(
                    "no GPU memory is left for the KV cache after the weights and a forward "
                    f"of max_num_batched_tokens={config.max_num_batched_tokens} tokens at "
                    f"gpu_memory_utilization={config.gpu_memory_utilization:g}: raise "
                    "--gpu-memory-utilization, lower --max-num-batched-tokens, or set "
                    "--num-kv-blocks."
                )
            self.num_kv_blocks = min(kv_bytes // bytes_per_block, most)
            if tp is not None:  # every rank the same count: what the tightest one holds
                self.num_kv_blocks = tp.agree_min(self.num_kv_blocks)
            self._fit_context_to_cache(config)
        self._check_kv_cache_fits(bytes_per_block, config)  # again: the weights took some
        try:
            self.kv_caches = allocate_kv_caches(
                self.model.kv_config, self.num_kv_blocks, self.block_size, self.kv_dtype,
                self.device, kv_dtype,
            )  # fmt: skip
        except (RuntimeError, MemoryError) as exc:  # CPU "can't allocate memory", CUDA OOM
            raise self._kv_memory_error(bytes_per_block, config) from exc
        log_kv_cache(
            self.num_kv_blocks,
            self.block_size,
            "int8" if kv_dtype == "int8" else str(self.kv_dtype).removeprefix("torch."),
            self.num_kv_blocks * bytes_per_block / 2**20,
            self.max_model_len,
        )
        if tp is None or tp.rank == 0:  # only rank 0 samples
            sampler = Sampler(self.vocab_size, config.seed, self.device, argmax)
            self.sampler = FiniteLogitsGuard(sampler)
            self.pooler = Pooler()

    def _fit_context_to_cache(self, config: EngineConfig) -> None:
        """As vLLM: the effective max_model_len is the model's context capped by what the KV
        cache holds for one request, so that a long-context model with a small cache still
        serves what fits (and max_tokens defaults to what that leaves). An explicit
        max_model_len beyond the cache is a start-up error."""
        capacity = self.num_kv_blocks * self.block_size
        if self.max_model_len <= capacity:
            return
        if config.max_model_len is not None:
            room = "--kv-cache-space-gb or --num-kv-blocks"
            if self.device.type == "cuda":
                room += " (or --gpu-memory-utilization)"
            raise ValueError(
                f"max_model_len {self.max_model_len} is more than the KV cache holds for one "
                f"request ({self.num_kv_blocks} blocks of {self.block_size} = {capacity} "
                f"tokens): lower --max-model-len, or give the cache more room with {room}."
            )
        logger.info(
            "max_model_len %d: what the KV cache holds for one request (the model's context "
            "is %d; --max-model-len or a larger cache changes it).",
            capacity,
            self.max_model_len,
        )
        self.max_model_len = capacity

    def _check_kv_cache_fits(self, bytes_per_block: int, config: EngineConfig) -> None:
        available = available_memory_bytes(self.device)
        if available is not None and self.num_kv_blocks * bytes_per_block > available:
            raise self._kv_memory_error(bytes_per_block, config)

    def _kv_memory_error(self, bytes_per_block: int, config: EngineConfig) -> ValueError:
        return kv_cache_memory_error(
            self.num_kv_blocks,
            bytes_per_block,
            self.device,
            config.num_kv_blocks,
            self.kv_cache_space_gb,
        )

    def remove_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.sampler.remove_requests(request_ids)
            self.pooler.remove(request_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step.

        Returns:
            the requests that were sampled (in row order), the sampler's output for them
            (None when no request reached the end of its tokens this step), the prompt
            logprobs this step's rows gave (request id -> [(prompt position, TokenLogprobs)])
            and the embeddings of the embedding requests whose prompt ended in this step
            (request id -> vector).
        """
        if self.tp is not None:
            return self.tp.guard(self._execute, out)
        return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> StepResult:
        input_ids, meta, sample_rows, sampled, prompt_rows, pool_rows = self._prepare(out)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        prompt_lps = prompt_logprobs(self.model, hidden, prompt_rows) if prompt_rows else {}
        embeddings = self.pooler(hidden, pool_rows) if pool_rows else {}
        if not sampled:  # a pure prefill-chunk (or embedding) step: it wrote the K/V
            return [], None, prompt_lps, embeddings
        logits = self.model.compute_logits(hidden[sample_rows])
        return sampled, self.sampler(logits, sampled), prompt_lps, embeddings

    def _prepare(
        self, out: SchedulerOutput
    ) -> tuple[
        torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence], list[PromptRows],
        list[PoolRows],
    ]:  # fmt: skip
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sampled: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_rows: list[PromptRows] = []
        pool_rows: list[PoolRows] = []
        tables = []
        row = 0
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            end = start + n
            token_ids.extend(req.token_slice(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(out.block_tables[req.request_id])
            # Row of position p predicts token p + 1: prompt tokens up to the prompt's last.
            last = min(end, req.num_prompt_tokens - 1)
            if req.sampling_params.prompt_logprobs is not None and start < last:
                prompt_rows.append((req, start + 1, row, last - start))
            if req.sampling_params.pooling is not None:  # pooled, never sampled
                pool_rows.append((req, row, n, start))
                row += n
                continue
            row += n
            if end == req.num_tokens:
                sampled.append(req)
                sample_rows.append(row - 1)

        if self.tp is not None:  # the other ranks run the same step
            rows = [r for _, _, r0, c in prompt_rows for r in range(r0, r0 + c)]
            self.tp.send_step(StepBatch(token_ids, query_lens, seq_lens, tables, rows, sample_rows))
        dev = self.device
        # The scheduler gives every request >= 1 new token and a table covering its context.
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, dev)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, meta, rows, sampled, prompt_rows, pool_rows
