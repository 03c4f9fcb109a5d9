"""What crosses the pipes between the server process and the engine process.

Every message is a tuple whose first item names it (the first command excepted). Commands
are pickled one by one in the writer thread, so one that does not pickle fails alone.

Commands, server to engine (the command pipe):
    (config, log_level, cpu_cores)      the first: the EngineConfig, the logging level and
                                        the cores to pin the engine to (None: not pinned)
    ("add", request_id, prompt, prompt_ids, params, arrival_time)
                                        prompt is the ids too: the text stays in the server;
                                        a constraint in params pickles as its JSON text
    ("abort", request_id)
    ("abort_all_at", when, reason)
    ("stop", final_reason)              abort what is left with final_reason, then exit

Reports, engine to server (the outbox pipe):
    ("failed", exc)                     building the engine failed (exc via `picklable`)
    ("ready", engine_info)              the EngineInfo; the engine runs
    ("step", packed_outputs, stats, applied_seqs)
                                        `pack_output` per output, the StepStats as
                                        `dataclasses.astuple`, and how many sequences the
                                        engine has taken from its queue so far
    ("reject", request_id, exc)         the engine refused a request (a ValueError)
    ("dead", message)                   the engine failed and stopped
    ("beat",)                           every second from its own thread: the process lives
    ("stopped",)                        the last report, after "stop"

Outputs cross as plain tuples: pickling the slotted dataclasses costs the engine's thread
about twenty times as much per step (docs/kernels.md#measured-choices). The prompt stays
behind: AsyncLLM puts its own copy back into each output.
"""

from __future__ import annotations

import pickle
from typing import Any

from conveyor.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class EngineProcessError(RuntimeError):
    """The engine process could not start, or it ended without being asked to.

    Defined here since it is also what `picklable` sends in place of an error that does
    not cross the pipe.
    """


def pack_output(out: RequestOutput) -> tuple[Any, ...]:
    """A RequestOutput as nested tuples of plain values (prompt left out)."""
    m = out.metrics
    metrics = None
    if m is not None:
        metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
    completions = [_pack_completion(c) for c in out.outputs]
    prompt_lps = None
    if out.prompt_logprobs is not None:
        prompt_lps = [_pack_entry(e) if e is not None else None for e in out.prompt_logprobs]
    return (
        out.request_id, completions, out.finished, out.error, metrics, out.num_cached_tokens,
        prompt_lps, out.error_param, out.embedding,
    )  # fmt: skip


def _pack_entry(entry: dict[int, Logprob]) -> dict[int, tuple[Any, ...]]:
    return {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items()}


def _unpack_entry(entry: dict[int, tuple[Any, ...]]) -> dict[int, Logprob]:
    return {t: Logprob(*lp) for t, lp in entry.items()}


def _pack_completion(c: CompletionOutput) -> tuple[Any, ...]:
    logprobs = None
    if c.logprobs is not None:
        logprobs = [_pack_entry(entry) for entry in c.logprobs]
    return (
        c.index, c.text, c.token_ids, c.cumulative_logprob, logprobs,
        c.finish_reason, c.stop_reason, c.abort_reason,
    )  # fmt: skip


def unpack_output(packed: tuple[Any, ...]) -> RequestOutput:
    """The RequestOutput `pack_output` packed, with prompt None and no prompt ids."""
    request_id, completions, finished, error, metrics, num_cached, prompt_lps, param, emb = packed
    outputs = []
    for index, text, ids, cumulative, logprobs, *ends in completions:
        if logprobs is not None:
            logprobs = [_unpack_entry(entry) for entry in logprobs]
        outputs.append(CompletionOutput(index, text, ids, cumulative, logprobs, *ends))
    if metrics is not None:
        metrics = RequestMetrics(*metrics)
    if prompt_lps is not None:
        prompt_lps = [_unpack_entry(e) if e is not None else None for e in prompt_lps]
    return RequestOutput(
        request_id, None, [], outputs, finished, error, metrics, num_cached, prompt_lps, param,
        emb,
    )  # fmt: skip


def picklable(exc: Exception) -> Exception:
    """The error itself if it crosses a pipe intact, else its text in an EngineProcessError."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineProcessError(f"{type(exc).__name__}: {exc}")
    return exc
