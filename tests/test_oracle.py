"""Our model and engine against transformers, the oracle, on the real SmolLM2 GGUF."""

import torch

from gpushare import SamplingParams

PROMPTS = [
    "Tell me about the history of Paris.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "What are the primary colors, and how do they mix?",
    "Describe a cat to someone who has never seen one.",
]
NEW_TOKENS = 24


def conversations():
    return [[{"role": "user", "content": p}] for p in PROMPTS]


def oracle_answers(hf_model, llm) -> list[list[int]]:
    """transformers' greedy continuation of each chat prompt (one at a time, no padding)."""
    model, tokenizer = hf_model
    results = []
    for conv in conversations():
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        ours = llm.tokenizer.encode(llm.model.render_chat(conv))
        assert ours == list(ids), "our tokenizer and chat template disagree with transformers"
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        new = out[0, len(ids):].tolist()
        assert len(new) == NEW_TOKENS, f"pick a prompt with a longer answer than {len(new)} tokens: {conv}"
        results.append(new)
    return results


def greedy():
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def test_chat_matches_transformers_one_at_a_time(llm, oracle_outputs):
    for prompt, conv, expected in zip(PROMPTS, conversations(), oracle_outputs):
        [out] = llm.chat([conv], greedy())
        assert out.token_ids == expected, prompt


def test_chat_matches_transformers_all_in_one_call(llm, oracle_outputs):
    outs = llm.chat(conversations(), greedy())
    assert [o.token_ids for o in outs] == oracle_outputs
    assert all(o.finish_reason == "length" for o in outs)


def test_last_position_logits_agree(llm, hf_model):
    model, tokenizer = hf_model
    conv = conversations()[0]
    ids = llm.tokenizer.encode(llm.model.render_chat(conv))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
    pool = llm.engine.models[llm.model_name].scheduler.pool
    runner = llm.engine.models[llm.model_name].runner
    from gpushare.engine.sequence import Sequence

    seq = Sequence("logits-check", llm.model_name, ids, greedy(), lambda out: None)
    assert pool.grow(seq.block_table, len(ids)) is None
    try:
        hidden, last = runner.hidden_states([seq], [len(ids)])
        ours = llm.model.model.logits(hidden[last[0]])
    finally:
        pool.release(seq.block_table)
    rel = (ours - expected).abs().max() / expected.abs().max()
    assert rel < 1e-3, f"relative logit error {rel:.2e}"
