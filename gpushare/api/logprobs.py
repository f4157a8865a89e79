"""Logprobs of generated tokens in each dialect's shape, from the engine's ``TokenLogprobs``."""

from __future__ import annotations

from gpushare.api.errors import bad_request
from gpushare.api.fields import field
from gpushare.catalog.model_head import grammar_vocab
from gpushare.protocol.sampling_params import MAX_LOGPROBS


def requested(body: dict) -> int | None:
    """``logprobs`` (a flag: chat and Ollama) and ``top_logprobs`` -> how many top logprobs (None: off)."""
    on = field(body, "logprobs", "boolean", False)
    top = field(body, "top_logprobs", "integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f'"top_logprobs" must be in [0, {MAX_LOGPROBS}], got {top}', param="top_logprobs")
    if top is not None and not on:
        raise bad_request('"top_logprobs" needs "logprobs": true', param="top_logprobs")
    return (top or 0) if on else None


def completion_requested(body: dict) -> int | None:
    """OpenAI completions' ``logprobs``: how many top logprobs per token (0 for the chosen one only)."""
    top = field(body, "logprobs", "integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f'"logprobs" must be in [0, {MAX_LOGPROBS}], got {top}', param="logprobs")
    return top


class TokenText:
    """Token ids -> (text, bytes) for one model (bytes exact even for part of a UTF-8 character)."""

    def __init__(self, loaded):
        self.vocab = grammar_vocab(loaded)

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.vocab.decode_bytes([token_id])
        return raw.decode("utf-8", errors="replace"), list(raw)

    def entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def entries(self, logprobs, with_top: bool = True) -> list[dict]:
        """OpenAI chat's ``logprobs.content`` items (also Ollama's ``logprobs`` items)."""
        return [{**self.entry(lp.token_id, lp.logprob),
                 "top_logprobs": [self.entry(t, v) for t, v in lp.top] if with_top else []}
                for lp in logprobs or ()]

    def completion(self, logprobs, offset: int) -> dict:
        """OpenAI completions' ``logprobs`` object; ``offset``: characters of text before these tokens."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs or ():
            text, _ = self(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({self(t)[0]: v for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
