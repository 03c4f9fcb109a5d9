"""Structured outputs, from the request to the token mask, in the order a request meets them:

server/constraints.py   the HTTP fields (response_format, structured_outputs, a forced
                  tool's schema) -> one StructuredOutputsParams
structured_params.py    StructuredOutputsParams (conveyor/, beside SamplingParams, which
                  carries it to the engine process): plain data, keyed so equal
                  constraints compile once
grammar_checker.py, grammar_worker.py   the server's checks before a request is queued,
                  in a process of their own under time and memory limits
grammar_bounds.py a grammar's shortest output and compile cost, read from its EBNF
limits.py         the cheap checks before any compile (size, depth, shapes that compile
                  slowly): a 400 naming the limit
grammar.py        xgrammar: check and compile (server side, off the event loop), the
                  per-request matcher (engine side)
grammar_cache.py  compiled grammars by key, compiled in two lanes under a time limit
grammar_queue.py  requests wait here, outside the scheduler, until their grammar is ready
bitmask.py        the sampling stage: forbidden tokens' logits set to -inf, batched
"""
