"""A tool call streamed as it is generated, as vLLM streams one: its name first, then its arguments.

A reply written as the fallback call object ``{"name": "...", "arguments": {...}}`` (the form a
forced tool_choice's grammar holds the output to) is recognised once its name is complete and
names one of the request's tools; from then on each piece of the ``arguments`` object goes out as
it comes, scanned for the end of that object (strings and escapes followed) so that the outer
object's closing brace is not sent. Other forms (several calls, ``<tool_call>`` tags) are not
recognised here: they are sent whole at the end (api/tools.ReplyFilter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpushare.api.tools import ToolSpec

CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
MAX_HEAD_CHARS = 512  # past this without a recognised head the reply is not streamed as a call


@dataclass
class StreamedCall:
    """The call being streamed: what has been sent of it."""
    name: str
    arguments: str = ""
    done: bool = False  # the arguments object has closed


@dataclass
class CallStream:
    """``feed(text)`` -> (the call, if it was recognised just now, the new piece of its arguments)."""
    spec: ToolSpec
    held: str = ""
    call: StreamedCall | None = None
    given_up: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> tuple[StreamedCall | None, str]:
        if self.given_up or not self.spec.active:
            return None, ""
        if self.call is None:
            self.held += text
            head = CALL_HEAD.match(self.held)
            if head is None:
                self.given_up = len(self.held) > MAX_HEAD_CHARS or not _may_become_head(self.held)
                return None, ""
            if head.group(1) not in self.spec.names():
                self.given_up = True
                return None, ""
            self.call = StreamedCall(head.group(1))
            piece = self._arguments(self.held[head.end():])
            return self.call, piece
        return None, self._arguments(text)

    def _arguments(self, text: str) -> str:
        """The part of ``text`` inside the arguments object (up to the brace that closes it)."""
        if self.call.done:
            return ""
        for k, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.call.done = True
                    piece = text[:k + 1]
                    self.call.arguments += piece
                    return piece
        self.call.arguments += text
        return text


def _may_become_head(text: str) -> bool:
    """Whether more text could still make ``text`` a call head (a prefix of one)."""
    template = '{"name":"'
    compact = re.sub(r"\s+", "", text)
    if len(compact) < len(template):
        return template.startswith(compact)
    return compact.startswith(template)
