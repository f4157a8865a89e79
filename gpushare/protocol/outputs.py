"""RequestOutput: what the caller of a request sees of it, one per engine step that made text (or
ended it), delivered in the engine's thread or sent back by a worker process."""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.protocol.sampling_params import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time_s: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the output that carries the first token
    logprobs: list[TokenLogprobs] | None = None  # with params.logprobs: one per token of ``token_ids`` that made text
    index: int = 0  # which of the request's ``n`` answers this is
    scheduled_time_s: float | None = None  # time.monotonic() when its prompt first went into a batch
    stop_reason: str | None = None  # on a "stop" finish by a stop string: that string (vLLM's stop_reason)
