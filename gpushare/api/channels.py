"""gpt-oss's channels ("harmony"): which models speak them, the forced close of the analysis, and the split
of a reply into its analysis (the thinking) and the rest (the answer), whole or as it streams.

A reply is ``<|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>
ANSWER<|return|>`` (the prompt ends with ``<|start|>assistant``). The engine keeps the special tokens in the
text of such a reply, so the markup is seen here and dropped: a header (``<|start|>``, the role, ``<|channel|>``
and its name, up to ``<|message|>``) and a body's end (``<|end|>``, ``<|return|>``, ``<|call|>``) never reach
the thinking or the answer. The ``analysis`` channel is the thinking; any other (``final``, ``commentary``) is
answer. A reply that does not open with a header is answer up to its first end marker.
"""

from __future__ import annotations

START, CHANNEL, MESSAGE, END, RETURN, CALL = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
CONSTRAIN = "<|constrain|>"
TOKENS = (START, CHANNEL, MESSAGE, END, RETURN, CALL)  # all in the vocabulary of a model that speaks channels
BODY_ENDS = (END, RETURN, CALL)
MARKERS = TOKENS + (CONSTRAIN,)
THINKING_CHANNEL = "analysis"


def template_speaks(source: str | None) -> bool:
    """Whether a chat template writes gpt-oss's channels."""
    return CHANNEL in (source or "")


def speaks_channels(model, template: str | None = None) -> bool:
    """Whether the model (with ``template`` replacing its own) speaks channels: its template writes them and
    each of the harmony tokens is one token of its vocabulary."""
    return (template_speaks(template or model.template_source)
            and all(model.tokenizer.token_to_id(t) is not None for t in TOKENS))


def _ids(model, *parts: str) -> list[int]:
    """Token ids of marker tokens and plain words, in order."""
    ids = []
    for part in parts:
        token = model.tokenizer.token_to_id(part) if part in TOKENS else None
        ids += [token] if token is not None else model.tokenizer.encode(part)
    return ids


def open_ids(model) -> list[int]:
    """What opens the analysis after the prompt's ``<|start|>assistant``."""
    return _ids(model, CHANNEL, THINKING_CHANNEL, MESSAGE)


def close_ids(model) -> list[int]:
    """What closes the analysis and opens the final answer (forced once a budget is spent)."""
    return _ids(model, END, START, "assistant", CHANNEL, "final", MESSAGE)


def stop_ids(model) -> list[int]:
    """The tokens that end a reply: ``<|return|>`` (the answer is done) and ``<|call|>`` (a tool call)."""
    return _ids(model, RETURN, CALL)


def _partial_marker(text: str) -> int:
    """How many characters at the end of ``text`` could begin a marker."""
    start = text.rfind("<|")
    if start < 0:
        return 1 if text.endswith("<") else 0
    tail = text[start:]
    return len(tail) if any(m.startswith(tail) for m in MARKERS) and tail not in MARKERS else 0


def _channel_of(header: str) -> str:
    """The channel a header names (``<|start|>assistant<|channel|>final`` -> ``final``)."""
    name = header.rpartition(CHANNEL)[2].split(CONSTRAIN)[0].split()
    return name[0] if name else ""


class ChannelSplit:
    """A channel reply split as it streams: ``feed(text)`` and ``finish()`` give ``(thinking, answer)``
    deltas; a marker is held back until it is whole, a header until its ``<|message|>``."""

    def __init__(self):
        self.state = "start"  # then "header" or "body"
        self.channel = ""
        self.held = ""

    def _out(self, text: str) -> tuple[str, str]:
        for marker in MARKERS:  # a stray marker inside a body is markup too
            text = text.replace(marker, "")
        return (text, "") if self.channel == THINKING_CHANNEL else ("", text)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        thinking, answer = "", ""
        while self.held:
            if self.state == "start":
                if self.held.startswith((START, CHANNEL)):
                    self.state = "header"
                elif any(m.startswith(self.held) for m in (START, CHANNEL)):
                    break  # too short to tell yet
                else:
                    self.state = "body"  # no header: an answer (the channel unnamed)
            if self.state == "header":
                header, found, rest = self.held.partition(MESSAGE)
                if not found:
                    break
                self.channel, self.held, self.state = _channel_of(header), rest, "body"
            else:
                piece, ended = self._body()
                thought, said = self._out(piece)
                thinking, answer = thinking + thought, answer + said
                if not ended:
                    break
        return thinking, answer

    def _body(self) -> tuple[str, bool]:
        """The body text now safe to show, and whether the body ended (its end marker dropped)."""
        ends = [(at, m) for at, m in ((self.held.find(m), m) for m in BODY_ENDS) if at >= 0]
        if ends:
            at, marker = min(ends)
            piece, self.held, self.state = self.held[:at], self.held[at + len(marker):], "header"
            return piece, True
        keep = _partial_marker(self.held)
        piece, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return piece, False

    def finish(self) -> tuple[str, str]:
        """The rest: a body cut short is shown; a header cut short is markup, dropped."""
        rest, self.held = self.held, ""
        if self.state == "start":
            return "", rest
        return self._out(rest) if self.state == "body" else ("", "")
