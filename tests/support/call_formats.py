"""Tool-call texts in each format the server parses (Hermes, Llama-3 JSON, Mistral,
Granite, Command R, pythonic, Qwen3-Coder's and GLM-4.5's tagged text), with the content and
calls each must give: the parsers' unit tests and the served round trips check the same
cases."""

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
    # Tagged text: a string parameter keeps its text (a number-looking city too), an integer
    # one is read as JSON; one newline either side of a Qwen value is layout.
    ("qwen3_xml", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                  "</function>\n</tool_call>", "Let me check.\n", [PARIS, ("get_time", {})]),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n</function>\n"
                  "</tool_call>", "", [("get_weather", {"city": "1984"})]),
    ("qwen3_xml", "<tool_call>\n<function=launch>\n</function>\n</tool_call>",
     "<tool_call>\n<function=launch>\n</function>\n</tool_call>", []),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>Paris", 
     "<tool_call>\n<function=get_weather>\n<parameter=city>Paris", []),
    ("glm45", "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "Checking.", [PARIS]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
              "<tool_call>get_time\n</tool_call>", "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key> stray <arg_value>Paris</arg_value>\n</tool_call>",
     "<tool_call>get_weather\n<arg_key>city</arg_key> stray <arg_value>Paris</arg_value>\n</tool_call>", []),
]

def split_calls(text: str, tools: list[Tool], fmt: str) -> tuple[str, list]:
    """A whole output's content and calls."""
    _, content, calls = Splitter(tools, fmt).whole(text)
    return content, calls
