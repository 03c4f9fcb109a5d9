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

On CUDA a step in which every request decodes one token replays a CUDA graph of that forward
instead (model/decode_graphs.py: padded to a captured batch size, inputs in persistent
buffers); every other step runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from conveyor.config import EngineConfig
from conveyor.core.logprobs import TokenLogprobs
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence
from conveyor.model.attention.metadata import build_step_metadata
from conveyor.model.decode_graphs import DecodeGraphs
from conveyor.model.distributed.group import StepBatch, TPGroup
from conveyor.model.kv_sizing import allocate_kv_cache, plan_kv_cache
from conveyor.model.loading.demo import demo_model_path
from conveyor.model.loading.hf_config import read_hf_config
from conveyor.model.loading.loader import load_weights
from conveyor.model.models.moe import experts_on_host
from conveyor.model.pooler import Pooler, PoolRows
from conveyor.model.runner_settings import resolve_settings
from conveyor.model.sampling.logits_guard import FiniteLogitsGuard
from conveyor.model.sampling.prompt_logprobs import PromptRows, prompt_logprobs
from conveyor.model.sampling.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)

# What a step returns: sampled requests, their SamplerOutput, prompt logprobs, embeddings.
StepResult = tuple[
    list[Sequence],
    SamplerOutput | None,
    dict[str, list[tuple[int, TokenLogprobs]]],
    dict[str, list[float]],
]


@dataclass(slots=True)
class StepInputs:
    """One step's rows as host lists (ModelRunner._gather), batch order."""

    token_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    sampled: list[Sequence]  # the requests sampled this step ...
    sample_rows: list[int]  # ... and their rows
    prompt_rows: list[PromptRows]
    pool_rows: list[PoolRows]


class ModelRunner:
    """Owns the model, the paged KV cache tensors and the sampler."""

    def __init__(
        self, config: EngineConfig, model_path: str | None = None, tp: TPGroup | None = None
    ) -> None:
        """Start-up in four steps, each in its own module: resolve the settings, plan the KV
        cache, load the weights, settle the plan and allocate its tensors; then, on CUDA,
        capture the decode graphs.

        Args:
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
        # 1. Every choice, checked before anything loads (runner_settings.py; the
        # checkpoint's config: loading/hf_config.py).
        hf_config = read_hf_config(model_path)
        s = self.settings = resolve_settings(config, hf_config, tp)
        # 2. The KV cache's plan, refused now if memory cannot hold it (kv_sizing.py).
        plan = plan_kv_cache(s, config)
        # 3. The weights, on their GEMM and kernels (loading/loader.py).
        self.model, kernels = load_weights(model_path, hf_config, s, config, tp)
        # 4. The plan settled (measured, on CUDA with no size given) and its tensors
        # (kv_sizing.py over kv_cache.py).
        plan, self.kv_caches = allocate_kv_cache(plan, self.model, config, tp)

        self.device, self.dtype, self.block_size = s.device, s.dtype, s.block_size
        self.weight_dtype, self.kv_dtype = s.weight_dtype, s.kv_dtype
        self.linear_backend, self.kv_cache_space_gb = s.linear_backend, plan.space_gb
        self.num_kv_blocks, self.max_model_len = plan.num_blocks, plan.max_model_len
        self.vocab_size = self.model.config.vocab_size
        # 5. CUDA: the decode steps' forward captured as graphs (decode_graphs.py).
        self.graphs = None
        if self._graphs_apply(config):
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, config.max_num_seqs, self.max_model_len,
                self.block_size, self.device,
            )  # fmt: skip
        if tp is None or tp.rank == 0:  # only rank 0 samples
            argmax = None if kernels is None else kernels.argmax
            nonfinite = None if kernels is None else kernels.nonfinite_rows
            sampler = Sampler(self.vocab_size, config.seed, self.device, argmax)
            self.sampler = FiniteLogitsGuard(sampler, nonfinite)
            self.pooler = Pooler()

    def _graphs_apply(self, config: EngineConfig) -> bool:
        """CUDA graphs need CUDA, a whole model here (no tensor-parallel collectives inside a
        graph yet), and an attention backend that reads a step's shape from device tensors
        only (supports_cuda_graphs), and no mixture of experts on its module loop (which reads
        each expert's token count on the host: gpt-oss's); enforce_eager turns them off."""
        if config.enforce_eager or self.device.type != "cuda" or self.tp is not None:
            return False
        if experts_on_host(self.model):
            logger.info("CUDA graphs: off (the experts run module by module).")
            return False
        return self.model.attention_backend.supports_cuda_graphs

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
        step = self._gather(out)
        hidden, rows = self.forward(step)
        prompt_rows, pool_rows, sampled = step.prompt_rows, step.pool_rows, step.sampled
        prompt_lps = prompt_logprobs(self.model, hidden, prompt_rows) if prompt_rows else {}
        embeddings = self.pooler(hidden, pool_rows) if pool_rows else {}
        if not sampled:  # a pure prefill-chunk (or embedding) step: it wrote the K/V
            return [], None, prompt_lps, embeddings
        logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
        return sampled, self.sampler(logits, sampled), prompt_lps, embeddings

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward over one step's rows: a CUDA graph's replay for a decode step
        that has one, else eagerly. Returns the hidden states and the rows to sample (None:
        every row, in order)."""
        graphs, batch = self.graphs, len(step.query_lens)
        if (
            graphs is not None
            and graphs.fits(batch)
            and len(step.token_ids) == batch  # one new token each
            and len(step.sample_rows) == batch  # every one sampled
            and not step.prompt_rows
            and not step.pool_rows
        ):
            return graphs.run(step.token_ids, step.seq_lens, step.tables), None
        # Rows are sampled in order, so as many samples as rows is every row (a decode step):
        # no gather of the hidden states before the head.
        every_row = len(step.sample_rows) == len(step.token_ids)
        extra = (step.token_ids,) if every_row else (step.token_ids, step.sample_rows)
        # The scheduler gives every request >= 1 new token and a table covering its context.
        meta, sent = build_step_metadata(
            step.query_lens, step.seq_lens, step.tables, self.block_size, self.device, extra
        )
        rows = None if every_row else sent[1]
        return self.model(sent[0], meta.positions, self.kv_caches, meta), rows

    def _gather(self, out: SchedulerOutput) -> StepInputs:
        """The step's rows as host lists (and, tensor-parallel, sent to the other ranks)."""
        step = StepInputs([], [], [], [], [], [], [], [])
        row = 0
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            end = start + n
            step.token_ids.extend(req.token_slice(start, end))
            step.query_lens.append(n)
            step.seq_lens.append(end)
            step.tables.append(out.block_tables[req.request_id])
            # Row of position p predicts token p + 1: prompt tokens up to the prompt's last.
            last = min(end, req.num_prompt_tokens - 1)
            if req.sampling_params.prompt_logprobs is not None and start < last:
                step.prompt_rows.append((req, start + 1, row, last - start))
            if req.sampling_params.pooling is not None:  # pooled, never sampled
                step.pool_rows.append((req, row, n, start))
                row += n
                continue
            row += n
            if end == req.num_tokens:
                step.sampled.append(req)
                step.sample_rows.append(row - 1)

        if self.tp is not None:  # the other ranks run the same step
            rows = [r for _, _, r0, c in step.prompt_rows for r in range(r0, r0 + c)]
            self.tp.send_step(
                StepBatch(
                    step.token_ids, step.query_lens, step.seq_lens, step.tables, rows,
                    step.sample_rows,
                )
            )  # fmt: skip
        return step
