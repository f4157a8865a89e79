"""SamplingParams (what a request asks of the sampler, and its range checks), SamplingFailure and
TokenLogprobs: the sampler's inputs and outputs that cross the API -> engine boundary, kept apart
from the sampler itself (engine/sampling.py) so the daemon's supervisor never imports torch."""

from dataclasses import dataclass, field

from gpushare.protocol.structured_output import StructuredOutput

MAX_PROMPT_LOGPROBS = 20
MAX_LOGPROBS = 20  # top logprobs per sampled token, as OpenAI's top_logprobs
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: dividing logits by less overflows; the answer is the argmax anyway
MAX_TEMPERATURE = 100.0  # past this the distribution is uniform to float precision
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits (|x| < 1e4) times or over 100 stay far from float32's limit
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass
class SamplingFailure:
    """Why one row could not be sampled; the engine ends that sequence with this error."""
    message: str


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: up to the end of the usable context (protocol/request.py)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: the text keeps them (gpt-oss's channel markup, split by the API)
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob plus the top k
    logprobs: int | None = None  # None: off; k: each sampled token's logprob plus the top k
    n: int = 1  # answers to the one prompt, sharing its KV blocks (the engine forks after the prefill)
    structured: StructuredOutput | None = None  # the output must match this (constrained decoding)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_PROMPT_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_PROMPT_LOGPROBS}], got {k!r}")
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class TokenLogprobs:
    """A sampled token's logprob and the ``top`` most likely tokens' (id, logprob), best first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
