"""gpt-oss's harmony format: a chat answer read as OpenAI's harmony messages, whole or streamed.

The chat template ends the prompt with `<|start|>assistant`, so the answer opens inside the
first message's header; the model writes one or more messages:

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>
    <|start|>assistant<|channel|>commentary<|message|>...<|end|>           (a preamble)
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}

Each message is read as vLLM reads gpt-oss answers:

    recipient functions.NAME (in either header)      a call of NAME; its arguments are the
                                                     message's text, blanks around it dropped
    channel analysis (to no function)                reasoning
    channel final, or commentary with no recipient   content
    commentary to another recipient (a built-in tool of OpenAI's), no channel: nothing

Several messages of one kind are joined with a newline. `<|return|>` and `<|call|>` are stop
tokens, so their text never reaches the answer: the end of the text ends the last message.
An answer cut off (max_tokens) keeps what its last message wrote, a call's arguments as far as
written; a header cut off before its `<|message|>` is nothing. A marker (`<|channel|>` inside a
message's text, `<|start|>`) that opens a header where no end marker came first ends the
message before it, as if the model had written the `<|end|>`; `<|message|>` and `<|constrain|>`
inside a message's text are text.

The markers are the tokenizer's special tokens: the server decodes harmony answers with
skip_special_tokens off (server/chat.py) and never shows them. `HarmonyReader` reads the text as
it comes, holding back a possible start of a marker until it is known, so a stream's deltas
join to the whole answer's reading (`read_harmony` reads it in one piece).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# The markers that end generation: stop tokens whatever the checkpoint's generation_config says.
STOP_MARKERS = (RETURN, CALL)

_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_LONGEST = max(map(len, MARKERS))
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of a marker (0: none)."""
    i = text.find("<", max(0, len(text) - _LONGEST + 1))
    while i >= 0:
        tail = text[i:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in MARKERS):
            return len(tail)
        i = text.find("<", i + 1)
    return 0


def message_kind(header: str) -> tuple[str | None, str]:
    """What a message with this header is: ("reasoning" | "content" | "call" | None, the
    called function's name or "")."""
    recipient = _RECIPIENT.search(header)
    to = recipient.group(1) if recipient else None
    if to is not None and to.startswith(_FUNCTIONS) and len(to) > len(_FUNCTIONS):
        return "call", to[len(_FUNCTIONS) :]
    channel = _CHANNEL_NAME.search(header)
    name = channel.group(1) if channel else None
    if name == "analysis":
        return "reasoning", ""
    if name == "final" or (name == "commentary" and to is None):
        return "content", ""
    return None, ""


@dataclass(slots=True)
class HarmonyCall:
    """A call as far as its message has been read."""

    name: str
    text: str = ""  # the message's text so far

    @property
    def arguments(self) -> str:
        # Blanks at the end may be followed by more: a stream holds them back, the end drops them.
        return self.text.strip()


@dataclass(slots=True)
class HarmonyAnswer:
    """A whole answer's reading: `reasoning` None when it has no analysis message."""

    reasoning: str | None
    content: str
    calls: list[HarmonyCall] = field(default_factory=list)


class HarmonyReader:
    """One answer's text, fed in any pieces, as (reasoning delta, content delta) pairs; `calls`
    holds its calls as far as read. States: header (up to `<|message|>`; the answer starts
    there), text (of a message), between (after an end marker: anything but a header's start
    is dropped)."""

    def __init__(self) -> None:
        self._state = "header"
        self._header = ""
        self._kind: str | None = None
        self._held = ""  # a possible start of a marker
        self.calls: list[HarmonyCall] = []
        self.reasoning_messages = 0
        self.content_messages = 0

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) after `text` more of the answer."""
        buf = self._held + text
        end = len(buf) - _partial_marker(buf)
        self._held = buf[end:]
        out: tuple[list[str], list[str]] = ([], [])
        pos = 0
        for m in _MARKER.finditer(buf, 0, end):
            self._text(buf[pos : m.start()], out)
            self._marker(m.group(), out)
            pos = m.end()
        self._text(buf[pos:end], out)
        return "".join(out[0]), "".join(out[1])

    def finish(self) -> tuple[str, str]:
        """The last deltas once the answer is complete: a held-back start of a marker that
        never completed is text."""
        out: tuple[list[str], list[str]] = ([], [])
        held, self._held = self._held, ""
        self._text(held, out)
        return "".join(out[0]), "".join(out[1])

    def _text(self, text: str, out: tuple[list[str], list[str]]) -> None:
        if not text:
            return
        if self._state == "header":
            self._header += text
        elif self._state == "text":
            if self._kind == "reasoning":
                out[0].append(text)
            elif self._kind == "content":
                out[1].append(text)
            elif self._kind == "call":
                self.calls[-1].text += text

    def _marker(self, marker: str, out: tuple[list[str], list[str]]) -> None:
        if marker == MESSAGE and self._state != "text":
            self._open(out)
        elif marker == START:
            self._state, self._header = "header", ""
        elif marker == CHANNEL and self._state != "header":
            self._state, self._header = "header", marker  # a header with no <|start|>
        elif self._state == "header" and marker in (CHANNEL, CONSTRAIN):
            self._header += marker
        elif marker in (END, RETURN, CALL):
            self._state = "between"
        else:  # <|message|> or <|constrain|> inside a message's text: text as written
            self._text(marker, out)

    def _open(self, out: tuple[list[str], list[str]]) -> None:
        """`<|message|>`: the header is complete, the message's text starts."""
        header = self._header if self._state == "header" else ""
        self._state, self._header = "text", ""
        self._kind, name = message_kind(header)
        if self._kind == "reasoning":
            if self.reasoning_messages:
                out[0].append("\n")
            self.reasoning_messages += 1
        elif self._kind == "content":
            if self.content_messages:
                out[1].append("\n")
            self.content_messages += 1
        elif self._kind == "call":
            self.calls.append(HarmonyCall(name))


def read_harmony(text: str) -> HarmonyAnswer:
    """A whole answer's reasoning, content and calls."""
    reader = HarmonyReader()
    reasoning, content = reader.feed(text)
    more_reasoning, more_content = reader.finish()
    return HarmonyAnswer(
        reasoning + more_reasoning if reader.reasoning_messages else None,
        content + more_content,
        reader.calls,
    )
