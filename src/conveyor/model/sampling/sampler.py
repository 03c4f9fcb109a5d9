"""Pick one token per request from the model's logits, vectorised over the batch.

Stages, each skipped when no row needs it (the logits ones:
conveyor.model.sampling.logits_processors):

    raw logits ──► logprobs (log_softmax of the raw logits, as vLLM's default)
        │
        ├─ structured outputs: tokens the row's grammar forbids -> -inf
        ├─ allowed_token_ids, bad_words: the tokens the row may not sample -> -inf
        ├─ min_tokens: mask eos / stop_token_ids while too few outputs
        ├─ penalties: repetition (prompt + output), frequency / presence (output)
        ├─ logit_bias: + bias per token id
        │
        ├─ greedy rows ──────────────────────────────────────────► argmax
        └─ random rows: / temperature ─► min_p ─► top_k ─► top_p ─► argmax(probs / q)

`q ~ Exp(1)` turns argmax into a draw from `probs` (the exponential race: P(argmax = i) = p_i).
A request with a seed draws its q row from its own torch.Generator (seeded with
`sample_seed(seed, sample_index)`), so its tokens do not depend on the rest of the batch or its
position in it; other rows share the sampler's generator. Only the final `tolist` waits for
the device (on CPU, the top-p window check also reads one value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from conveyor.core.logprobs import TokenLogprobs
from conveyor.core.sequence import Sequence
from conveyor.model.host_copy import to_device
from conveyor.model.sampling.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_token_masks,
    needs_token_masks,
    top_k_top_p,
)
from conveyor.sampling_params import sample_seed
from conveyor.structured.bitmask import apply_grammar_bitmask

# Temperatures below this are greedy, as in vLLM (dividing by them would overflow).
_SAMPLING_EPS = 1e-5


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and its TokenLogprobs when the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row of a logits batch, following each request's SamplingParams."""

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Args:
        vocab_size: width of the logits the model produces.
        seed: seeds the generator shared by requests without their own seed.
        device: where the logits live; generators are created there.
        argmax: torch.argmax(x, dim=-1) of a [N, V] tensor, or a function giving the same
            indices faster (CpuKernels.argmax); None: torch's.
        """
        self.argmax = argmax or _torch_argmax
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # request_id -> its own generator; lives until remove_requests.
        self._generators: dict[str, torch.Generator] = {}

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request generators of finished requests (unknown ids are ignored)."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def __call__(self, logits: torch.Tensor, requests: list[Sequence]) -> SamplerOutput:
        """Sample the next token of every request.

        Args:
            logits: float32 [N, V], row i belongs to requests[i]; it is not modified.
            requests: the N requests, in row order.
        Returns:
            SamplerOutput with N token ids and, per row, TokenLogprobs when the request asked
            for logprobs (else None).
        """
        n = len(requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [{n}, V] for {n} requests, got {list(logits.shape)}")
        raw = logits
        logits = apply_grammar_bitmask(logits, requests)
        params = [r.sampling_params for r in requests]
        temps = [p.temperature for p in params]
        random_rows = [i for i, t in enumerate(temps) if t >= _SAMPLING_EPS]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        needs_penalty = any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in params
        )
        needs_min_tokens = any(
            len(r.output_token_ids) < r.sampling_params.min_tokens for r in requests
        )

        needs_bias = any(p.logit_bias for p in params)
        needs_masks = any(needs_token_masks(p) for p in params)
        in_place = needs_masks or needs_min_tokens or needs_penalty or needs_bias
        if not (random_rows or lp_rows or in_place):
            return SamplerOutput(self.argmax(logits).tolist(), [None] * n)  # all-greedy fast path

        if in_place:
            logits = logits.clone() if logits is raw else logits
            if needs_masks:
                apply_token_masks(logits, requests)
            if needs_min_tokens:
                apply_min_tokens(logits, requests)
            if needs_penalty:
                apply_penalties(logits, requests)
            if needs_bias:
                apply_logit_bias(logits, requests)

        if len(random_rows) == n:
            tokens = self._sample(logits, requests)
        else:
            tokens = self.argmax(logits)
            if random_rows:
                idx = to_device(random_rows, logits.device)
                sub = [requests[i] for i in random_rows]
                tokens[idx] = self._sample(logits.index_select(0, idx), sub)

        if not lp_rows:
            return SamplerOutput(tokens.tolist(), [None] * n)
        return self._with_logprobs(raw, tokens, lp_rows, [params[i].logprobs for i in lp_rows])

    def _sample(self, logits: torch.Tensor, requests: list[Sequence]) -> torch.Tensor:
        """Draw one token per row; every row here has temperature > 0."""
        params = [r.sampling_params for r in requests]
        dev = logits.device
        temps = to_device([p.temperature for p in params], dev, logits.dtype)
        logits = logits / temps.unsqueeze(1)  # a new tensor: the stages below work in place
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(logits, params)
        if any(0 < p.top_k < logits.shape[1] or p.top_p < 1.0 for p in params):
            logits = top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)

        # q = -log(u), u ~ U[0, 1): q ~ Exp(1) and q > 0, so p / q is never 0/0.
        q = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            if seeded:
                shared = torch.tensor([i for i, p in enumerate(params) if p.seed is None])
                noise = torch.empty((len(shared), q.shape[1]), dtype=q.dtype, device=dev)
                q[shared.to(dev)] = noise.uniform_(generator=self.generator)
            else:
                q.uniform_(generator=self.generator)
        # A seeded row draws exactly one [V] row per sampled step from its own generator.
        for i in seeded:
            q[i].uniform_(generator=self._generator_for(requests[i]))
        q.log_().neg_()
        return self.argmax(probs.div_(q))

    def _generator_for(self, request: Sequence) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sample_seed(request.sampling_params.seed, request.sample_index))
            self._generators[request.request_id] = gen
        return gen

    def _with_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[int], nums: list[int]
    ) -> SamplerOutput:
        """Attach TokenLogprobs to `rows`, from the raw logits' log_softmax."""
        idx = to_device(rows, raw.device)
        logprobs = raw.index_select(0, idx).log_softmax(dim=-1)
        sampled = tokens.index_select(0, idx)
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
        # vLLM's rank: how many tokens are at least as likely as the sampled one.
        ranks = (logprobs >= sampled_lp).sum(dim=-1)
        max_n = min(max(nums), raw.shape[1])
        top_lp, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (sampled_lp[:, :0],) * 2
        # Two host copies at the end: all ints together, all floats together.
        ints = torch.cat([tokens, ranks, top_ids.long().flatten()]).tolist()
        floats = torch.cat([sampled_lp.flatten(), top_lp.flatten()]).tolist()
        n, m = tokens.shape[0], len(rows)
        token_ids = ints[:n]
        out: list[TokenLogprobs | None] = [None] * n
        for j, (row, k) in enumerate(zip(rows, nums, strict=True)):
            base_i = n + m + j * max_n
            base_f = m + j * max_n
            out[row] = TokenLogprobs(
                token_id=token_ids[row],
                logprob=floats[j],
                rank=ints[n + j],
                top_ids=ints[base_i : base_i + k],
                top_logprobs=floats[base_f : base_f + k],
            )
        return SamplerOutput(token_ids, out)
