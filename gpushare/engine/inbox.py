"""The engine's inbox: what other threads hand the engine thread, one typed item each.

A cancel is the wire's own ``Cancel`` (protocol/messages.py). The other items carry what only this
process has: a Sequence made on the caller's thread (its grammar compiled, its generator seeded),
futures, functions; so they are not wire messages, and are named apart from the wire's ``Submit``
and ``Embed``, which a worker turns into them (engine/worker.py).
"""

import queue
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from gpushare.engine.embed_batch import PendingEmbed
from gpushare.engine.embed_queue import settle
from gpushare.engine.sequence import Sequence
from gpushare.engine.step_outputs import StepOutputs
from gpushare.models.pause_signal import PauseSignal
from gpushare.protocol.messages import Cancel
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.request import EngineFailed

__all__ = ["AddSequence", "Call", "Cancel", "EmbedInputs", "Inbox", "Wake", "handle_item", "refuse"]


class Inbox(queue.Queue):
    """The queue itself: every put also sets ``new_work``, which a running step reads between two layers."""

    def __init__(self):
        super().__init__()
        self.new_work = PauseSignal()

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self.new_work.set()  # after the item is in: the engine clears before it looks


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


def handle_item(engine, item) -> None:
    """On the engine thread: act on one inbox item (engine.Engine._handle fails its request if this raises)."""
    if isinstance(item, AddSequence):
        seq = item.seq
        resident = engine.models.get(seq.model_name)
        if resident is None:
            engine.step_outputs.emit(seq, RequestOutput(seq.request_id, "", [], True, "error",
                                          f"model {seq.model_name!r} was unloaded"))
            return
        engine.requests[seq.request_id] = seq
        if not resident.scheduler.has_work():
            # Idle time is no credit: a model that turns busy starts level with the busy ones.
            busy = [w.virtual_steps for w in engine.models.values() if w.scheduler.has_work()]
            resident.virtual_steps = max(resident.virtual_steps, min(busy, default=0.0))
        resident.scheduler.add(seq)
    elif isinstance(item, Cancel):
        seq = engine.requests.get(item.request_id)
        if seq is not None and seq.model_name in engine.models:
            for answer in [seq, *seq.forks]:  # n > 1: every answer goes
                engine.step_outputs.finish(engine.models[seq.model_name], answer, "abort")
        engine.embeds.cancel(item.request_id)
    elif isinstance(item, EmbedInputs):
        name = item.pending.model_name
        engine.embeds.take(item.pending, name in engine.models or name in engine.encoders)
    elif isinstance(item, Call):
        try:
            item.future.set_result(item.fn())
        except Exception as e:
            item.future.set_exception(e)
