"""What a step's sampled tokens do to their sequences, and the outputs that go to their consumers.

``StepOutputs`` lives on the engine thread: it holds the requests taken in and the outputs made since the
last flush. The engine publishes its snapshot first and then calls ``deliver``, so whoever gets a
request's last output sees engine state that already includes its end.
"""

import logging
import time
from dataclasses import dataclass, field

from gpushare.engine.detokenizer import append_text, finish_reason, releasable_text
from gpushare.engine.resident_model import ResidentModel
from gpushare.engine.sequence import Sequence, Status
from gpushare.engine.tenant_ledger import TenantLedger
from gpushare.protocol.outputs import RequestOutput
from gpushare.protocol.sampling_params import SamplingFailure

log = logging.getLogger(__name__)


@dataclass
class StepOutputs:
    ledger: TenantLedger
    requests: dict[str, Sequence] = field(default_factory=dict)  # taken in and not yet finished, by id
    outputs: list[tuple[Sequence, RequestOutput]] = field(default_factory=list)  # made since the last deliver

    def emit(self, seq: Sequence, out: RequestOutput) -> None:
        self.outputs.append((seq, out))

    def fail(self, seq: Sequence, reason: str) -> None:
        """End ``seq``, which no scheduler holds, with the error ``reason``."""
        self.requests.pop(seq.request_id, None)
        self.emit(seq, request_output(seq, [], True, "error", reason))

    def advance_one(self, resident: ResidentModel, seq: Sequence, token: int | SamplingFailure) -> None:
        """Give ``seq`` its new token; a failure on this sequence (sampling, text) ends it alone."""
        if isinstance(token, SamplingFailure):
            self.finish(resident, seq, "error", error=token.message)
            return
        try:
            self._advance(resident, seq, token)
        except Exception as e:
            log.exception("engine: request %s failed after its step", seq.request_id)
            self.finish(resident, seq, "error", error=f"{type(e).__name__}: {e}")

    def _advance(self, resident: ResidentModel, seq: Sequence, token: int) -> None:
        if seq.first_token_time_s is None:
            seq.first_token_time_s = time.monotonic()
        seq.output_ids.append(token)
        resident.generated_tokens += 1
        self.ledger.generated_tokens[seq.tenant] = self.ledger.generated_tokens.get(seq.tenant, 0) + 1
        loaded = resident.loaded
        params = seq.params
        makes_text = token not in params.stop_token_ids and (params.ignore_eos or token not in loaded.stop_token_ids)
        if makes_text:
            append_text(loaded.tokenizer, seq)
        logprobs = [seq.last_logprobs] if makes_text and seq.last_logprobs is not None else None
        reason = finish_reason(seq, token, loaded.stop_token_ids, loaded.config.context_length)
        if reason is not None:
            self.finish(resident, seq, reason, last_token=token, logprobs=logprobs)
            return
        self.emit(seq, request_output(seq, [token], False, None, logprobs=logprobs))

    def finish(self, resident: ResidentModel, seq: Sequence, reason: str, error: str | None = None,
               last_token: int | None = None, logprobs=None) -> None:
        if seq.status is Status.FINISHED:
            return
        resident.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.emit(seq, request_output(seq, [] if last_token is None else [last_token], True, reason, error, logprobs))

    def deliver(self) -> None:
        """Hand every output made since the last call to its consumer."""
        outputs, self.outputs = self.outputs, []
        for seq, out in outputs:
            try:
                seq.on_output(out)
            except Exception:  # a broken consumer must not stop the engine
                log.exception("on_output callback failed for request %s", seq.request_id)


def request_output(seq: Sequence, new_ids: list[int], finished: bool, reason: str | None, error: str | None = None,
                   logprobs=None) -> RequestOutput:
    """What ``seq``'s consumer gets now: its new tokens and releasable text, counts, timings."""
    first_token = bool(new_ids) and len(seq.output_ids) == 1
    return RequestOutput(seq.request_id, releasable_text(seq, finished), new_ids, finished, reason, error,
                         len(seq.prompt_ids), len(seq.output_ids), seq.num_cached, seq.first_token_time_s,
                         seq.prompt_logprobs if first_token else None, logprobs, seq.index,
                         seq.scheduled_time_s, seq.stop_reason if finished else None)
