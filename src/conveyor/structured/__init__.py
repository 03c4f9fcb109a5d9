"""Structured outputs, from the request to the token mask, in the order a request meets them:

request.py        the HTTP fields (response_format, structured_outputs, a forced tool's
                  schema) -> one StructuredOutputsParams
params.py         StructuredOutputsParams: plain data in SamplingParams (crosses to the
                  engine process), keyed so equal constraints compile once
limits.py         the cheap checks before any compile (size, depth, shapes that compile
                  slowly): a 400 naming the limit
grammar.py        xgrammar: check and compile (server side, off the event loop), the
                  per-request matcher (engine side)
grammar_cache.py  compiled grammars by key, compiled in two lanes under a time limit
grammar_queue.py  requests wait here, outside the scheduler, until their grammar is ready
bitmask.py        the sampling stage: forbidden tokens' logits set to -inf, batched
"""
