"""What a chat render may cost (issue 49, item 5), against a real `conveyor serve`.

65,000 empty messages once passed the 262,144-character check (it counted roles and contents
only), rendered for seconds to 325,025 tokens and only then failed; four senders of them held
a one-message chat for 9 s, queued behind their renders in one first-come pool. Now a request
holds at most max_chat_messages messages, each message counts a token's worth of characters
against the context before anything renders, tools and template variables count too, and
small renders run in a lane of their own (server/offload.py).

The server's chat template here is the demo model's with a loop over the messages for each
message (templates that look for the last user turn this way exist): legal requests with a
thousand messages take seconds to render, the honest kind of heavy request.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
from tests.serve_process import start_server

from conveyor.server.context import MAX_CHARS_PER_TOKEN
from conveyor.server.offload import LIGHT_FACTOR, _light_pool, _pool, text_pool

MAX_MESSAGES = 3000
MAX_MODEL_LEN = 2048
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
# For each message, every message is visited: quadratic in the number of messages.
QUADRATIC = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- for k in messages %}"
    "{%- if k['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}"
    "{%- endfor %}{%- endfor %}"
)
HEAVY_MESSAGES = 1000  # ~2.5 s to render on a quiet machine; well within every limit


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-limits")
    model = tmp / "model"
    shutil.copytree(demo_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QUADRATIC + config["chat_template"]
    config_path.write_text(json.dumps(config))
    args = ["--model", str(model), "--max-chat-messages", str(MAX_MESSAGES)]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "160"]
    proc = start_server(args, tmp)
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _error(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    return error["message"]


def _empty(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": ""}] * n


@pytest.mark.slow
def test_65000_empty_messages_are_a_400_naming_the_limit_before_any_render(http) -> None:
    started = time.monotonic()
    message = _error(
        http.post(CHAT, json={"messages": _empty(65_000), "max_tokens": 1}), "messages"
    )
    assert "65000 messages" in message and f"max_chat_messages: {MAX_MESSAGES}" in message
    # Rendered (quadratic here) it would take minutes; refused, it takes the parse.
    assert time.monotonic() - started < 30
    message = _error(http.post(CHAT, json={"messages": _empty(MAX_MESSAGES + 1)}), "messages")
    assert f"{MAX_MESSAGES + 1} messages" in message
    assert http.post(CHAT, json={"messages": HI, "max_tokens": 1}).status_code == 200


@pytest.mark.slow
def test_each_message_counts_a_token_against_the_context_before_rendering(http) -> None:
    # 2000 empty messages: 8,000 characters of roles, but at least 2000 tokens of headers
    # plus the text: more than 2048 tokens can hold at 32 characters each.
    many = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN // (MAX_CHARS_PER_TOKEN + len("user")) + 1
    assert many < MAX_MESSAGES
    message = _error(http.post(CHAT, json={"messages": _empty(many)}), "messages")
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN}")
    assert f"in {many} messages" in message and "not tokenized" in message


@pytest.mark.slow
def test_tools_and_template_variables_count_against_the_context(http) -> None:
    long = "x" * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN)
    tool = {"type": "function", "function": {"name": "f", "description": long}}
    for extra in ({"tools": [tool]}, {"chat_template_kwargs": {"notes": long}}):
        body = {"messages": HI, "max_tokens": 1, **extra}
        message = _error(http.post(CHAT, json=body), "messages")
        assert "not tokenized" in message, message


@pytest.mark.slow
def test_template_variables_named_like_the_pools_arguments_are_plain_variables(http) -> None:
    body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"fn": 1, "pool": 2}}
    resp = http.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text


@pytest.mark.slow
def test_tool_call_arguments_nested_past_pythons_reader_are_a_400(http) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]
    message = _error(http.post(CHAT, json={"messages": messages}), "messages")
    assert "messages[1]" in message and "nested too deep" in message


@pytest.mark.slow
def test_a_small_chat_is_not_stuck_behind_heavy_legal_renders(server, http) -> None:
    heavy = {"messages": _empty(HEAVY_MESSAGES), "max_tokens": 1}
    done: dict[str, float] = {}
    statuses: dict[str, int] = {}

    def send(name: str, body: dict) -> None:
        resp = httpx.post(f"{server.base_url}{CHAT}", json=body, timeout=300)
        statuses[name] = resp.status_code
        done[name] = time.monotonic()

    started = time.monotonic()
    workers = [threading.Thread(target=send, args=(f"heavy{i}", heavy)) for i in range(3)]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # the heavy renders have been parsed and queued (they take seconds)
    send("small", {"messages": HI, "max_tokens": 1})
    for worker in workers:
        worker.join()
    assert statuses["small"] == 200
    # Legal, rendered, and then too long for this model's context: 400 after the render.
    assert all(statuses[f"heavy{i}"] == 400 for i in range(3)), statuses
    first_heavy = min(done[f"heavy{i}"] for i in range(3))
    assert first_heavy - started > 1.0, "the heavy renders were not heavy: this proves nothing"
    # In one first-come pool of two threads the small render waited for two heavy ones.
    assert done["small"] < first_heavy, (done, started)


def test_text_work_goes_to_the_lane_of_its_size() -> None:
    assert text_pool(10) is text_pool(LIGHT_FACTOR * 2048) is _light_pool()
    assert text_pool(LIGHT_FACTOR * 2048 + 1) is text_pool(None) is _pool()
    assert _light_pool() is not _pool()
