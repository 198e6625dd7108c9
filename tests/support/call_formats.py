"""Tool-call texts in each format the server parses (Hermes, Llama-3 JSON, Mistral,
Granite, Command R, pythonic), with the content and calls each must give: the parsers' unit tests
and the served round trips check the same cases."""

from __future__ import annotations

from engine.serving.openai.protocol import Tool
from engine.serving.tools.calls import Splitter

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]

PARIS = ("get_weather", {"city": "Paris", "days": 2})

CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "", [PARIS]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {}}', "", [PARIS, ("get_time", {})]),
    ("llama3_json", 'The weather is {"sunny"}.', 'The weather is {"sunny"}.', []),
    ("llama3_json", '{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     "Let me check.", [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}', "",
     [PARIS, ("get_time", {})]),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ("granite", 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {}}]', "Checking.", [PARIS, ("get_time", {})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', "", [PARIS]),
    ("granite", "<|tool_call|>[{'name': 'x'}]", "<|tool_call|>[{'name': 'x'}]", []),
    ("command_r", 'I will look.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                  '"parameters": {"city": "Paris", "days": 2}},\n{"tool_call_id": "1", "tool_name": "get_time", '
                  '"parameters": {}}]<|END_ACTION|>', "I will look.", [PARIS, ("get_time", {})]),
    ("command_r", '<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]'
                  '<|END_ACTION|>', "", [PARIS]),
    ("command_r", '<|START_ACTION|>[{"tool_name": "launch", "parameters": {}}]<|END_ACTION|>',
     '<|START_ACTION|>[{"tool_name": "launch", "parameters": {}}]<|END_ACTION|>', []),
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]', "", [PARIS, ("get_time", {})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),
    ("pythonic", "No calls here.", "No calls here.", []),
]

def split_calls(text: str, tools: list[Tool], fmt: str) -> tuple[str, list]:
    """A whole output's content and calls."""
    _, content, calls = Splitter(tools, fmt).whole(text)
    return content, calls
