"""Prompt logprobs (vLLM's `prompt_logprobs`), from the rows of the prompt's own forward.

prompt:      t0   t1   t2   t3   t4          the hidden row at position p gives the
rows:        h0   h1   h2   h3  (h4)         distribution of token p + 1, so a chunk of
entries:          t1   t2   t3   t4          positions [s, e) yields entries s+1 .. e
                                             (the row of the last prompt token predicts the
                                             first output: that one is the sampler's)
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.core.logprobs import TokenLogprobs
from conveyor.core.sequence import Sequence
from conveyor.model.host_copy import to_device

# (request, first prompt position it yields, its first row in the batch, number of rows)
PromptRows = tuple[Sequence, int, int, int]


def prompt_logprobs(
    model: Any, hidden: torch.Tensor, groups: list[PromptRows]
) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """Logprob, rank and top-k alternatives of each prompt token the groups' rows predict.

    Args:
        model: has `compute_logits(hidden rows)`.
        hidden: the step's [T, H] hidden states.
        groups: which rows belong to which request's prompt positions.
    Returns:
        request id -> [(prompt position, TokenLogprobs)], positions ascending.
    """
    dev = hidden.device
    rows = torch.cat([torch.arange(r0, r0 + c, device=dev) for _, _, r0, c in groups])
    targets = [t for req, p0, _, c in groups for t in req.prompt_token_ids[p0 : p0 + c]]
    logprobs = model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)
    target = to_device(targets, dev, torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = (logprobs >= chosen).sum(dim=-1)
    k = min(max(req.sampling_params.prompt_logprobs for req, *_ in groups), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], chosen[:, :0].long())
    chosen_l, ranks_l = chosen.flatten().tolist(), ranks.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
    i = 0
    for req, p0, _, c in groups:
        num = req.sampling_params.prompt_logprobs
        entries = out.setdefault(req.request_id, [])
        for j in range(c):
            entries.append(
                (p0 + j, TokenLogprobs(targets[i], chosen_l[i], ranks_l[i],
                                       top_ids_l[i][:num], top_lp_l[i][:num]))
            )  # fmt: skip
            i += 1
    return out
