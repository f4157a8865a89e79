"""The engine's inbox: what other threads hand the engine thread, one typed item each.

A cancel is the wire's own ``Cancel`` (protocol/messages.py). The other items carry what only this
process has: a Sequence made on the caller's thread (its grammar compiled, its generator seeded),
futures, functions; so they are not wire messages, and are named apart from the wire's ``Submit``
and ``Embed``, which a worker turns into them (engine/worker.py).
"""

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from gpushare.engine.embed_batch import PendingEmbed
from gpushare.engine.embed_queue import settle
from gpushare.engine.sequence import Sequence
from gpushare.engine.step_outputs import StepOutputs
from gpushare.protocol.messages import Cancel
from gpushare.protocol.request import EngineFailed

__all__ = ["AddSequence", "Call", "Cancel", "EmbedInputs", "Wake", "refuse"]


@dataclass
class AddSequence:
    seq: Sequence


@dataclass
class EmbedInputs:
    """An embed request taken in: its inputs, results so far and future (engine/embed_batch.py)."""
    pending: PendingEmbed


@dataclass
class Call:
    """Run ``fn`` on the engine thread; its result or exception goes to ``future``."""
    fn: Callable
    future: Future


@dataclass
class Wake:
    """Nothing to do: wakes an idle loop (to stop)."""


def refuse(item, reason: str, step_outputs: StepOutputs) -> None:
    """Answer an inbox item that will not be handled: its request ends with ``reason``."""
    if isinstance(item, AddSequence):
        step_outputs.fail(item.seq, reason)
    elif isinstance(item, EmbedInputs):
        settle(item.pending.future, error=EngineFailed(reason))
    elif isinstance(item, Call) and not item.future.done():
        item.future.set_exception(EngineFailed(reason))
