"""gpt-oss's channels split into thinking and answer in every dialect, on a tiny random Qwen3 built here.

Its tokenizer is SmolLM2's with six special tokens renamed to harmony's (``<|start|>``, ``<|channel|>``,
``<|message|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``) and a chat template written in gpt-oss's style:
it reads ``reasoning_effort``, shows a past assistant turn's ``thinking`` in its analysis channel and ends
the prompt with ``<|start|>assistant``. A random model never writes the channel markup by itself: a budget
makes the grammar force it (``<|channel|>analysis<|message|>`` first, the close into ``final`` once the budget
is spent), so transformers' greedy tokens with those same tokens put in at those points, decoded segment by
segment, must equal the thinking and the answer each dialect returns.
"""

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
import torch
from arch_models import rename_added_tokens, save_hf_model, update_json
from daemon_fixture import http, serving
from test_thinking import MESSAGES, forced_call_follows_the_thinking

MODEL = "harmonic"
HARMONY = {3: "<|start|>", 4: "<|channel|>", 5: "<|message|>", 6: "<|end|>", 7: "<|return|>", 8: "<|call|>"}
START, CHANNEL, MESSAGE, END, RETURN, CALL = HARMONY
CONTEXT = 2048  # room for "low" (a budget of 1024 thinking tokens)
BUDGET = 6
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{%- endif %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")


def _make_model(folder: str, tokenizer_gguf: str) -> str:
    save_hf_model("qwen3", folder, tokenizer_gguf, seed=3)
    rename_added_tokens(folder, HARMONY, special=True)
    update_json(folder, "tokenizer_config.json", {"chat_template": TEMPLATE})
    update_json(folder, "config.json", {"max_position_embeddings": CONTEXT})
    return folder


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, smollm2_path):
    return _make_model(str(tmp_path_factory.mktemp("harmonic")), smollm2_path)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, model_path):
    models = [{"name": MODEL, "path": model_path, "weights": "float32", "preload": True}]
    # float32 KV: the answers are checked token for token against transformers, and a random model's
    # logits are near ties everywhere, which bfloat16 KV's rounding may tip (the channels are the subject)
    with serving(tmp_path_factory.mktemp("channels"), smollm2_path,
                 {"models": models, "engine": {"kv_dtype": "float32"}}) as d:
        yield d


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def oracle(model_path, tokenizer):
    """transformers' greedy reply to ``messages``: the analysis opened, ``budget`` tokens of thinking, the close
    into the final channel, then the answer to a stop token or ``max_tokens`` in all. Returns the prompt's length
    and the (thinking, answer) token lists."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    opening = [CHANNEL, *tokenizer.encode("analysis"), MESSAGE]
    close = [END, START, *tokenizer.encode("assistant"), CHANNEL, *tokenizer.encode("final"), MESSAGE]

    def generate(max_tokens: int, budget: int, messages=MESSAGES, **variables):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
        ids = tokenizer.encode(text, add_special_tokens=False)
        thinking, answer, out, fed, past, closed = [], [], list(opening), ids + opening, None, False
        with torch.no_grad():
            while len(out) < max_tokens:
                step = model(torch.tensor([fed]), past_key_values=past, use_cache=True)
                past = step.past_key_values
                if len(thinking) == budget and not closed:
                    fed, closed = close, True  # the budget is spent: the grammar forces the close
                else:
                    fed = [int(step.logits[0, -1].argmax())]
                    (answer if closed else thinking).append(fed[0])
                out += fed
        # The grammar holds special tokens out of free text; greedy here must not have wanted one.
        assert not set(thinking + answer) & set(range(17)), "the random model wrote a special token"
        return len(ids), thinking, answer

    return generate


def _texts(tokenizer, thinking: list[int], answer: list[int]) -> tuple[str, str]:
    return tokenizer.decode(thinking), tokenizer.decode(answer)


def test_show_lists_the_thinking_capability(daemon):
    status, shown, _ = http("POST", daemon.url + "/api/show", {"model": MODEL})
    assert status == 200 and "thinking" in shown["capabilities"]


def test_anthropic_thinking_blocks_hold_to_the_budget(daemon, oracle, tokenizer):
    prompt, thinking_ids, answer_ids = oracle(24, BUDGET)
    thinking, answer = _texts(tokenizer, thinking_ids, answer_ids)
    assert len(thinking_ids) == BUDGET and thinking and answer
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, thinking={"type": "enabled", "budget_tokens": BUDGET},
                  extra_body={"temperature": 0})
    r = client.messages.create(**kwargs)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == thinking and r.content[1].text == answer
    assert r.usage.input_tokens == prompt and r.usage.output_tokens == 24
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "text"]


def test_openai_reasoning_content_streamed_and_not(daemon, oracle, tokenizer):
    """``minimal``: 256 tokens of thinking, and ``low`` in the template's reasoning_effort."""
    _, thinking_ids, answer_ids = oracle(272, 256, reasoning_effort="low")
    thinking, answer = _texts(tokenizer, thinking_ids, answer_ids)
    assert answer and (thinking, answer) != _texts(tokenizer, *oracle(272, 256, reasoning_effort="high")[1:])
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=272, temperature=0, reasoning_effort="minimal")
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.reasoning_content == thinking and r.choices[0].message.content == answer
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == thinking
    assert "".join(d.content or "" for d in chunks) == answer


def test_responses_reasoning_item(daemon, oracle, tokenizer):
    _, thinking_ids, answer_ids = oracle(272, 256, reasoning_effort="low")
    thinking, answer = _texts(tokenizer, thinking_ids, answer_ids)
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=272, temperature=0,
                                reasoning={"effort": "minimal"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thinking and r.output_text == answer


def _ndjson(daemon, path: str, body: dict) -> list[dict]:
    status, text, _ = http("POST", daemon.url + path, {**body, "stream": True})
    assert status == 200
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_ollama_chat_and_generate_think_low(daemon, oracle, tokenizer):
    """``low``: the template's reasoning_effort, and 1024 tokens of thinking."""
    _, thinking_ids, answer_ids = oracle(1040, 1024, reasoning_effort="low")
    thinking, answer = _texts(tokenizer, thinking_ids, answer_ids)
    assert answer
    options = {"temperature": 0, "num_predict": 1040}
    chat = {"model": MODEL, "messages": MESSAGES, "think": "low", "options": options}
    # /api/generate renders the prompt as one user message through the same template. The three requests
    # run at once (one batch: 1,040 steps, not 3,120), each answer still transformers' alone.
    generate = {"model": MODEL, "prompt": MESSAGES[0]["content"], "think": "low", "options": options, "stream": False}
    with ThreadPoolExecutor(3) as pool:
        chat_reply = pool.submit(http, "POST", daemon.url + "/api/chat", {**chat, "stream": False})
        streamed = pool.submit(_ndjson, daemon, "/api/chat", chat)
        generated = pool.submit(http, "POST", daemon.url + "/api/generate", generate)
    status, r, _ = chat_reply.result()
    assert status == 200 and r["message"]["thinking"] == thinking and r["message"]["content"] == answer
    lines = streamed.result()
    assert "".join(line["message"].get("thinking", "") for line in lines) == thinking
    assert "".join(line["message"]["content"] for line in lines) == answer
    status, r, _ = generated.result()
    assert status == 200 and r["thinking"] == thinking and r["response"] == answer


def test_ollama_think_false_leaves_gpt_oss_thinking(daemon, oracle, tokenizer):
    """As Ollama answers: gpt-oss cannot stop thinking, so ``think: false`` is a request with thinking on (the
    template's default effort); this random model opens no channel by itself, so all it writes is answer."""
    body = {"model": MODEL, "messages": MESSAGES, "stream": False, "options": {"temperature": 0, "num_predict": 8}}
    status, on, _ = http("POST", daemon.url + "/api/chat", {**body, "think": True})
    status_off, off, _ = http("POST", daemon.url + "/api/chat", {**body, "think": False})
    assert status == status_off == 200 and off["message"] == on["message"]
    assert off["prompt_eval_count"] == oracle(0, 0)[0]
    assert off["message"]["thinking"] == "" and off["message"]["content"] != ""


def test_anthropic_thinking_signatures_round_trip(daemon, oracle, tokenizer):
    """A thinking block is signed (the same signature streamed and not); sent back as written, it is accepted and
    given to the template as the turn's thinking; altered, it is a 400 naming the signature."""
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, thinking={"type": "enabled", "budget_tokens": BUDGET},
                  extra_body={"temperature": 0})
    r = client.messages.create(**kwargs)
    block = r.content[0]
    assert block.type == "thinking" and len(base64.b64decode(block.signature)) == 32
    with client.messages.stream(**kwargs) as stream:
        signed = [e.delta.signature for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "signature_delta"]
    assert signed == [block.signature]
    turn = [{"type": "thinking", "thinking": block.thinking, "signature": block.signature},
            {"type": "text", "text": r.content[1].text}]
    messages = MESSAGES + [{"role": "assistant", "content": turn}, {"role": "user", "content": "And at dusk?"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages,
                                           thinking={"type": "enabled", "budget_tokens": BUDGET})
    rendered = MESSAGES + [{"role": "assistant", "content": r.content[1].text, "thinking": block.thinking},
                           {"role": "user", "content": "And at dusk?"}]
    def count(chat):
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert counted.input_tokens == count(rendered) > count([{**m, "thinking": ""} for m in rendered])
    forged = [{**turn[0], "thinking": block.thinking + " (edited)"}, turn[1]]
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(**{**kwargs, "messages": MESSAGES + [{"role": "assistant", "content": forged},
                                                                    {"role": "user", "content": "And at dusk?"}]})
    assert error.value.body["error"]["type"] == "invalid_request_error"
    assert '"messages[1].content[0].signature"' in error.value.body["error"]["message"]


def test_a_forced_tool_call_starts_in_the_final_channel(daemon):
    forced_call_follows_the_thinking(daemon.url, MODEL, BUDGET)


def test_the_split_is_the_same_however_the_text_is_cut():
    """Streamed a character at a time or whole, a channel reply gives the same thinking and answer, and no
    markup; a reply cut short inside a header shows none of it."""
    from gpushare.api.thinking import ReplyShape, split

    shape = ReplyShape("channels")
    reply = ("<|channel|>analysis<|message|>Rayleigh <scattering> |< <|end|><|start|>assistant<|channel|>final"
             "<|message|>Short waves scatter more.<|return|>")
    assert split(reply, shape) == ("Rayleigh <scattering> |< ", "Short waves scatter more.")
    splitter, pieces = shape.splitter(), []
    for char in reply:
        pieces.append(splitter.feed(char))
    pieces.append(splitter.finish())
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == split(reply, shape)
    assert split("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|chan", shape) == ("hm", "")
