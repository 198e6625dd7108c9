"""Chat through /v1/chat/completions for each model family's prompt format: Gemma's turns
(no system role in Gemma 2, folded into the first turn in Gemma 3), Qwen3's ChatML with
thinking and native tools, Phi-3's role tags and Granite's roles with its own call tag.

The templates are written here in each family's format, each on a tiny random checkpoint
of that architecture whose tokenizer carries the family's special tokens, and each model
ends a turn on a token only its generation_config.json names, as the real ones do."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.arch_models import build

GEMMA2 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA3 = (
    "{{ bos_token }}{% set ns = namespace(lead='') %}{% if messages[0]['role'] == 'system' %}"
    "{% set ns.lead = messages[0]['content'] + '\n\n' %}{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (ns.lead if loop.first else '') + m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
QWEN3 = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}You may call these functions:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> to call one.<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>\n{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GRANITE = (
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|end_of_text|>\n{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n"
    "{% else %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}<|tool_call|>{{ m['tool_calls'] | map(attribute='function') | list | tojson }}"
    "{% endif %}<|end_of_text|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")


@dataclass(frozen=True)
class Family:
    arch: str
    template: str
    end: str  # the token that ends an assistant turn, named only by generation_config.json
    special: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()  # added tokens that decode as text (Qwen's tags)
    system: bool = True
    eos: str | None = None  # the tokenizer's and config's own end of text, when it is not SmolLM2's


FAMILIES = {
    "gemma2": Family("gemma2", GEMMA2, "<end_of_turn>", ("<start_of_turn>", "<end_of_turn>"), system=False),
    "gemma3": Family("gemma3_text", GEMMA3, "<end_of_turn>", ("<start_of_turn>", "<end_of_turn>")),
    "qwen3": Family("qwen3", QWEN3, "<|im_end|>", plain=("<think>", "</think>", "<tool_call>", "</tool_call>"),
                    eos="<|endoftext|>"),
    "phi3": Family("phi3", PHI3, "<|end|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
    "granite": Family("granite", GRANITE, "<|end_of_text|>",
                      ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _model(name: str, root: Path, tokenizer_dir: Path) -> tuple[Path, int]:
    """The family's tiny checkpoint, and the id of its end-of-turn token."""
    from transformers import AutoTokenizer

    fam = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(list(fam.special), special_tokens=True)
    tok.add_tokens(list(fam.plain))
    if fam.eos is not None:
        tok.eos_token = fam.eos
    tok.chat_template = fam.template
    tok.save_pretrained(root / "tokenizer")
    path = build(fam.arch, root / "model", root / "tokenizer", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    end = tok.convert_tokens_to_ids(fam.end)
    assert end != tok.eos_token_id  # only generation_config names it
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                             "eos_token_id": [tok.eos_token_id, end]}))
    return path, end


@pytest.fixture(scope="module")
def family(tmp_path_factory, default_model_dir):
    """name -> (test client, model path, end-of-turn id), each built on first use."""
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing

    made, llms = {}, []

    def get(name: str):
        if name not in made:
            path, end = _model(name, tmp_path_factory.mktemp(name), default_model_dir)
            cfg = EngineConfig.create(model=str(path), device="cpu", dtype="float32", max_model_len=256,
                                      kv_cache_memory_bytes=64 * 8192)
            llm = AsyncLLM(LLMEngine(cfg))
            llms.append(llm)
            serving = OpenAIServing(llm, name)
            made[name] = (TestClient(create_app(lambda s=serving: s)).__enter__(), path, end, serving)
        return made[name][:3]

    get.serving = lambda name: made[name][3]
    yield get
    for tc, *_ in made.values():
        tc.__exit__(None, None, None)
    for llm in llms:
        llm.shutdown()


def _messages(name: str) -> list[dict]:
    first = [{"role": "system", "content": "You answer briefly."}] if FAMILIES[name].system else []
    return first + [{"role": "user", "content": "Where is the Eiffel Tower?"},
                    {"role": "assistant", "content": "In Paris."},
                    {"role": "user", "content": "And how tall is it?"}]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_chats_as_transformers_renders_and_generates(family, name):
    """The prompt is the family template's rendering, the greedy answer is transformers'
    generate on it, and the family's end-of-turn token ends the answer as a stop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tc, path, end = family(name)
    tok = AutoTokenizer.from_pretrained(path)
    messages = _messages(name)
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tc.post("/tokenize", json={"messages": messages}).json()["tokens"] == want

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([want]), attention_mask=torch.ones(1, len(want), dtype=torch.long),
                         max_new_tokens=10, do_sample=False)[0, len(want):].tolist()
    body = {"messages": messages, "max_tokens": 10, "temperature": 0}
    choice = tc.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == tok.decode(out, skip_special_tokens=True)

    ended = tc.post("/v1/chat/completions", json={**body, "logit_bias": {str(end): 100}}).json()
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["choices"][0]["message"]["content"] == "" and ended["usage"]["completion_tokens"] == 1


def test_gemma2s_template_refusing_a_system_turn_is_a_400_naming_messages(family):
    tc, _, _ = family("gemma2")
    r = tc.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "System role not supported" in err["message"]
    assert tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 4}).status_code == 200


def test_qwen3_thinks_or_not_by_template_kwargs_and_calls_tools_as_hermes(family):
    tc, path, _ = family("qwen3")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    think = tc.post("/tokenize", json={"messages": ask}).json()["tokens"]
    plain = tc.post("/tokenize", json={"messages": ask, "chat_template_kwargs": {"enable_thinking": False}}
                    ).json()["tokens"]
    from transformers import AutoTokenizer

    assert plain[:len(think)] == think and AutoTokenizer.from_pretrained(path).decode(
        plain[len(think):]) == "<think>\n\n</think>\n\n"

    choice = tc.post("/v1/chat/completions", json={"messages": ask, "tools": [WEATHER], "tool_choice": FORCED,
                                                   "max_tokens": 100, "temperature": 0}).json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "tool_calls"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("stream", [False, True])
def test_granite_calls_are_served_in_its_format_and_its_history_renders(family, stream):
    tc, path, _ = family("granite")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"messages": ask, "tools": [WEATHER], "tool_choice": FORCED, "max_tokens": 100, "temperature": 0}
    if stream:
        lines = tc.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
        deltas = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
        parts = [d for c in deltas for d in c["delta"].get("tool_calls") or []]
        name = parts[0]["function"]["name"]
        args = "".join(d["function"].get("arguments", "") for d in parts)
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert not "".join(c["delta"].get("content") or "" for c in deltas)
    else:
        choice = tc.post("/v1/chat/completions", json=body).json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        name, args = call["function"]["name"], call["function"]["arguments"]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert name == "get_weather" and json.loads(args)["city"] in ("Paris", "Rome")

    history = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(path).decode(
        tc.post("/tokenize", json={"messages": history, "tools": [WEATHER]}).json()["tokens"])
    assert '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text
    assert "<|start_of_role|>tool_response<|end_of_role|>18 C, clear" in text
    assert text.startswith("<|start_of_role|>available_tools<|end_of_role|>")


def test_a_call_tag_that_is_a_special_token_reaches_the_parser(family):
    """Granite writes <|tool_call|> as one special token, which the default
    skip_special_tokens drops from the text, leaving its calls as plain content. A chat
    with tools decodes special tokens unless the request said otherwise."""
    from engine.detokenizer import Detokenizer
    from engine.sampling_params import SamplingParams
    from engine.serving.openai.protocol import ChatCompletionRequest, Tool
    from engine.serving.tools.calls import Splitter

    _, path, _ = family("granite")
    serving = family.serving("granite")
    tok, tools = serving._tok, [Tool.model_validate(WEATHER)]
    written = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    ids = tok.encode(written, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|tool_call|>")

    def served(req: ChatCompletionRequest) -> tuple[str, list]:
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=not serving.keeps_special_tokens(req, tools))
        detok = Detokenizer(tok, [1], params)
        text = "".join(detok.update([t]) for t in ids) + detok.flush()
        _, content, calls = Splitter(tools, serving.tool_format).whole(text)
        return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]

    ask = [{"role": "user", "content": "Weather in Paris?"}]
    assert serving.tool_format == "granite"
    assert served(ChatCompletionRequest(messages=ask, tools=[WEATHER])) == ("", [("get_weather", {"city": "Paris"})])
    content, calls = served(ChatCompletionRequest(messages=ask, tools=[WEATHER], skip_special_tokens=True))
    assert calls == [] and content.startswith("[{")  # the client asked for the tag to go
    assert not serving.keeps_special_tokens(ChatCompletionRequest(messages=ask), [])
