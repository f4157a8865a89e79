"""Constrained decoding with llguidance: a grammar per sequence, token masks applied to its logits.

A request's ``StructuredOutput`` (a JSON Schema, or any JSON object) is compiled into an
``LLMatcher`` on the caller's thread when the sequence is made (``new_matcher``), so a bad schema
fails before the engine sees it. On the engine thread, ``apply_masks`` computes the allowed tokens
of every constrained row of a step at once (llguidance's thread pool, outside the GIL) and sets
the others to -inf; ``advance`` moves a matcher past the sampled token. A step with no constrained
sequence never calls into this module. torch is imported only by the functions that touch logits:
the daemon's supervisor must not load it. The spec a request carries and the schema checks are
protocol/structured_output.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpushare.catalog.model_head import grammar_vocab
from gpushare.protocol.structured_output import SchemaError, StructuredOutput, check_lark, check_schema

if TYPE_CHECKING:  # torch only where masks are applied: the supervisor checks schemas without it
    import llguidance  # imported by the functions that make matchers: a worker that serves none never loads it
    import torch

_executor: llguidance.LLExecutor | None = None


def new_matcher(loaded, structured: StructuredOutput) -> llguidance.LLMatcher:
    import llguidance

    grammar = check_lark(structured.lark) if structured.lark is not None else check_schema(structured.schema())
    matcher = llguidance.LLMatcher(grammar_vocab(loaded), grammar, log_level=0)
    if matcher.is_error():
        raise SchemaError(f"the grammar failed to build: {matcher.get_error()}")
    return matcher


def _executor_for_engine() -> llguidance.LLExecutor:
    global _executor
    import llguidance
    import torch

    if _executor is None:  # the engine thread only; as many workers as the engine's torch threads
        _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _executor


def apply_masks(logits: torch.Tensor, matchers: list) -> list[str | None]:
    """Set every token the row's grammar forbids to -inf, in place; ``matchers[i]`` is row i's
    matcher or None (unconstrained, untouched). Returns per row None, or why it cannot go on."""
    import torch

    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[-1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)  # host: llguidance fills it
    # Imported here: llguidance.torch costs ~190 MB of resident memory, which a process that never
    # runs a constrained step (most engines) should not pay.
    from llguidance.torch import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_executor_for_engine(), [(matchers[r], k) for k, r in enumerate(rows)], bitmask)
    # Unpacked on the logits' device: a 32nd of the bytes crosses over.
    bitmask = bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    with torch.inference_mode():  # the model's logits are inference tensors
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    problems: list[str | None] = [None] * len(matchers)
    empty = (~allowed.any(dim=1)).tolist()
    for k, r in enumerate(rows):
        if matchers[r].is_error() or empty[k]:
            problems[r] = f"the output grammar allows no next token ({matchers[r].get_error() or 'dead end'})"
    return problems


def advance(matcher: llguidance.LLMatcher, token: int) -> None:
    """Move past the sampled token (always one the mask allowed)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the output grammar refused token {token}: {matcher.get_error()}")


def finished(matcher: llguidance.LLMatcher) -> bool:
    """True once the grammar is complete and nothing may follow: the sequence stops there."""
    return matcher.is_stopped()
