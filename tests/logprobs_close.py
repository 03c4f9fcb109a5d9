"""vLLM's `check_logprobs_close` rule for paths whose arithmetic is not exact (bf16, quantized
activations): two greedy runs agree while their tokens agree; at the first position where
they differ, each run's token must be in the other's top logprobs, and the comparison of that
sequence stops there (after a legitimate divergence the contexts differ)."""

from __future__ import annotations

from conveyor.engine.outputs import RequestOutput


def check_logprobs_close(got: list[RequestOutput], want: list[RequestOutput]) -> int:
    """Assert the rule for each pair of outputs (each run with logprobs >= 1).

    Returns:
        How many sequences diverged (legitimately) before their end.
    """
    diverged = 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        oa, ob = a.outputs[0], b.outputs[0]
        for pos, (ta, tb) in enumerate(zip(oa.token_ids, ob.token_ids, strict=False)):
            if ta == tb:
                continue
            top_a, top_b = oa.logprobs[pos], ob.logprobs[pos]
            assert ta in top_b and tb in top_a, (
                f"sequence {i}, position {pos}: token {ta} (top {sorted(top_a)}) against "
                f"{tb} (top {sorted(top_b)}): neither is in the other's top logprobs"
            )
            diverged += 1
            break
        else:
            assert len(oa.token_ids) == len(ob.token_ids), f"sequence {i}: lengths differ"
    return diverged
