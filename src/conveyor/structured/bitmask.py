"""The structured-output stage of sampling: mask the tokens each row's grammar forbids.

rows:     0 (free)   1 (json)   2 (free)   3 (regex)
bitmask:  [ .... ]   [ 1001.. ] [ .... ]   [ 0110.. ]    int32 [N, ceil(V / 32)], one bit
                                                         per token; only rows 1, 3 filled
logits:   row 1 and 3 get -inf where their bit is 0, in one batched call; rows 0 and 2
          are untouched, so unconstrained requests sample exactly what they would alone.
"""

from __future__ import annotations

from typing import Any

import torch


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[Any]) -> torch.Tensor:
    """Logits with every constrained row masked to what its grammar allows next.

    Args:
        logits: float [N, V], row i belongs to requests[i]; not modified.
        requests: the N sequences; those with a `grammar` (RequestGrammar) are constrained.
    Returns:
        `logits` itself when no row is constrained, else a masked copy.
    """
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    import xgrammar as xgr  # imported only once a constrained request runs

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(requests), vocab)
    for i in rows:
        req = requests[i]
        req.grammar.sync(req.output_token_ids)
        req.grammar.matcher.fill_next_token_bitmask(bitmask, i)
    masked = logits.clone()
    if masked.device != bitmask.device:
        bitmask = bitmask.to(masked.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows)
    return masked
