"""The Responses API's output items, whole and as the SSE events of a streamed response.

Items: `reasoning` (the answer's thinking, when a reasoning parser splits it off), `message`
(one `output_text` part) and `function_call` (`call_id`, `name`, `arguments`), in the order
the answer wrote them. A stream sends, with a `sequence_number` each:

    response.created, response.in_progress
    per item  response.output_item.added
              message:   response.content_part.added, response.output_text.delta ...,
                         response.output_text.done, response.content_part.done
              reasoning: response.content_part.added, response.reasoning_text.delta ...,
                         response.reasoning_text.done, response.content_part.done
              function_call: response.function_call_arguments.delta ..., .done
              response.output_item.done
    response.completed (or response.incomplete, with the whole response)

The text goes through the chat path's own splitters (server/reasoning.py's ReasoningStream,
server/tools.py's ToolCallStream), so the streamed items join to the whole answer's.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from conveyor.server.reasoning import ReasoningParser, reasoning_item
from conveyor.server.tool_parsers import ToolCall
from conveyor.server.tools import ToolCallStream, ToolSetup, tool_call_dict


def item_id(prefix: str) -> str:
    """An OpenAI-style id: `resp_`, `msg_`, `fc_` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """The item of one chat tool call (server/tools.py's `tool_call_dict`)."""
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def output_items(
    thinking: str | None, content: str | None, calls: list[dict[str, Any]], status: str
) -> list[dict[str, Any]]:
    """A whole answer's items: its thinking, its text, its calls (a message, maybe empty,
    when it has nothing else). `status` is the last item's ("incomplete" when cut off)."""
    items = [reasoning_item(thinking)] if thinking else []
    if content or not calls:
        items.append(message_item(content or ""))
    items += [function_call_item(c) for c in calls]
    items[-1]["status"] = status
    return items


class ResponseEvents:
    """The SSE events of one streamed response (the module docstring).

    Args:
        response: the response object as `response.created` shows it (status "in_progress",
            no output); the last event sends it again, completed.
        tools: the request's tools (None: all text is the message's).
        reasoning: the reasoning parser (None: no reasoning item).
    """

    def __init__(
        self, response: dict[str, Any], tools: ToolSetup | None, reasoning: ReasoningParser | None
    ) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = []
        self.thinking = ""  # all the reasoning text, for usage
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._tools = tools
        self._reasoning = reasoning.stream() if reasoning is not None else None
        auto = tools is not None and tools.mode in ("auto", "required")
        self._calls = ToolCallStream(tools) if auto else None
        self._call_items: dict[int, dict[str, Any]] = {}  # call index -> its item

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def openings(self) -> list[str]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def feed(self, text: str, finish_reason: str | None) -> list[str]:
        """The events of the answer's next `text` (`finish_reason`: the answer is complete)."""
        events: list[str] = []
        thinking, raw = "", text
        finished = finish_reason is not None
        if self._reasoning is not None:
            thinking, text = self._reasoning.feed(text)
            if finished:
                more_thinking, rest = self._reasoning.finish()
                thinking, text = thinking + more_thinking, text + rest
        if thinking:
            self.thinking += thinking
            events += self._delta("reasoning", thinking)
        if self._tools is not None and self._tools.mode == "named":
            if text or not self._call_items:
                first = not self._call_items
                call = tool_call_dict(ToolCall(str(self._tools.named), ""))
                events += self._call(0, call if first else None, text)
        elif self._calls is not None:
            content, calls = self._calls.feed(raw if self._tools.markup else text)
            if finished:
                rest, more, _ = self._calls.finish(finish_reason)
                content, calls = content + rest, calls + more
            if content:
                events += self._delta("message", content)
            for call in calls:
                opened = call if "id" in call else None
                events += self._call(call["index"], opened, call["function"]["arguments"])
        elif text:
            events += self._delta("message", text)
        return events

    def close(self, status: str, usage: dict[str, Any], details: dict[str, Any]) -> list[str]:
        """The last events: `done`'s, then `last`'s."""
        return [*self.done(status, usage, details), self.last()]

    def done(self, status: str, usage: dict[str, Any], details: dict[str, Any]) -> list[str]:
        """The open item's last events; `self.response` is then the finished response, with
        `status`, `usage` and `details` (what explains the status)."""
        events = []
        if all(item["type"] == "reasoning" for item in self.output):
            events += self._delta("message", "")  # no text, no call: one empty message
        events += self._close("completed" if status == "completed" else "incomplete")
        self.response = {**self.response, "status": status, "output": self.output}
        self.response.update(usage=usage, **details)
        return events

    def last(self) -> str:
        """response.completed (or .incomplete, .failed) with the finished response."""
        return self._event(f"response.{self.response['status']}", response=self.response)

    def _delta(self, kind: str, text: str) -> list[str]:
        """Text for the open message or reasoning item (opening a new one if needed)."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._add(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        if text:
            name = "output_text" if kind == "message" else "reasoning_text"
            fields: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            events.append(
                self._event(f"response.{name}.delta", **self._where(), delta=text, **fields)
            )
        return events

    def _call(self, index: int, opened: dict[str, Any] | None, arguments: str) -> list[str]:
        """A call's first delta (`opened`: its id and name) or more of its arguments."""
        events = []
        if opened is not None:
            events += self._close()
            item = function_call_item(opened, "in_progress")
            item["arguments"] = ""
            self._call_items[index] = item
            events += self._add_item(item)
        item = self._call_items.get(index)
        if item is None or item is not self._open or not arguments:
            return events  # nothing new, or a call already closed (what was sent stays)
        item["arguments"] += arguments
        events.append(
            self._event("response.function_call_arguments.delta", **self._where(), delta=arguments)
        )
        return events

    def _add(self, kind: str) -> list[str]:
        if kind == "message":
            item = message_item("", "in_progress")
        else:
            item = reasoning_item("")
            item["status"] = "in_progress"
        events = self._add_item(item, {**item, "content": []})  # its part is added next
        part = dict(item["content"][0])
        events.append(self._event("response.content_part.added", **self._where(), part=part))
        return events

    def _add_item(self, item: dict[str, Any], shown: dict[str, Any] | None = None) -> list[str]:
        self._open = item
        self.output.append(item)
        index = len(self.output) - 1
        shown = item if shown is None else shown
        return [self._event("response.output_item.added", output_index=index, item=shown)]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        where = {"item_id": self._open["id"], "output_index": len(self.output) - 1}
        return where if self._open["type"] == "function_call" else {**where, "content_index": 0}

    def _close(self, status: str = "completed") -> list[str]:
        item = self._open
        if item is None:
            return []
        events, where = [], self._where()
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            fields: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self._event(f"response.{name}.done", **where, text=part["text"], **fields)
            )
            events.append(self._event("response.content_part.done", **where, part=part))
        item["status"] = status
        self._open = None
        index = where["output_index"]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events
