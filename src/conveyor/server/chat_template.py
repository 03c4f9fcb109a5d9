"""What a chat request may pass to the chat template: variables as data, never a template.

    chat_template (field) or chat_template_kwargs.chat_template   only with the operator's
                                                                  --trust-request-chat-template
    chat_template_kwargs.{messages, tools, add_generation_prompt, ...}   400: those are the
                                                                  request's own fields, checked
    chat_template_kwargs.<anything else>                          a template variable (data)

A request's own template is code that runs on the server (a 141-byte template can render for
seconds), so, as in vLLM, it is refused unless the operator opts in. Template variables are
passed as they are, but never under a name that apply_chat_template itself reads: otherwise
`chat_template_kwargs.tools` would go around the tools check.

What a render may cost is bounded before it runs (ServingContext.render_chat): at most
max_chat_messages messages, and `template_chars` (every character a template can print: the
messages' strings, nested keys, the tools, the template variables) plus a token's worth for
each message's header must fit the model's context at 32 characters a token. Tens of
thousands of empty messages once passed a check that counted only roles and contents, and
rendered for seconds to a prompt many times the context before failing.
"""

from __future__ import annotations

from typing import Any

from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatMessage

# apply_chat_template's own parameters, and the variables it sets from them.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)

UNTRUSTED_TEMPLATE = (
    "A chat template was passed with the request, but this server runs only its own: start it "
    "with --trust-request-chat-template to allow request templates."
)


def template_kwargs(
    kwargs: dict[str, Any] | None, chat_template: str | None, trusted: bool
) -> dict[str, Any]:
    """The keyword arguments for `Tokenizer.apply_chat_template`, checked.

    Args:
        kwargs: the request's chat_template_kwargs.
        chat_template: the request's chat_template field.
        trusted: the operator allows request templates.
    Returns:
        The template variables, plus `chat_template` when the request brought one (trusted).
    Raises:
        APIError: a request template without trust, a reserved name, or a template that is
            not a string (400 naming the field).
    """
    out = dict(kwargs or {})
    reserved = sorted(RESERVED_KWARGS & out.keys())
    if reserved:
        raise APIError(
            f"chat_template_kwargs must not set {', '.join(reserved)}: the request's own "
            "fields (messages, tools, add_generation_prompt) decide those.",
            param="chat_template_kwargs",
        )
    nested = out.pop("chat_template", None)
    for param, template in (("chat_template", chat_template), ("chat_template_kwargs", nested)):
        if template is None:
            continue
        if not trusted:
            raise APIError(UNTRUSTED_TEMPLATE, param=param)
        if not isinstance(template, str) or not template:
            raise APIError(f"{param} must be a non-empty template string.", param=param)
    template = chat_template if chat_template is not None else nested
    if template is not None:
        out["chat_template"] = template
    return out


def check_message_count(num_messages: int, cap: int) -> None:
    """400 for more messages than the server's max_chat_messages, before any is rendered."""
    if num_messages > cap:
        raise APIError(
            f"messages holds {num_messages} messages, more than this server takes in one "
            f"request (max_chat_messages: {cap}).",
            param="messages",
        )


def template_chars(*values: Any) -> int:
    """Characters in every string inside `values` (messages, tools, template variables) and
    every key below their top level (tojson prints an argument's keys); another scalar counts
    as one. A loop, not recursion: tool-call arguments arrive as JSON text of any depth."""
    total, stack = 0, [(v, False) for v in values]
    while stack:
        value, is_nested = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            if is_nested:
                total += sum(len(k) if isinstance(k, str) else 1 for k in value)
            stack.extend((v, True) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, is_nested) for v in value)
        elif value is not None:
            total += 1
    return total


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template takes them; tool-call arguments nested too deep for
    Python's JSON reader are a 400 naming the message."""
    out = []
    for i, message in enumerate(messages):
        try:
            out.append(message.for_template())
        except RecursionError:
            raise APIError(
                f"messages[{i}] has tool-call arguments nested too deep to read.",
                param="messages",
            ) from None
    return out
