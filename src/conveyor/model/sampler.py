"""Pick one token per request from the model's logits, vectorised over the batch.

Stages, each skipped when no row needs it:

    raw logits ──► logprobs (log_softmax of the raw logits, as vLLM's default)
        │
        ├─ min_tokens: mask eos / stop_token_ids while too few outputs
        ├─ penalties: repetition (prompt + output), frequency / presence (output)
        │
        ├─ greedy rows ──────────────────────────────────────────► argmax
        └─ random rows: / temperature ─► min_p ─► top_k ─► top_p ─► argmax(probs / q)

`q ~ Exp(1)` turns argmax into a draw from `probs` (the exponential race: P(argmax = i) = p_i).
A request with a seed draws its q row from its own torch.Generator, so its tokens do not
depend on the rest of the batch or its position in it; other rows share the sampler's
generator. Only the final `tolist` waits for the device (on CPU, the top-p window check
also reads one value).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain

import torch

from conveyor.core.request import Request
from conveyor.sampling_params import SamplingParams

# Temperatures below this are greedy, as in vLLM (dividing by them would overflow).
_SAMPLING_EPS = 1e-5
# A top_p row without top_k looks for its nucleus among this many best tokens first (CPU).
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one sampled position, from the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token: how many tokens are at least as likely
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row of a logits batch, following each request's SamplingParams."""

    def __init__(self, vocab_size: int, seed: int = 0, device: torch.device | str = "cpu") -> None:
        """Args:
        vocab_size: width of the logits the model produces.
        seed: seeds the generator shared by requests without their own seed.
        device: where the logits live; generators are created there.
        """
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

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
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

        if not (random_rows or lp_rows or needs_penalty or needs_min_tokens):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * n)  # all-greedy fast path

        raw = logits
        if needs_min_tokens or needs_penalty:
            logits = logits.clone()
            if needs_min_tokens:
                _apply_min_tokens(logits, requests)
            if needs_penalty:
                _apply_penalties(logits, requests)

        if len(random_rows) == n:
            tokens = self._sample(logits, requests)
        else:
            tokens = logits.argmax(dim=-1)
            if random_rows:
                idx = torch.tensor(random_rows, device=logits.device)
                sub = [requests[i] for i in random_rows]
                tokens[idx] = self._sample(logits.index_select(0, idx), sub)

        if not lp_rows:
            return SamplerOutput(tokens.tolist(), [None] * n)
        return self._with_logprobs(raw, tokens, lp_rows, [params[i].logprobs for i in lp_rows])

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Draw one token per row; every row here has temperature > 0."""
        params = [r.sampling_params for r in requests]
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        logits = logits / temps.unsqueeze(1)  # a new tensor: the stages below work in place
        if any(p.min_p > 0.0 for p in params):
            # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)  (log 0 = -inf masks nothing)
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev)
            floor = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
            logits.masked_fill_(logits < floor, float("-inf"))
        if any(0 < p.top_k < logits.shape[1] or p.top_p < 1.0 for p in params):
            logits = _top_k_top_p(logits, params)
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
        return probs.div_(q).argmax(dim=-1)

    def _generator_for(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = gen
        return gen

    def _with_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[int], nums: list[int]
    ) -> SamplerOutput:
        """Attach TokenLogprobs to `rows`, from the raw logits' log_softmax."""
        idx = torch.tensor(rows, device=raw.device)
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


def _top_k_top_p(
    logits: torch.Tensor, params: list[SamplingParams], force_full: bool = False
) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest set whose probability reaches top_p.

    Works on the rows' best `width` tokens in descending order (a full sort of a 32k vocab
    is ~10x a top-1024 on CPU):

        values: [ l0 >= l1 >= ... >= l(k-1) | >= ... ]     positions >= k are masked
        top_p:  keep position j iff (mass of positions < j) < top_p; j = 0 always stays

    A row with top_p but no top_k first tries the best _TOP_P_CANDIDATES tokens on CPU and
    falls back to a full sort when they hold less than top_p of the mass.
    """
    vocab = logits.shape[1]
    dev = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    nucleus_only = [k == vocab and p.top_p < 1.0 for k, p in zip(ks, params, strict=True)]
    width = max((k for k in ks if k < vocab), default=1)
    if any(nucleus_only):
        full = force_full or dev.type != "cpu" or vocab <= _TOP_P_CANDIDATES
        width = vocab if full else max(width, _TOP_P_CANDIDATES)
    if width == vocab:
        values, order = logits.sort(dim=-1, descending=True)
    else:
        values, order = logits.topk(width, dim=-1)
    k_col = torch.tensor([min(k, width) for k in ks], device=dev).unsqueeze(1)
    values.masked_fill_(torch.arange(width, device=dev) >= k_col, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # Probabilities relative to the whole (top-k-renormalised) row, not just the window.
        lse = values.logsumexp(dim=-1)
        if any(nucleus_only):
            only = torch.tensor(nucleus_only, device=dev)
            lse = torch.where(only, logits.logsumexp(dim=-1), lse)
        probs = (values - lse.unsqueeze(1)).exp()
        mass = probs.cumsum(dim=-1)
        # top_p = inf for rows without it: float rounding must not cut their tail.
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        top_p = torch.tensor(top_p, dtype=logits.dtype, device=dev).unsqueeze(1)
        if width < vocab and any(nucleus_only) and not bool((mass[:, -1:] >= top_p)[only].all()):
            return _top_k_top_p(logits, params, force_full=True)
        values.masked_fill_(mass - probs >= top_p, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, values)
    # Rows with neither filter (batched with rows that have one) keep their logits.
    keep = [k == vocab and p.top_p >= 1.0 for k, p in zip(ks, params, strict=True)]
    if not any(keep):
        return out
    return torch.where(torch.tensor(keep, device=dev).unsqueeze(1), logits, out)


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place: forbid eos and stop_token_ids in rows with fewer than min_tokens outputs."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, req in enumerate(requests):
        p = req.sampling_params
        if len(req.output_token_ids) >= p.min_tokens:
            continue
        stops = list(p.stop_token_ids or ())
        if req.eos_token_id is not None and not p.ignore_eos:
            stops.append(req.eos_token_id)
        for t in stops:
            if t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


def _token_index(
    requests: list[Request], rows: list[int], with_prompt: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every output (and prompt) token of `rows`, flattened."""
    seqs = [
        requests[i].all_token_ids if with_prompt else requests[i].output_token_ids for i in rows
    ]
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long, device=device)
    lens = torch.tensor([len(s) for s in seqs], device=device)
    return torch.tensor(rows, device=device).repeat_interleave(lens), ids


def _unique_pairs(rows: torch.Tensor, ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, ...]:
    keys = torch.unique(rows * vocab + ids)
    return keys // vocab, keys % vocab


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place, vLLM's order and semantics, touching only the tokens seen (O(tokens), not
    O(N * V)):

        repetition (tokens in prompt or output): positive logits / r, negative logits * r;
        then frequency and presence (OpenAI, output tokens only):
            logit -= frequency_penalty * count + presence_penalty * (count > 0)
    """
    dev = logits.device
    vocab = logits.shape[1]
    params = [r.sampling_params for r in requests]
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        rows, ids = _unique_pairs(*_token_index(requests, rep_rows, True, dev), vocab)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev)
        vals, r = logits[rows, ids], rep[rows]
        logits[rows, ids] = torch.where(vals > 0, vals / r, vals * r)
    out_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if out_rows:
        rows, ids = _token_index(requests, out_rows, False, dev)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)
        # One subtraction per occurrence gives frequency * count.
        logits.index_put_((rows, ids), -freq[rows], accumulate=True)
        rows, ids = _unique_pairs(rows, ids, vocab)
        logits.index_put_((rows, ids), -pres[rows], accumulate=True)
