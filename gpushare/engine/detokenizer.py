"""Incremental detokenisation and stop checks for one sequence, run after each sampled token."""

from gpushare.engine.sequence import Sequence
from gpushare.catalog.tokenizer import Tokenizer


def append_text(tokenizer: Tokenizer, seq: Sequence) -> None:
    """Extend ``seq.text`` with the newest output token, never ending inside a UTF-8 character.

    Decoding a short window (from ``prefix_offset``) and diffing keeps this O(1) per token, and
    lets byte-level tokens that only form a character together wait for each other.
    """
    ids, skip = seq.output_ids, seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)


def finish_reason(seq: Sequence, token: int, stop_ids: set, context_length: int) -> str | None:
    """Why ``seq`` ends after ``token`` was appended (and text updated), or None to go on.

    A stop string found in the text is cut off with everything after it.
    """
    params = seq.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in stop_ids):
        return "stop"
    if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete; nothing may follow
        return "stop"
    if params.stop:
        # Only the tail can hold a new match: the last token added at most its own characters.
        window = max(len(s) for s in params.stop) + 16
        start = max(0, seq.emitted_chars - window)
        hits = [(i, s) for i, s in ((seq.text.find(s, start), s) for s in params.stop) if i >= 0]
        if hits:
            at, seq.stop_reason = min(hits)
            seq.text = seq.text[:at]
            return "stop"
    if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= context_length:
        return "length"
    return None


def releasable_text(seq: Sequence, finished: bool) -> str:
    """New text safe to show: holds back a tail that could still grow into a stop string."""
    end = len(seq.text)
    if not finished and seq.params.stop:
        hold = max(len(s) for s in seq.params.stop) - 1
        end = max(seq.emitted_chars, end - hold)
    new = seq.text[seq.emitted_chars:end]
    seq.emitted_chars = end
    return new
