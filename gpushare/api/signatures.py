"""Anthropic thinking signatures: an HMAC-SHA256 (base64) of a thinking block's text under a key drawn at
random when the daemon starts, so a client that sends a thinking block back (as Claude Code does in tool
loops) can be checked to send what this daemon wrote. A restart draws a new key: blocks signed before it
no longer verify, as Anthropic's signatures do not cross deployments."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

_KEY = secrets.token_bytes(32)


def sign(thinking: str) -> str:
    """The signature of a thinking block's text."""
    return base64.b64encode(hmac.new(_KEY, thinking.encode(), hashlib.sha256).digest()).decode()


def verifies(thinking: str, signature: str) -> bool:
    """Whether ``signature`` is this daemon's signature of ``thinking`` (compared in constant time)."""
    return hmac.compare_digest(sign(thinking), signature)
