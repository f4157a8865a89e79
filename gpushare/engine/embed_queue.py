"""The engine's waiting embed requests: taken in first come first served, run a batch per loop turn
(embed_batch.py), settled, cancelled or failed. Touched only on the engine thread.

While streams generate, a turn's embedding work is sized by time, not only by tokens: it may take
at most ``SHARE_OF_STEP`` of the latest generation step, from each model's measured seconds per
embedded token (4,000 inputs of a 22M-parameter encoder in 2,048-token batches took 0.65 s a batch
on 2 cores, fifty times a 13 ms decode step). An encoder batch is also split by layers: a turn runs
as many of its layers as fit, so even one input, whose pass costs about a decode step of a small
chat model (one MiniLM input: 4.5 ms beside a 4.9 ms SmolLM2 step), adds only part of a pass to a
stream's gap. With no stream generating, a batch takes what fits ``IDLE_BATCH_S`` (at most
``max_num_batched_tokens``) and runs whole: a chat that arrives meanwhile waits that long at most, not a
2,048-token pass (~350 ms of all-MiniLM on 2 cores), and no idle batch's layers are left to run in the
gaps of the stream that chat then starts.
"""

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from gpushare.engine.embed_batch import (EncoderBatch, PendingEmbed, ResidentEncoder, advance_encoder, run_decoder,
                                         start_encoder, take_batch)
from gpushare.engine.resident_model import ResidentModel
from gpushare.protocol.request import KVCacheBusy

log = logging.getLogger(__name__)

# A quarter: beside a 4,000-input flood half a step measured 2.1-2.9x a stream's ITL p99 alone, a
# quarter 1.6-1.9x while batches ran whole (a one-input pass is longer than a quarter step).
SHARE_OF_STEP = 0.25
FIRST_BATCH_TOKENS = 64  # beside generation, before a model's cost per token is measured
IDLE_BATCH_S = 0.1  # a batch with no stream generating: what a request arriving meanwhile may wait


def budget_tokens(max_tokens: int, step_s: float | None, per_token_s: float | None, turns: int = 1) -> int:
    """A batch's token budget, at the model's measured cost per token, at most ``max_tokens``: with no
    stream generating (``step_s`` None) what fits IDLE_BATCH_S (``max_tokens`` while unmeasured), else
    what fits SHARE_OF_STEP of their latest step, ``turns`` times (an encoder's batch may spread over a
    turn per layer; FIRST_BATCH_TOKENS while unmeasured); at least 1, so the inputs always move on."""
    if per_token_s is None:
        return max_tokens if step_s is None else min(max_tokens, FIRST_BATCH_TOKENS)
    turn_s = IDLE_BATCH_S if step_s is None else SHARE_OF_STEP * step_s * turns
    return max(1, min(max_tokens, int(turn_s / per_token_s)))


def layers_this_turn(layers: int, tokens: int, step_s: float | None, per_token_s: float | None) -> int:
    """How many layers of an encoder batch (``layers`` deep, ``tokens`` padded) run this turn: all with
    no stream generating, else those that fit SHARE_OF_STEP of the step at the model's measured cost
    per token (one while unmeasured); at least one."""
    if step_s is None:
        return layers
    if per_token_s is None:
        return 1
    return max(1, int(SHARE_OF_STEP * step_s * layers / (per_token_s * tokens)))


def step_seconds(models: dict[str, ResidentModel]) -> float | None:
    """The latest step of the models with streams generating or waiting to start; None when none has any.
    Waiting ones count: a chat that arrives while an encoder batch is in flight gets its first token after
    a slice of that batch, not after the rest of it (with IDLE_BATCH_S, a chat's first token during a
    4,000-input flood came 26 ms after the previous chat's last, p50, against 504 ms before)."""
    return max((m.last_step_s for m in models.values() if m.scheduler.running or m.scheduler.waiting),
               default=None)


def batch_tokens(taken: list[tuple[PendingEmbed, int]]) -> int:
    """The tokens a decoder's batch computes, its inputs' lengths summed (an encoder's padded batch
    counts its own: EncoderBatch.tokens)."""
    return sum(len(ids) for item, n in taken for ids in item.inputs[len(item.results):len(item.results) + n])


@dataclass
class EmbedQueue:
    pending: list[PendingEmbed] = field(default_factory=list)
    # Per (model, whether streams generate), measured on its batches: batches beside streams are sized and
    # counted apart from idle ones. An idle batch of 2,048 tokens costs far less a token than the few inputs
    # a quarter step holds: sized by the idle cost, the first batch beside a stream took 8-11 ms a layer
    # against 2 ms wanted (a 7.6 ms SmolLM2 step, all-MiniLM), six turns of 15-20 ms gaps for the stream.
    seconds_per_token: dict[tuple[str, bool], float] = field(default_factory=dict)
    in_flight: EncoderBatch | None = None  # an encoder batch that has layers left to run

    def take(self, item: PendingEmbed, loaded: bool) -> None:
        """Queue ``item``; ``loaded``: whether its model is loaded here (if not, it fails at once)."""
        if not loaded:
            settle(item.future, error=KeyError(f"model {item.model_name!r} is not loaded"))
        elif not item.inputs:
            settle(item.future, result=[])
        else:
            self.pending.append(item)

    def run_batch(self, models: dict[str, ResidentModel], encoders: dict[str, ResidentEncoder],
                  max_tokens: int) -> None:
        """This turn's embedding work: more layers of the encoder batch in flight, or one new batch of the
        first waiting request's model, at most ``max_tokens`` tokens and, while streams generate, at most
        SHARE_OF_STEP of their step's time (always at least one input, one layer)."""
        self.pending = [p for p in self.pending if not p.future.done()]  # cancelled: its client left
        if self.in_flight is not None:
            self._advance(models)
            return
        if not self.pending:
            return
        name = self.pending[0].model_name
        encoder, resident = encoders.get(name), models.get(name)
        step_s = step_seconds(models)
        key = (name, step_s is not None)
        turns = len(encoder.loaded.model.layers) if encoder is not None else 1
        budget = budget_tokens(max_tokens, step_s, self.seconds_per_token.get(key), turns)
        taken = take_batch(self.pending, budget, padded=encoder is not None)
        tokens, start_s = batch_tokens(taken), time.perf_counter()  # before results move them on
        try:
            if encoder is not None:
                self.in_flight = start_encoder(encoder, taken)
                self.in_flight.spent_s = time.perf_counter() - start_s
                self.in_flight.beside_streams = step_s is not None
                self._advance(models)
                return
            run_decoder(resident.scheduler, resident.runner, taken)
        except Exception as e:  # the batch's requests fail, never the engine
            self._fail_batch(name, taken, e)
            return
        self.seconds_per_token[key] = (time.perf_counter() - start_s) / tokens
        self._settle_done(taken)

    def _advance(self, models: dict[str, ResidentModel]) -> None:
        batch = self.in_flight
        name = batch.worker.name
        if all(item.future.done() for item, _ in batch.taken):  # every client left: nothing to finish
            self.in_flight = None
            return
        step_s = step_seconds(models)
        layers = layers_this_turn(len(batch.worker.loaded.model.layers), batch.tokens, step_s,
                                  self.seconds_per_token.get((name, step_s is not None)))
        start_s = time.perf_counter()
        try:
            done = advance_encoder(batch, layers)
        except Exception as e:
            self.in_flight = None
            self._fail_batch(name, batch.taken, e)
            return
        batch.spent_s += time.perf_counter() - start_s
        if done:
            self.in_flight = None
            self.seconds_per_token[name, batch.beside_streams] = batch.spent_s / batch.tokens
            self._settle_done(batch.taken)

    def _settle_done(self, taken: list[tuple[PendingEmbed, int]]) -> None:
        for item, _ in taken:
            if item.remaining == 0 and item in self.pending:
                self.pending.remove(item)
                settle(item.future, result=item.answer())

    def _fail_batch(self, name: str, taken: list[tuple[PendingEmbed, int]], error: Exception) -> None:
        if not isinstance(error, KVCacheBusy):
            log.error("engine: an embedding batch failed for model %s", name, exc_info=error)
        for item, _ in taken:
            if item in self.pending:
                self.pending.remove(item)
            settle(item.future, error=error)

    def cancel(self, request_id: str) -> None:
        for item in [p for p in self.pending if p.request_id == request_id]:
            self.pending.remove(item)
            item.future.cancel()

    def fail(self, error: Exception, model_name: str | None = None) -> None:
        """Fail the waiting requests of ``model_name`` (None: all of them) with ``error``."""
        if self.in_flight is not None and model_name in (None, self.in_flight.worker.name):
            self.in_flight = None
        for item in [p for p in self.pending if model_name is None or p.model_name == model_name]:
            self.pending.remove(item)
            settle(item.future, error=error)


def settle(future: Future, result=None, error: Exception | None = None) -> None:
    """Answer a future that its caller may have cancelled meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
