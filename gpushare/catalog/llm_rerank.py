"""LLM rerankers that score a yes/no token (Qwen3-Reranker): the prompt their model card gives, and the
score, P("yes") over {"yes", "no"} at the prompt's last token. Torch-free: the supervisor builds prompts.

A Hugging Face folder is one when its README.md is Qwen3-Reranker's (``# Qwen3-Reranker``: how
llama.cpp's convert_hf_to_gguf tells it from a chat model, as config.json says only Qwen3ForCausalLM).
"""

import os

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
           'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def is_llm_reranker_dir(path: str) -> bool:
    readme = os.path.join(path, "README.md")
    return os.path.isfile(readme) and "# Qwen3-Reranker" in open(readme, encoding="utf-8", errors="replace").read()


def yes_no_ids(tokenizer) -> tuple[int, int]:
    yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    if yes is None or no is None:
        raise ValueError('an LLM reranker needs "yes" and "no" as tokens of its vocabulary')
    return yes, no


def rerank_prompt_ids(tokenizer, query: str, document: str, max_tokens: int,
                      instruction: str = DEFAULT_INSTRUCTION) -> tuple[list[int], int]:
    """(the prompt's ids, its length uncut), as the model card builds it: the instruction, query and
    document tokenised as one text between the fixed prefix and suffix, that text cut at its end to fit."""
    prefix, suffix = tokenizer.encode(_PREFIX), tokenizer.encode(_SUFFIX)
    content = tokenizer.encode(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}")
    room = max(0, max_tokens - len(prefix) - len(suffix))
    return (prefix + content[:room] + suffix)[-max_tokens:], len(prefix) + len(content) + len(suffix)
