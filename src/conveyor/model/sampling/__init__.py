"""From logits to tokens: the sampler, the logits stages (penalties, bias, allowed and bad
words), the non-finite guard and prompt logprobs. The structured-output mask is
conveyor.structured.bitmask."""
