"""One request's stream inside AsyncLLM, and the errors that generate() and a stream raise.

AsyncLLM loop ──put_nowait(delta | exception)──► RequestStream.queue ──► outputs() ──► caller
                                                              caller leaves early ──┘
                                                              on_abandon(request_id): abort
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from conveyor.engine.outputs import RequestOutput


class EngineNotRunningError(RuntimeError):
    """The engine loop is dead, stopped or shutting down: no request can run (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting; the caller should retry later (HTTP 503 with a
    Retry-After header of `retry_after_s` seconds)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (a fault in its step or in its own processing:
    a non-finite logit, a detokenizer or stop-check error); HTTP 500."""


class RequestRejectedError(ValueError):
    """The engine refused the request for a mistake of its own, found only once it ran (a
    grammar that did not compile in time, or allows no output); HTTP 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, eq=False)
class RequestStream:
    """The delta outputs of one request on their way from the engine loop to the caller.

    Args:
        request_id: the request's id in the engine.
        arrival_time: `time.monotonic()` when generate() was called (the engine's arrival).
        prompt: the prompt text (None for token ids); outputs get it here, not from the
            engine (an engine process sends outputs without their prompt).
        prompt_token_ids: the prompt's tokens.
        on_abandon: called with the id when the caller leaves before the last output.
    """

    request_id: str
    arrival_time: float
    prompt: str | None
    prompt_token_ids: list[int]
    on_abandon: Callable[[str], None]
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None
    abandoned: bool = False  # its consumer left; kept until the abort's output is counted

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield deltas until the finished one; raise what the engine put instead.

        A consumer that falls behind gets the deltas waiting for it folded into one (as
        vLLM does), so a slow stream costs one chunk per wake-up, not one per step.

        Raises:
            RequestFailedError: the engine failed this request.
            RequestRejectedError: the engine refused it for its own mistake.
            EngineNotRunningError: the engine stopped.
        """
        done = False
        queue = self.queue
        held: RequestOutput | BaseException | None = None
        try:
            while True:
                item, held = held or await queue.get(), None
                while (
                    not queue.empty()
                    and isinstance(item, RequestOutput)
                    and item.error is None
                    and not item.finished
                ):
                    held = queue.get_nowait()
                    if isinstance(held, BaseException) or held.error is not None:
                        break
                    item.add(held)
                    held = None
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.error is not None:
                    done = True
                    if item.error_param is not None:
                        raise RequestRejectedError(item.error, item.error_param)
                    raise RequestFailedError(item.error)
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:  # the consumer left early: free the request's blocks
                self.on_abandon(self.request_id)
