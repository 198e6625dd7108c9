"""The clients people already use, from their own PyPI packages and unchanged, against the
session's `bentoml serve`: the openai SDK's Responses API, the Agents SDK, LangChain,
LlamaIndex and instructor. Each asserts what its user relies on: the tool was called
with arguments valid for its schema, the structured result validates, the answer
carries the tool's result. Greedy decoding (temperature 0) keeps them deterministic."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.server import KEY, MODEL


WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
RESULT = "Sunny and 22 degrees Celsius"


class City(BaseModel):
    name: str
    country: str


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.url}/v1"


# -- openai: client.responses ------------------------------------------------------------------
def test_responses_answer_and_continue_by_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                    max_output_tokens=24)
    assert first.status == "completed" and "Paris" in first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    follow = client.responses.create(model=MODEL, input="And the capital of Italy?", temperature=0,
                                     max_output_tokens=24, previous_response_id=first.id)
    assert "Rome" in follow.output_text and follow.previous_response_id == first.id
    scored = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=5, top_logprobs=2,
                                     include=["message.output_text.logprobs"], store=False)
    lps = scored.output[0].content[0].logprobs
    assert len(lps) == scored.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == scored.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"


def test_a_streamed_response_has_the_typed_events_and_the_same_text(client):
    whole = client.responses.create(model=MODEL, input="Name three colours.", temperature=0, max_output_tokens=24)
    with client.responses.stream(model=MODEL, input="Name three colours.", temperature=0,
                                 max_output_tokens=24) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-1].response.output_text == whole.output_text


def test_a_function_tool_round_trip_through_responses(client):
    tools = [WEATHER]
    asked = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0)
    [call] = [o for o in asked.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and args["city"]
    # streamed, the arguments come as they are generated and join to the same call
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                 tool_choice="required", parallel_tool_calls=False, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        [streamed] = [o for o in stream.get_final_response().output if o.type == "function_call"]
    assert len(deltas) > 1 and "".join(deltas) == streamed.arguments == call.arguments
    assert streamed.name == call.name and streamed.status == "completed"
    answer = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=tools, temperature=0,
                                     max_output_tokens=48, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id, "output": RESULT}])
    assert "22" in answer.output_text


# -- openai-agents ------------------------------------------------------------------------------
def test_an_agent_calls_its_function_tool_and_answers_with_the_result(base_url):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # its default exporter would call OpenAI's servers
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"{RESULT} in {city}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=base_url, api_key=KEY))
    agent = Agent(name="weather", instructions="Answer with the weather tool's result.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                            temperature=0, max_tokens=60))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
    assert seen == ["Paris"]
    assert "22" in result.final_output


# -- langchain-openai ---------------------------------------------------------------------------
def test_langchain_binds_tools_and_returns_structured_output(base_url):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return RESULT

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key=KEY, temperature=0, max_tokens=64, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["args"]["city"]
    city = llm.with_structured_output(City).invoke("Name a famous city in France and its country.")
    assert isinstance(city, City) and city.country == "France"


# -- llama-index-llms-openai-like ----------------------------------------------------------------
def test_llamaindex_chats_and_streams_a_completion(base_url):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    chat = OpenAILike(model=MODEL, api_base=base_url, api_key=KEY, is_chat_model=True, context_window=512,
                      temperature=0, max_tokens=32, max_retries=0)
    reply = chat.chat([ChatMessage(role="user", content="What is the capital of France?")])
    assert "Paris" in reply.message.content
    plain = OpenAILike(model=MODEL, api_base=base_url, api_key=KEY, is_chat_model=False, context_window=512,
                       temperature=0, max_tokens=16, max_retries=0)
    streamed = "".join(r.delta for r in plain.stream_complete("The capital of France is"))
    assert "Paris" in streamed and streamed == plain.complete("The capital of France is").text


# -- instructor ----------------------------------------------------------------------------------
def test_instructor_extracts_a_pydantic_model(base_url):
    import instructor

    extract = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0))
    person = extract.chat.completions.create(
        model=MODEL, response_model=Person, temperature=0, max_tokens=64, max_retries=0,
        messages=[{"role": "user", "content": "Extract the person: John Smith is 31 years old."}])
    assert isinstance(person, Person) and (person.name, person.age) == ("John Smith", 31)
