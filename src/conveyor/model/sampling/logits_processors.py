"""The logits stages of sampling: token masks, min_tokens, penalties and the min_p / top_k /
top_p filters.

Each works on a float32 [N, V] batch whose row i belongs to requests[i] (or params[i]) and
touches only the rows that asked for it; the Sampler (conveyor.model.sampling.sampler) decides which
stages run and in what order:

    allowed_token_ids, bad_words, min_tokens, penalties, logit_bias:
                           in place, on raw logits (rows of any temperature)
    min_p, top_k, top_p:   on logits / temperature (random rows only), masked with -inf
"""

from __future__ import annotations

from itertools import chain

import torch

from conveyor.core.sequence import Sequence
from conveyor.model.host_copy import to_device
from conveyor.sampling_params import SamplingParams

# A top_p row without top_k looks for its nucleus among this many best tokens first (CPU).
_TOP_P_CANDIDATES = 1024


def needs_token_masks(params: SamplingParams) -> bool:
    """Whether a request's row goes through apply_token_masks."""
    return params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def apply_token_masks(logits: torch.Tensor, requests: list[Sequence]) -> None:
    """In place, vLLM's semantics: a row with allowed_token_ids keeps only those logits; a
    row with bad_words_token_ids loses each bad word's last token wherever its output so far
    ends with the word's other tokens (a one-token word: always)."""
    dev = logits.device
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, req in enumerate(requests):
        p = req.sampling_params
        if p.allowed_token_ids is not None:
            keep = to_device(p.allowed_token_ids, dev, torch.long)
            banned = torch.ones(vocab, dtype=torch.bool, device=dev)
            banned[keep[keep < vocab]] = False
            logits[i].masked_fill_(banned, float("-inf"))
        out = req.output_token_ids
        for word in p.bad_words_token_ids or ():
            head = len(word) - 1
            if head > len(out) or word[-1] >= vocab:
                continue
            if head == 0 or out[-head:] == word[:head]:
                rows.append(i)
                cols.append(word[-1])
    if rows:
        logits[to_device(rows, dev), to_device(cols, dev)] = float("-inf")


def apply_min_tokens(logits: torch.Tensor, requests: list[Sequence]) -> None:
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
        logits[to_device(rows, dev), to_device(cols, dev)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, requests: list[Sequence]) -> None:
    """In place: add each row's logit_bias (token id -> bias) to its logits."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, req in enumerate(requests):
        for t, b in (req.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(t)
            vals.append(float(b))
    if rows:
        dev = logits.device
        index = (to_device(rows, dev), to_device(cols, dev))
        logits.index_put_(index, to_device(vals, dev, logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: list[Sequence]) -> None:
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
        rep = to_device([p.repetition_penalty for p in params], dev, logits.dtype)
        vals, r = logits[rows, ids], rep[rows]
        logits[rows, ids] = torch.where(vals > 0, vals / r, vals * r)
    out_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if out_rows:
        rows, ids = _token_index(requests, out_rows, False, dev)
        freq = to_device([p.frequency_penalty for p in params], dev, logits.dtype)
        pres = to_device([p.presence_penalty for p in params], dev, logits.dtype)
        # One subtraction per occurrence gives frequency * count.
        logits.index_put_((rows, ids), -freq[rows], accumulate=True)
        rows, ids = _unique_pairs(rows, ids, vocab)
        logits.index_put_((rows, ids), -pres[rows], accumulate=True)


def _token_index(
    requests: list[Sequence], rows: list[int], with_prompt: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every output (and prompt) token of `rows`, flattened."""
    seqs = [
        requests[i].all_token_ids if with_prompt else requests[i].output_token_ids for i in rows
    ]
    ids = to_device(list(chain.from_iterable(seqs)), device, torch.long)
    lens = to_device([len(s) for s in seqs], device)
    return to_device(rows, device).repeat_interleave(lens), ids


def _unique_pairs(rows: torch.Tensor, ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, ...]:
    keys = torch.unique(rows * vocab + ids)
    return keys // vocab, keys % vocab


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: mask the tokens less likely than min_p times the row's most likely one."""
    dev = logits.device
    # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)  (log 0 = -inf masks nothing)
    min_p = to_device([p.min_p for p in params], dev, logits.dtype)
    floor = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < floor, float("-inf"))


def top_k_top_p(
    logits: torch.Tensor, params: list[SamplingParams], force_full: bool = False
) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest set whose probability reaches top_p.

    Works on the rows' best `width` tokens in descending order (a full sort of a vocabulary
    costs many times a top-1024 on CPU):

        values: [ l0 >= l1 >= ... >= l(k-1) | >= ... ]     positions >= k are masked
        top_p:  keep position j iff (mass of positions < j) < top_p; j = 0 always stays

    A row with top_p but no top_k first tries the best _TOP_P_CANDIDATES tokens on CPU and
    falls back to a full sort when they hold less than top_p of the mass.

    Args:
        logits: float [N, V] (temperature already applied); not modified.
        params: the N rows' SamplingParams.
        force_full: sort the whole vocabulary (the fallback's second pass).
    Returns:
        a new [N, V] tensor, filtered tokens at -inf.
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
    k_col = to_device([min(k, width) for k in ks], dev).unsqueeze(1)
    values.masked_fill_(torch.arange(width, device=dev) >= k_col, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # Probabilities relative to the whole (top-k-renormalised) row, not just the window.
        lse = values.logsumexp(dim=-1)
        if any(nucleus_only):
            only = to_device(nucleus_only, dev)
            lse = torch.where(only, logits.logsumexp(dim=-1), lse)
        probs = (values - lse.unsqueeze(1)).exp()
        mass = probs.cumsum(dim=-1)
        # top_p = inf for rows without it: float rounding must not cut their tail.
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        top_p = to_device(top_p, dev, logits.dtype).unsqueeze(1)
        if width < vocab and any(nucleus_only) and not bool((mass[:, -1:] >= top_p)[only].all()):
            return top_k_top_p(logits, params, force_full=True)
        values.masked_fill_(mass - probs >= top_p, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, values)
    # Rows with neither filter (batched with rows that have one) keep their logits.
    keep = [k == vocab and p.top_p >= 1.0 for k, p in zip(ks, params, strict=True)]
    if not any(keep):
        return out
    return torch.where(to_device(keep, dev).unsqueeze(1), logits, out)
