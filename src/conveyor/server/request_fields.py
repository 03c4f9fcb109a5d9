"""The request fields the server does not simply honour: OpenAI's no-op hints, the refused
ones, and those only a chat template can act on.

Every field of the request models (server/protocol.py) is one of three kinds, and
tests/server/test_request_fields.py checks that each is classified, so none is silently ignored:

    honoured  it changes the answer (sampling, the prompt, the output shape, ...)
    hint      OpenAI defines it as information for the provider that changes no output:
              accepted after a type check, then ignored (NO_OP_HINTS; docs/serving.md's table)
    refused   a feature this server lacks: a 400 naming the field unless the value is one
              that asks for nothing (REFUSED: null, or the listed values)

`reasoning_effort` and `verbosity` are honoured when the chat template reads them (they are
passed to it as template variables) and refused otherwise (add_template_fields below).
"""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.server.errors import APIError

# OpenAI's hints: no effect on what is generated. docs/serving.md lists them.
NO_OP_HINTS = frozenset(
    {"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
)

# field -> (the values that ask for nothing besides null, why the others are refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((False,), "stored completions are not supported by this server"),
    "use_beam_search": ((False,), "beam search is not supported by this server"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not supported"),
    "audio": ((), "audio output is not supported by this server"),
    "modalities": ((["text"],), "this server generates text only (modalities ['text'])"),
    "prediction": ((), "predicted outputs are not supported by this server"),
    "web_search_options": ((), "web search is not supported by this server"),
    "moderation": ((), "moderation is not supported by this server"),
    # The prefix cache is automatic, in memory, evicted least recently used first.
    "prompt_cache_retention": (
        ("in_memory",),
        "the prefix cache lives in memory only (prompt_cache_retention 'in_memory')",
    ),
    "prompt_cache_options": (
        ({"mode": "implicit"}, {"mode": "implicit", "ttl": "30m"}, {"ttl": "30m"}, {}),
        "the prefix cache is implicit (automatic); explicit breakpoints are not supported",
    ),
    # vLLM's extras
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded as they are"),
    "logits_processors": ((), "per-request logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "guided_decoding_backend": ((), "the structured-output backend is chosen by the server"),
    "guided_whitespace_pattern": ((), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((), "structural tags are not supported (use structured_outputs)"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "return_token_ids": ((False,), "return_token_ids is not supported"),
    "kv_transfer_params": ((), "disaggregated prefill (kv_transfer_params) is not supported"),
    "vllm_xargs": ((), "vllm_xargs is not supported"),
    "mm_processor_kwargs": ((), "this server takes text only (mm_processor_kwargs)"),
}

# Refused on chat completions only: completions honour the fields of the same name.
CHAT_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "echo is supported on /v1/completions only"),
    "add_special_tokens": (
        (False,),
        "the chat template places the special tokens (add_special_tokens false)",
    ),
    "documents": ((), "documents are not supported (put them in the messages)"),
}

# /v1/responses (server/responses_protocol.py): OpenAI's hints there, docs/serving.md's table too.
RESPONSES_HINTS = NO_OP_HINTS | {"max_tool_calls", "stream_options"}

# Refused on /v1/responses unless they ask for nothing.
RESPONSES_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "background responses are not supported by this server"),
    "conversation": ((), "conversations are not stored by this server (use previous_response_id)"),
    "include": (([],), "this server has no extra output data to include"),
    "truncation": (
        ("disabled",),
        "an input longer than the context is a 400 (truncation 'disabled')",
    ),
    "top_logprobs": ((0,), "logprobs are not supported on /v1/responses"),
    "prompt": ((), "stored prompt templates are not supported by this server"),
    "prompt_cache_retention": REFUSED["prompt_cache_retention"],
    "prompt_cache_options": REFUSED["prompt_cache_options"],
    "moderation": REFUSED["moderation"],
    "access_programs": ((), "access programs are not supported by this server"),
    "background_options": ((), "background responses are not supported by this server"),
    "context_management": ((), "context management (compaction) is not supported"),
    "image": ((), "this server generates text only"),
}

# Request fields passed to the chat template when it reads them (else refused).
TEMPLATE_FIELDS = ("reasoning_effort", "verbosity")


def check_refused(request: Any, refused: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """400 for the first field in `refused` (REFUSED or CHAT_REFUSED) that the request sets
    to something that asks for more than nothing (param: the field)."""
    for name, (fine, why) in refused.items():
        if name not in type(request).model_fields:
            continue
        value = getattr(request, name)
        if value is None or any(value == v and type(value) is type(v) for v in fine):
            continue
        shown = json.dumps(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise APIError(f"{name}={shown} was refused: {why}.", param=name)


def template_fields(request: Any) -> dict[str, Any]:
    """The TEMPLATE_FIELDS a chat request sets, by name."""
    values = {name: getattr(request, name, None) for name in TEMPLATE_FIELDS}
    return {name: value for name, value in values.items() if value is not None}


def add_template_fields(fields: dict[str, Any], template_source: str, kwargs: dict[str, Any]):
    """Add `fields` (template_fields' result) to the template variables `kwargs`, in place.

    Args:
        fields: the request's reasoning_effort / verbosity.
        template_source: the text of the template that will render it.
        kwargs: the template variables (chat_template_kwargs, checked).
    Raises:
        APIError: the template never reads one of them (it would change nothing), or
            chat_template_kwargs sets it to something else too (400 naming the field).
    """
    for name, value in fields.items():
        if not re.search(rf"\b{name}\b", template_source):
            raise APIError(
                f"{name}={json.dumps(value)} was refused: this model's chat template does not read "
                f"`{name}`, so it would change nothing.",
                param=name,
            )
        if name in kwargs and kwargs[name] != value:
            raise APIError(
                f"{name} is set both as a field and in chat_template_kwargs: give it once.",
                param=name,
            )
        kwargs[name] = value
