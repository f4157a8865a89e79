"""Thinking split from the answer in every dialect, on a tiny random Qwen3 built here with transformers.

Its tokenizer is SmolLM2's with two tokens renamed ``<think>`` and ``</think>`` (added, not special,
as in Qwen3's), and its chat template opens ``<think>`` in the prompt as the DeepSeek-R1 distills'
do, or (``enable_thinking`` false) closes an empty one, as Qwen3's does. A random model never
closes its thinking by itself: a budget closes it (the grammar forces ``</think>`` once the budget
is spent), so what transformers generates greedily with ``</think>`` put in at that point, split
there, must equal the thinking and the answer each dialect returns.
"""


import anthropic
import openai
import pytest
import torch
from arch_models import rename_added_tokens, save_hf_model, update_json
from daemon_fixture import http, serving

THINKER = "thinker"
CLOSE_ID = 9  # the renamed token
STOPS = [0, 2]  # <|endoftext|>, <|im_end|>
BUDGET = 6
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif -%}{%- endif %}")


def _make_thinker(folder: str, tokenizer_gguf: str) -> str:
    save_hf_model("qwen3", folder, tokenizer_gguf, seed=3)
    rename_added_tokens(folder, {8: "<think>", CLOSE_ID: "</think>"}, special=False)
    update_json(folder, "tokenizer_config.json", {"chat_template": TEMPLATE})
    return folder


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, smollm2_path):
    return _make_thinker(str(tmp_path_factory.mktemp("thinker")), smollm2_path)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, thinker):
    models = [{"name": THINKER, "path": thinker, "weights": "float32", "preload": True}]
    with serving(tmp_path_factory.mktemp("thinking"), smollm2_path, {"models": models}) as d:
        yield d


@pytest.fixture(scope="module")
def oracle(thinker):
    """transformers' greedy tokens for a chat, ``</think>`` put in after ``budget`` tokens of thinking."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(thinker, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(thinker)

    def generate(max_tokens: int, budget: int | None = None, enable_thinking: bool | None = None):
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **extra)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt, out = len(ids), []
        with torch.no_grad():
            while len(out) < max_tokens:
                if budget is not None and len(out) == budget and CLOSE_ID not in out:
                    token = CLOSE_ID
                else:
                    token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                if token in STOPS:
                    break
                out.append(token)
                ids.append(token)
        return prompt, out, tokenizer

    return generate


def _split(tokenizer, out: list[int]) -> tuple[str, str]:
    text = tokenizer.decode(out, skip_special_tokens=True)
    thinking, _, answer = text.partition("</think>")
    return thinking.lstrip(), answer.lstrip()


def test_show_lists_the_thinking_capability(daemon):
    status, shown, _ = http("POST", daemon.url + "/api/show", {"model": THINKER})
    assert status == 200 and "thinking" in shown["capabilities"]


def test_anthropic_thinking_block_holds_to_its_budget(daemon, oracle):
    prompt, out, tokenizer = oracle(16, BUDGET)
    assert out[BUDGET] == CLOSE_ID and CLOSE_ID not in out[:BUDGET]  # the budget, not the model, closed it
    thinking, answer = _split(tokenizer, out)
    assert thinking and answer
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=THINKER, messages=MESSAGES, max_tokens=16, thinking={"type": "enabled", "budget_tokens": BUDGET},
                  extra_body={"temperature": 0})
    r = client.messages.create(**kwargs)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == thinking and r.content[1].text == answer
    assert r.usage.input_tokens == prompt and r.usage.output_tokens == len(out)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]


def test_openai_reasoning_content_and_thinking_off(daemon, oracle):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    _, out, tokenizer = oracle(10)
    assert CLOSE_ID not in out
    r = client.chat.completions.create(model=THINKER, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.choices[0].message.reasoning_content == _split(tokenizer, out)[0] and r.choices[0].message.content == ""
    chunks = list(client.chat.completions.create(model=THINKER, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == _split(tokenizer, out)[0]
    prompt, plain, _ = oracle(10, enable_thinking=False)
    off = client.chat.completions.create(model=THINKER, messages=MESSAGES, max_tokens=10, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == tokenizer.decode(plain, skip_special_tokens=True)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None and off.usage.prompt_tokens == prompt


def test_openai_reasoning_effort_is_a_budget(daemon, oracle):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    _, out, tokenizer = oracle(262, 256)  # "minimal": 256 tokens of thinking
    assert out[256] == CLOSE_ID and CLOSE_ID not in out[:256]
    thinking, answer = _split(tokenizer, out)
    r = client.chat.completions.create(model=THINKER, messages=MESSAGES, max_tokens=262, temperature=0,
                                       reasoning_effort="minimal")
    assert r.choices[0].message.reasoning_content == thinking and r.choices[0].message.content == answer != ""


def test_ollama_think_true_and_false(daemon, oracle):
    _, out, tokenizer = oracle(10)
    body = {"model": THINKER, "messages": MESSAGES, "stream": False, "options": {"temperature": 0, "num_predict": 10}}
    status, r, _ = http("POST", daemon.url + "/api/chat", {**body, "think": True})
    assert status == 200 and r["message"]["thinking"] == _split(tokenizer, out)[0] and r["message"]["content"] == ""
    _, plain, _ = oracle(10, enable_thinking=False)
    status, r, _ = http("POST", daemon.url + "/api/chat", {**body, "think": False})
    assert status == 200 and r["message"]["content"] == tokenizer.decode(plain, skip_special_tokens=True)
    assert "thinking" not in r["message"]


def test_responses_reasoning_item_then_json_after_the_thinking(daemon, oracle):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    _, out, tokenizer = oracle(10)
    r = client.responses.create(model=THINKER, input=MESSAGES[0]["content"], max_output_tokens=10, temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == _split(tokenizer, out)[0] and r.output_text == ""


def forced_call_follows_the_thinking(url: str, model: str, budget: int) -> None:
    """A forced tool call after thinking of ``budget`` tokens: a tool_use block with schema-valid input, and the
    same thinking as when the model is left to choose (the grammar holds only what follows the thinking; a random
    model left to choose never writes a call)."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=60, extra_body={"temperature": 0},
                  thinking={"type": "enabled", "budget_tokens": budget}, tools=[{"name": "answer", "input_schema": schema}])
    forced = client.messages.create(**kwargs, tool_choice={"type": "any"})
    assert [b.type for b in forced.content] == ["thinking", "tool_use"] and forced.stop_reason == "tool_use"
    assert forced.content[1].name == "answer" and forced.content[1].input in ({"ok": True}, {"ok": False})
    free = client.messages.create(**kwargs, tool_choice={"type": "auto"})
    assert [b.type for b in free.content] == ["thinking", "text"]
    assert forced.content[0].thinking == free.content[0].thinking != ""


def test_a_forced_tool_call_starts_where_the_thinking_ends(daemon):
    forced_call_follows_the_thinking(daemon.url, THINKER, BUDGET)
