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


def rerank_prompts(tokenizer, pairs: list[tuple[str, str]], max_tokens: int,
                   instruction: str = DEFAULT_INSTRUCTION) -> list[list[int]]:
    """Each (query, document)'s prompt ids as the model card builds it: the instruction, query and
    document tokenised as one text between the fixed prefix and suffix, that text cut at its end to fit
    (the texts in the library's batch calls, which let go of Python's lock)."""
    prefix, suffix = tokenizer.encode(_PREFIX), tokenizer.encode(_SUFFIX)
    room = max(0, max_tokens - len(prefix) - len(suffix))
    contents = tokenizer.encode_texts([f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
                                       for query, document in pairs])
    return [(prefix + content[:room] + suffix)[-max_tokens:] for content in contents]
