"""The engine's inbox: what other threads hand the engine thread, one typed item each."""

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from gpushare.engine.embed_batch import PendingEmbed
from gpushare.engine.sequence import Sequence


@dataclass
class Submit:
    seq: Sequence


@dataclass
class Cancel:
    request_id: str


@dataclass
class Embed:
    pending: PendingEmbed


@dataclass
class Call:
    """Run ``fn`` on the engine thread; its result or exception goes to ``future``."""
    fn: Callable
    future: Future


@dataclass
class Wake:
    """Nothing to do: wakes an idle loop (to stop)."""
