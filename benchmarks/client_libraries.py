"""Which client libraries work, unmodified, against a running OpenAI-compatible server.

For each library that imports in this interpreter, five checks, each a real call:

    chat        one plain chat answer (non-empty text)
    stream      a streamed chat answer in more than one piece
    structured  an answer constrained to a JSON schema, parsed back into a pydantic model
    tool_loop   two rounds: the model calls a function (tool_choice "required" in round one,
                since small models seldom choose a tool by themselves), the library sends the
                call and its result back, and the server answers round two: in text, or
                "ok (called again)" where the model chose another call (SmolLM2-135M often
                does; what is checked is that the round trip works)
    responses   the Responses API (POST /v1/responses) through the library's own way to it

A check passes ("ok", with a note in brackets where the model rather than the library chose
the outcome) or gives the library's error, cut to 300 characters; "n/a" where the library has
no such feature. The libraries are not conveyor's dependencies: install them into a venv
of their own and run this with its Python (instructor pins an older openai, so it gets its own
venv); the server is started beforehand.

    python benchmarks/client_libraries.py --base-url http://127.0.0.1:8000/v1 --model NAME

stdout: one JSON object, {library: {version, check: "ok" | "n/a" | error}}.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
from collections.abc import Callable

import pydantic

LIBRARIES = ("openai", "langchain-openai", "openai-agents", "litellm", "pydantic-ai-slim",
             "instructor")  # fmt: skip
CHECKS = ("chat", "stream", "structured", "tool_loop", "responses")
PROMPT = "What is the capital of France? Answer in one sentence."
TOOL_PROMPT = "What is the weather in Paris? Use the get_weather tool."


class City(pydantic.BaseModel):
    name: str
    country: str


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 22 C in {city}."


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _text(value: str | None) -> str:
    if not value or not value.strip():
        raise AssertionError(f"empty answer: {value!r}")
    return value


def _round_two(text: str | None, calls: list | None) -> str | None:
    """Round two's outcome: text, or a note that the model called a tool again."""
    if calls:
        return "called again"
    _text(text)
    return None


def _city(value: City | str) -> City:
    return value if isinstance(value, City) else City.model_validate_json(value)


def openai_checks(base: str, model: str) -> dict[str, Callable[[], object]]:
    import openai

    client = openai.OpenAI(base_url=base, api_key="none")
    user = [{"role": "user", "content": PROMPT}]
    greedy = {"model": model, "temperature": 0}

    def stream():
        pieces = [
            c.choices[0].delta.content
            for c in client.chat.completions.create(messages=user, stream=True, **greedy)
            if c.choices and c.choices[0].delta.content
        ]
        assert len(pieces) > 1, pieces
        return _text("".join(pieces))

    def structured():
        schema = {"name": "City", "schema": City.model_json_schema()}
        r = client.chat.completions.create(
            messages=[{"role": "user", "content": "Name a city in France as JSON."}],
            response_format={"type": "json_schema", "json_schema": schema},
            **greedy,
        )
        return _city(r.choices[0].message.content)

    def tool_loop():
        messages = [{"role": "user", "content": TOOL_PROMPT}]
        first = client.chat.completions.create(
            messages=messages,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            **greedy,
        )
        message = first.choices[0].message
        assert message.tool_calls, message
        messages.append(message)  # the SDK's object as it came: content None
        for call in message.tool_calls:
            city = json.loads(call.function.arguments).get("city", "Paris")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(city)})
        second = client.chat.completions.create(messages=messages, tools=[WEATHER_TOOL], **greedy)
        return _round_two(second.choices[0].message.content, second.choices[0].message.tool_calls)

    return {
        "chat": lambda: _text(
            client.chat.completions.create(messages=user, **greedy).choices[0].message.content
        ),
        "stream": stream,
        "structured": structured,
        "tool_loop": tool_loop,
        "responses": lambda: _text(client.responses.create(input=PROMPT, **greedy).output_text),
    }


def langchain_checks(base: str, model: str) -> dict[str, Callable[[], object]]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base, api_key="none", model=model, temperature=0)
    weather = tool(get_weather)

    def stream():
        pieces = [c.content for c in llm.stream(PROMPT) if c.content]
        assert len(pieces) > 1, pieces
        return _text("".join(pieces))

    def tool_loop():
        messages = [HumanMessage(TOOL_PROMPT)]
        ai = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False).invoke(
            messages
        )
        assert ai.tool_calls, ai
        messages.append(ai)
        for call in ai.tool_calls:
            messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
        second = llm.bind_tools([weather]).invoke(messages)
        return _round_two(second.content, second.tool_calls)

    def responses():
        r = ChatOpenAI(
            base_url=base, api_key="none", model=model, temperature=0, use_responses_api=True
        ).invoke(PROMPT)
        return _text(r.text if isinstance(r.text, str) else r.text())

    return {
        "chat": lambda: _text(llm.invoke(PROMPT).content),
        "stream": stream,
        "structured": lambda: _city(
            llm.with_structured_output(City, method="json_schema").invoke("Name a city in France.")
        ),
        "tool_loop": tool_loop,
        "responses": responses,
    }


def agents_checks(base: str, model: str) -> dict[str, Callable[[], object]]:
    import agents
    import openai

    agents.set_tracing_disabled(True)
    greedy = agents.ModelSettings(temperature=0)

    def chat_model():  # a client per check: each runs its own event loop
        client = openai.AsyncOpenAI(base_url=base, api_key="none")
        return agents.OpenAIChatCompletionsModel(model=model, openai_client=client)

    def run(agent, prompt=PROMPT):
        return agents.Runner.run_sync(agent, prompt).final_output

    def stream():
        async def go():
            agent = agents.Agent("a", model=chat_model(), model_settings=greedy)
            result = agents.Runner.run_streamed(agent, PROMPT)
            pieces = [
                e.data.delta
                async for e in result.stream_events()
                if e.type == "raw_response_event"
                and getattr(e.data, "type", "") == "response.output_text.delta"
            ]
            assert len(pieces) > 1, pieces
            return _text("".join(pieces))

        return asyncio.run(go())

    def tool_loop():
        agent = agents.Agent(
            "weather",
            model=chat_model(),
            tools=[agents.function_tool(get_weather)],
            model_settings=agents.ModelSettings(
                temperature=0, tool_choice="required", parallel_tool_calls=False
            ),
        )
        try:
            result = agents.Runner.run_sync(agent, TOOL_PROMPT, max_turns=3)
        except agents.MaxTurnsExceeded as e:  # every turn a call, each result sent back
            outputs = [i for i in e.run_data.new_items if i.type == "tool_call_output_item"]
            assert len(outputs) >= 2, e.run_data.new_items
            return "called again"
        calls = [i for i in result.new_items if i.type == "tool_call_output_item"]
        assert calls, result.new_items
        _text(result.final_output)
        return None

    def responses():  # the SDK's default model: the Responses API
        client = openai.AsyncOpenAI(base_url=base, api_key="none")
        responses_model = agents.OpenAIResponsesModel(model=model, openai_client=client)
        return _text(run(agents.Agent("a", model=responses_model, model_settings=greedy)))

    return {
        "chat": lambda: _text(run(agents.Agent("a", model=chat_model(), model_settings=greedy))),
        "stream": stream,
        "structured": lambda: _city(
            run(
                agents.Agent("a", model=chat_model(), output_type=City, model_settings=greedy),
                "Name a city in France.",
            )
        ),
        "tool_loop": tool_loop,
        "responses": responses,
    }


def litellm_checks(base: str, model: str) -> dict[str, Callable[[], object]]:
    import litellm

    kw = {"model": f"openai/{model}", "api_base": base, "api_key": "none", "temperature": 0}
    user = [{"role": "user", "content": PROMPT}]

    def stream():
        pieces = [
            c.choices[0].delta.content
            for c in litellm.completion(messages=user, stream=True, **kw)
            if c.choices and c.choices[0].delta.content
        ]
        assert len(pieces) > 1, pieces
        return _text("".join(pieces))

    def tool_loop():
        messages = [{"role": "user", "content": TOOL_PROMPT}]
        first = litellm.completion(
            messages=messages,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            **kw,
        )
        message = first.choices[0].message
        assert message.tool_calls, message
        messages.append(message.model_dump())
        for call in message.tool_calls:
            city = json.loads(call.function.arguments).get("city", "Paris")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(city)})
        second = litellm.completion(messages=messages, tools=[WEATHER_TOOL], **kw)
        return _round_two(second.choices[0].message.content, second.choices[0].message.tool_calls)

    def responses():
        r = litellm.responses(input=PROMPT, **kw)
        texts = [c.text for item in r.output if item.type == "message" for c in item.content]
        return _text("".join(texts))

    return {
        "chat": lambda: _text(litellm.completion(messages=user, **kw).choices[0].message.content),
        "stream": stream,
        "structured": lambda: _city(
            litellm.completion(
                messages=[{"role": "user", "content": "Name a city in France as JSON."}],
                response_format=City,
                **kw,
            )
            .choices[0]
            .message.content
        ),
        "tool_loop": tool_loop,
        "responses": responses,
    }


def pydantic_ai_checks(base: str, model: str) -> dict[str, Callable[[], object]]:
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base, api_key="none")
    greedy = ModelSettings(temperature=0)
    chat_model = OpenAIChatModel(model, provider=provider, settings=greedy)

    def stream():
        async def go():
            async with Agent(chat_model).run_stream(PROMPT) as result:
                pieces = [p async for p in result.stream_text(delta=True, debounce_by=None) if p]
            assert len(pieces) > 1, pieces
            return _text("".join(pieces))

        return asyncio.run(go())

    def tool_loop():
        calls = []

        def weather(city: str) -> str:
            """The weather in a city."""
            calls.append(city)
            return get_weather(city)

        agent = Agent(chat_model, tools=[weather])
        # pydantic-ai sends tool_choice "auto" and has no setting for "required".
        answer = agent.run_sync(TOOL_PROMPT).output
        _text(answer)
        return None if calls else "no call: under tool_choice auto the model answered in text"

    return {
        "chat": lambda: _text(Agent(chat_model).run_sync(PROMPT).output),
        "stream": stream,
        "structured": lambda: _city(
            Agent(chat_model, output_type=City).run_sync("Name a city in France.").output
        ),
        "tool_loop": tool_loop,
        "responses": lambda: _text(
            Agent(OpenAIResponsesModel(model, provider=provider, settings=greedy))
            .run_sync(PROMPT)
            .output
        ),
    }


def instructor_checks(base: str, model: str) -> dict[str, Callable[[], object]]:
    import instructor
    import openai

    raw = openai.OpenAI(base_url=base, api_key="none")
    user = [{"role": "user", "content": "Name a city in France."}]

    def structured():
        client = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
        return _city(
            client.chat.completions.create(model=model, messages=user, response_model=City)
        )

    def responses():
        client = instructor.from_openai(raw, mode=instructor.Mode.RESPONSES_TOOLS)
        return _city(client.responses.create(model=model, input=user, response_model=City))

    def chat():
        client = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
        return _text(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], response_model=None
            )
            .choices[0]
            .message.content
        )

    def stream():  # instructor streams partial objects
        client = instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
        parts = list(
            client.chat.completions.create_partial(
                model=model, messages=user, response_model=City, temperature=0
            )
        )
        assert len(parts) > 1, parts
        return _city(parts[-1].model_dump_json())

    return {"chat": chat, "stream": stream, "structured": structured, "responses": responses}


CHECKERS = {
    "openai": openai_checks,
    "langchain-openai": langchain_checks,
    "openai-agents": agents_checks,
    "litellm": litellm_checks,
    "pydantic-ai-slim": pydantic_ai_checks,
    "instructor": instructor_checks,
}


def run(
    base: str, model: str, libraries: list[str], checks_wanted: list[str] | None = None
) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name in libraries:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        row = out[name] = {"version": version}
        try:
            checks = CHECKERS[name](base, model)
        except Exception as e:  # an import or set-up failure fails every check
            checks = {}
            row["setup"] = f"{type(e).__name__}: {e}"[:300]
        for check in checks_wanted or CHECKS:
            if check not in checks:
                row[check] = "n/a" if "setup" not in row else "failed at setup"
                continue
            try:
                note = checks[check]()
                row[check] = (
                    f"ok ({note})" if isinstance(note, str) and check == "tool_loop" else "ok"
                )
            except Exception as e:  # the library's own error, reported as it came
                row[check] = f"{type(e).__name__}: {e}"[:300]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the server's /v1 URL")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--library", action="append", choices=LIBRARIES, help="(default: all)")
    p.add_argument("--check", action="append", choices=CHECKS, help="(default: all)")
    args = p.parse_args(argv)
    result = run(args.base_url, args.model, args.library or list(LIBRARIES), args.check)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
