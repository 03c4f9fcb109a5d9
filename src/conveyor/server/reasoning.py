"""Reasoning models: a chat answer's thinking (`<think>…</think>`, or harmony's analysis channel)
split off as `reasoning_content` (vLLM's `--reasoning-parser`). `--reasoning-parser NAME` picks
a parser; without it the chat template decides (`detect_reasoning_parser`); `none` turns the
split off (not for harmony: a template with `<|channel|>` is read as harmony whole, through its
tool-call format, server/chat.py).

    deepseek_r1  DeepSeek-R1, QwQ, Qwen3-Thinking: the template's generation prompt may end
                 with `<think>\\n`, so the answer may start inside its thinking: everything up
                 to `</think>` is reasoning, with or without an opening `<think>`
    qwen3        Qwen3 (hybrid thinking): reasoning only when the answer opens with `<think>`
                 (blanks before it are dropped); an answer without it is all content
    think        an alias of qwen3: any model that writes `<think>…</think>` itself
    harmony      gpt-oss (a template with `<|channel|>`): the analysis channel is the reasoning,
                 the final channel and preambles the content, and calls are read from the same
                 answer by the harmony tool-call format (server/harmony.py)

Either way an answer cut off before `</think>` is all reasoning once it began, and what follows
`</think>` is the content, exactly as written. Streamed, `ReasoningStream` sends the same text
in deltas: a tag split across deltas is held back until it is known (a trailing `</thi` is not
sent as reasoning), so the deltas join to `ReasoningParser.split`'s result.

A request turns the split off with `chat_template_kwargs: {"enable_thinking": false}` (or
`"thinking": false`) when its chat template reads that variable: the template then writes an
empty think block into the prompt itself, and whatever the model writes is content.

An output constraint (response_format, structured_outputs, guided_*, tool_choice "required" or
a named function) would constrain the thinking too, from the first token, so with a reasoning
split it is refused (400, `constraint_refusal`) instead of answered with broken reasoning.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from conveyor.server.harmony import CHANNEL, HarmonyReader, read_harmony

logger = logging.getLogger("conveyor.server")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_BLANKS = " \t\r\n"
# chat_template_kwargs names with which Qwen3 (enable_thinking) and DeepSeek-V3.1 (thinking)
# templates turn thinking off.
THINKING_SWITCHES = ("enable_thinking", "thinking")


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One reasoning format: `starts_inside` says the answer may begin inside its thinking."""

    name: str
    starts_inside: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer; reasoning None when it has no thinking."""
        s = text.lstrip(_BLANKS)
        if s.startswith(THINK_OPEN):
            body = s[len(THINK_OPEN) :]
        elif self.starts_inside:
            body = text
        else:
            return None, text
        end = body.find(THINK_CLOSE)
        if end < 0:
            return body, ""
        return body[:end], body[end + len(THINK_CLOSE) :]

    def stream(self) -> ReasoningStream:
        """A splitter for one streamed answer."""
        return ReasoningStream(self)


@dataclass(frozen=True, slots=True)
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony answers: (reasoning, content) of its channels; calls are dropped here
    and read by the harmony tool-call format (server/tool_parsers.py) when the request has
    tools."""

    def split(self, text: str) -> tuple[str | None, str]:
        answer = read_harmony(text)
        return answer.reasoning, answer.content

    def stream(self) -> HarmonyReader:  # ReasoningStream's feed and finish
        return HarmonyReader()


HARMONY = HarmonyReasoningParser("harmony", starts_inside=True)
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
    "think": ReasoningParser("think", starts_inside=False),
    "harmony": HARMONY,
}
# --reasoning-parser's choices: a parser, or none (no split even if the template thinks).
REASONING_PARSER_CHOICES = (*REASONING_PARSERS, "none")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """One streamed answer's text as (reasoning delta, content delta) pairs.

    States: deciding (has the answer opened `<think>`? only blanks and a start of the tag are
    held), reasoning (all but a possible start of `</think>` is sent), content (sent as is).
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._state = "deciding"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) after `text` more of the answer."""
        if self._state == "content":
            return "", text
        held = self._held + text
        self._held = ""
        if self._state == "deciding":
            s = held.lstrip(_BLANKS)
            if len(s) < len(THINK_OPEN) and THINK_OPEN.startswith(s):
                self._held = held  # blanks, or a start of <think>: not known yet
                return "", ""
            if s.startswith(THINK_OPEN):
                held = s[len(THINK_OPEN) :]
            elif not self._parser.starts_inside:
                self._state = "content"
                return "", held
            self._state = "reasoning"
        end = held.find(THINK_CLOSE)
        if end >= 0:
            self._state = "content"
            return held[:end], held[end + len(THINK_CLOSE) :]
        keep = _partial_suffix(held, THINK_CLOSE)
        if keep:
            held, self._held = held[:-keep], held[-keep:]
        return held, ""

    def finish(self) -> tuple[str, str]:
        """The held-back text once the answer is complete (as `split` reads it)."""
        held, self._held = self._held, ""
        if self._state == "content":
            return "", held
        if self._state == "deciding" and not self._parser.starts_inside:
            return "", held  # it never opened <think>
        return held, ""


def thinking_disabled(template_kwargs: dict[str, Any] | None, template_source: str) -> bool:
    """Whether a request turned thinking off through a template variable its template reads
    (`enable_thinking: false`, `thinking: false`); one the template never reads changes
    nothing, so the model still thinks."""
    for name in THINKING_SWITCHES:
        value = (template_kwargs or {}).get(name)
        if value is False and re.search(rf"\b{name}\b", template_source):
            return True
    return False


def detect_reasoning_parser(template: str | None, generation_prompt: str | None) -> str | None:
    """The reasoning parser a chat template calls for: "deepseek_r1" when its generation
    prompt (what add_generation_prompt adds to a one-message chat; None: not renderable)
    leaves a `<think>` open, "qwen3" when the template otherwise names the tags, "harmony" when
    it writes harmony's channels (gpt-oss), else None."""
    if template and CHANNEL in template:
        return "harmony"
    if not template or (THINK_OPEN not in template and THINK_CLOSE not in template):
        return None
    if generation_prompt is not None:
        opened = generation_prompt.rfind(THINK_OPEN)
        if opened >= 0 and THINK_CLOSE not in generation_prompt[opened:]:
            return "deepseek_r1"
    return "qwen3"


def generation_prompt(hf_tokenizer: Any) -> str | None:
    """What the tokenizer's chat template adds for add_generation_prompt, after one user
    message (None: the template cannot render that, or has no such suffix)."""
    messages = [{"role": "user", "content": "Hi"}]
    try:
        render = hf_tokenizer.apply_chat_template
        with_prompt = render(messages, add_generation_prompt=True, tokenize=False)
        without = render(messages, add_generation_prompt=False, tokenize=False)
    except Exception:  # a template that needs more (a system message, tools): text only
        return None
    if not isinstance(with_prompt, str) or not isinstance(without, str):
        return None
    return with_prompt[len(without) :] if with_prompt.startswith(without) else None


def choose_reasoning_parser(flag: str | None, tokenizer: Any) -> ReasoningParser | None:
    """The server's reasoning parser: --reasoning-parser's (`none`: off), else the one the
    chat template calls for; the choice is logged.

    Args:
        flag: ServerConfig.reasoning_parser.
        tokenizer: the engine's Tokenizer (its chat template), or None.
    """
    if flag == "none":
        logger.info("Reasoning parser: none (--reasoning-parser none)")
        return None
    if flag is not None:
        logger.info("Reasoning parser: %s (--reasoning-parser)", flag)
        return REASONING_PARSERS[flag]
    template = getattr(tokenizer, "chat_template_text", None)
    name = None
    if template and CHANNEL in template:
        name = "harmony"
    elif template and (THINK_OPEN in template or THINK_CLOSE in template):
        name = detect_reasoning_parser(template, generation_prompt(tokenizer.hf))
    if name is None:
        logger.info("Reasoning parser: none (the chat template has no <think> tags or channels)")
        return None
    logger.info("Reasoning parser: %s (read from the chat template)", name)
    return REASONING_PARSERS[name]


def constraint_refusal(parser: ReasoningParser, param: str) -> str:
    """The 400 message for an output constraint on a request whose answer is split."""
    message = (
        f"{param} constrains the whole answer from its first token, thinking included, and "
        f'this server splits the answer\'s thinking off (reasoning parser "{parser.name}"): '
    )
    if parser is HARMONY:  # its channels, markers and all, are the answer: nothing turns off
        return message + "send no output constraint to this model."
    return message + (
        "send no output constraint, or turn thinking off for this request with "
        'chat_template_kwargs {"enable_thinking": false} where the chat template reads it '
        "(or start the server with --reasoning-parser none)."
    )


def reasoning_item(reasoning: str) -> dict[str, Any]:
    """The Responses API output item of an answer's reasoning (`ReasoningParser.split`'s
    first part), placed before its message item: OpenAI's `reasoning` item, the text as
    one `reasoning_text` content part (the model's own thinking, not a summary)."""
    from conveyor.server.responses import random_id  # pydantic: not for config parsing

    return {
        "type": "reasoning",
        "id": random_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": reasoning}],
        "status": "completed",
    }
