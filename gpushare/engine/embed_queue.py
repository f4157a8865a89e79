"""The engine's waiting embed requests: taken in first come first served, run a batch per loop turn
(embed_batch.py), settled, cancelled or failed. Touched only on the engine thread."""

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field

from gpushare.engine.embed_batch import PendingEmbed, ResidentEncoder, run_decoder, run_encoder, take_batch
from gpushare.engine.resident_model import ResidentModel
from gpushare.protocol.request import KVCacheBusy

log = logging.getLogger(__name__)


@dataclass
class EmbedQueue:
    pending: list[PendingEmbed] = field(default_factory=list)

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
        """One batch of the first waiting request's model, at most ``max_tokens`` tokens (at least one input)."""
        self.pending = [p for p in self.pending if not p.future.done()]  # cancelled: its client left
        if not self.pending:
            return
        name = self.pending[0].model_name
        encoder, resident = encoders.get(name), models.get(name)
        taken = take_batch(self.pending, max_tokens, padded=encoder is not None)
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
