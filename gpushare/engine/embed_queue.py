"""The engine's waiting embed requests: taken in first come first served, run a batch per loop turn
(embed_batch.py), settled, cancelled or failed. Touched only on the engine thread.

While streams generate, a batch is sized by time, not only by tokens: it may take at most
``SHARE_OF_STEP`` of the latest generation step, from each model's measured seconds per embedded token
(4,000 inputs of a 22M-parameter encoder in 2,048-token batches took 0.65 s a batch on 2 cores, fifty
times a 13 ms decode step). With no stream generating, batches fill ``max_num_batched_tokens``.
"""

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from gpushare.engine.embed_batch import PendingEmbed, ResidentEncoder, run_decoder, run_encoder, take_batch
from gpushare.engine.resident_model import ResidentModel
from gpushare.protocol.request import KVCacheBusy

log = logging.getLogger(__name__)

# A quarter: beside a 4,000-input flood half a step measured 2.1-2.9x a stream's ITL p99 alone, a
# quarter 1.6-1.9x (the flood's arrival and a first, unmeasured batch add gaps of their own).
SHARE_OF_STEP = 0.25
FIRST_BATCH_TOKENS = 64  # beside generation, before a model's cost per token is measured


def budget_tokens(max_tokens: int, step_s: float | None, per_token_s: float | None) -> int:
    """A batch's token budget: ``max_tokens`` with no stream generating (``step_s`` None), else what fits
    SHARE_OF_STEP of their latest step at the model's measured cost per token (FIRST_BATCH_TOKENS while
    unmeasured); at least 1, so the inputs always move on."""
    if step_s is None:
        return max_tokens
    if per_token_s is None:
        return min(max_tokens, FIRST_BATCH_TOKENS)
    return max(1, min(max_tokens, int(SHARE_OF_STEP * step_s / per_token_s)))


def batch_tokens(taken: list[tuple[PendingEmbed, int]], padded: bool) -> int:
    """The tokens a batch computes: inputs x the longest when padded (an encoder), else their sum."""
    lengths = [len(ids) for item, n in taken for ids in item.inputs[len(item.results):len(item.results) + n]]
    return len(lengths) * max(lengths) if padded else sum(lengths)


@dataclass
class EmbedQueue:
    pending: list[PendingEmbed] = field(default_factory=list)
    seconds_per_token: dict[str, float] = field(default_factory=dict)  # per model, measured on its batches

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
        """One batch of the first waiting request's model: at most ``max_tokens`` tokens and, while
        streams generate, at most SHARE_OF_STEP of their step's time (always at least one input)."""
        self.pending = [p for p in self.pending if not p.future.done()]  # cancelled: its client left
        if not self.pending:
            return
        name = self.pending[0].model_name
        encoder, resident = encoders.get(name), models.get(name)
        step_s = max((m.last_step_s for m in models.values() if m.scheduler.running), default=None)
        budget = budget_tokens(max_tokens, step_s, self.seconds_per_token.get(name))
        taken = take_batch(self.pending, budget, padded=encoder is not None)
        tokens, start_s = batch_tokens(taken, encoder is not None), time.perf_counter()
        try:
            if encoder is not None:
                run_encoder(encoder, taken)
            else:
                run_decoder(resident.scheduler, resident.runner, taken)
        except Exception as e:  # the batch's requests fail, never the engine
            if not isinstance(e, KVCacheBusy):
                log.exception("engine: an embedding batch failed for model %s", name)
            for item, _ in taken:
                self.pending.remove(item)
                settle(item.future, error=e)
            return
        self.seconds_per_token[name] = (time.perf_counter() - start_s) / tokens
        for item, _ in taken:
            if item.remaining == 0:
                self.pending.remove(item)
                settle(item.future, result=item.results)

    def cancel(self, request_id: str) -> None:
        for item in [p for p in self.pending if p.request_id == request_id]:
            self.pending.remove(item)
            item.future.cancel()

    def fail(self, error: Exception, model_name: str | None = None) -> None:
        """Fail the waiting requests of ``model_name`` (None: all of them) with ``error``."""
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
