"""The OpenAI Agents SDK (``openai-agents``) with its default model, which
speaks the Responses API, against a real Baton server: an agent with a
function tool, run whole and streamed.

Two setups. The embedded SmolLM2 with tool_choice required and
stop_on_first_tool: the grammar makes its call valid, the SDK runs the tool.
And a two-turn run (call, then answer) on a random-weight model whose
replies are scripted, so that the turns are known: the SDK sends the call
and the tool's output back, and the answer ends the run."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from service.config import EngineArgs, ServerConfig
from service.engine_factory import create_engine
from tests.engine_helpers import make_engine
from tests.server_helpers import captured_prompts, patched_execute, running_server
from tests.test_tool_calls import HERMES_TEMPLATE

# Slow (a server on the embedded model and the Agents SDK's runs): the full suite runs these,
# ./scripts/test.sh --quick does not.
pytestmark = pytest.mark.slow

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."


@pytest.fixture(autouse=True, scope="module")
def no_tracing():
    set_tracing_disabled(True)   # the SDK would export traces to OpenAI
    yield
    set_tracing_disabled(False)


def _weather_tool(calls: list[str]):
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny and 24 C in {city}"
    return get_weather


def _model(server) -> OpenAIResponsesModel:
    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return OpenAIResponsesModel(model=server.state.model_name, openai_client=client)


@pytest.fixture(scope="module")
def embedded_server():
    with running_server(make_engine(None, dtype="auto", num_kv_blocks=256),
                        ServerConfig()) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_calls_its_tool_on_the_embedded_model(embedded_server, stream):
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Use the tool to answer.",
                  tools=[_weather_tool(calls)], model=_model(embedded_server),
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=60))
    question = "What is the weather in Paris?"
    if stream:
        async def run():
            result = Runner.run_streamed(agent, question)
            kinds = [event.type async for event in result.stream_events()]
            return result, kinds
        result, kinds = asyncio.run(run())
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    else:
        result = asyncio.run(Runner.run(agent, question))
    embedded_server.wait_idle()
    assert len(calls) == 1 and calls[0]          # the SDK ran the tool once, with a city
    assert result.final_output == f"Sunny and 24 C in {calls[0]}"
    [response] = result.raw_responses
    assert response.response_id.startswith("resp_")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0


@contextlib.contextmanager
def scripted_turns(core, replies: list[str]):
    """The n-th request the engine starts writes ``replies[n]`` (then EOS),
    whatever the model computes."""
    scripts = [core.tokenizer.encode(r, add_special_tokens=False) + [min(core.eos_token_ids)]
               for r in replies]
    order: dict[str, int] = {}
    made: dict[str, int] = {}

    def wrap(real):
        def execute(output):
            result = real(output)
            for i, rid in enumerate(result.request_ids):
                script = scripts[order.setdefault(rid, len(order))]
                n = made.get(rid, 0)
                result.token_ids[i] = script[min(n, len(script) - 1)]
                made[rid] = n + 1
            return result
        return execute
    with patched_execute(core, wrap):
        yield


@pytest.fixture(scope="module")
def hermes_server(tiny_qwen2_dir):
    core = create_engine(EngineArgs(model=str(tiny_qwen2_dir), dtype="float32",
                                    num_kv_blocks=256, seed=1, chat_template=HERMES_TEMPLATE))
    with running_server(core, ServerConfig()) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_agent_run_sends_the_tool_output_back(hermes_server, stream):
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Use the tool to answer.",
                  tools=[_weather_tool(calls)], model=_model(hermes_server),
                  model_settings=ModelSettings(max_tokens=80))
    with scripted_turns(hermes_server.core, [CALL, ANSWER]), \
            captured_prompts(hermes_server) as prompts:
        if stream:
            async def run():
                result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
                async for _ in result.stream_events():
                    pass
                return result
            result = asyncio.run(run())
        else:
            result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert calls == ["Paris"]
    assert result.final_output == ANSWER
    assert len(result.raw_responses) == 2 and len(prompts) == 2
    # The second turn carried the call and the tool's output, as the template renders them.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompts[1]
    assert "<tool_response>Sunny and 24 C in Paris</tool_response>" in prompts[1]
    assert "Use the tool to answer." in prompts[0] and "Use the tool to answer." in prompts[1]
    hermes_server.wait_idle()
