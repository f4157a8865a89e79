"""SamplingParams, the batched sampler (grammar masks, penalties, temperature, top-k/top-p/min-p, seeds),
logprobs of sampled tokens and of prompts.

Logprobs of a sampled token come from the logits the sampler used: after the grammar mask and the
penalties, before temperature and the top-k/top-p/min-p filters (vLLM's default).

Ranges are bounded so that no accepted value pushes logits to +-inf, and a row that still fails
(non-finite probabilities) yields a ``SamplingFailure`` for that row alone: one request's odd
parameters never fail the other sequences of its batch.
"""

import math
from dataclasses import dataclass, field

import torch

from gpushare.engine.constraints import StructuredOutput, apply_masks

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
    max_tokens: int | None = None  # None: up to the end of the usable context (engine/request.py)
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


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]):
    """Penalise one row in place: HF-style repetition over prompt+output, OpenAI-style over output."""
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled probabilities of one row after top-k, top-p and min-p."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
    return probs


def _sample_row(row: torch.Tensor, params: SamplingParams, prompt_ids, output_ids, generator) -> int:
    if params.penalised:
        apply_penalties(row, params, prompt_ids, output_ids)
    if params.greedy:
        return int(row.argmax())
    probs = _filter(row, params)
    # Checked here, not left to multinomial: on CUDA a bad distribution can be a device-side assert,
    # which would poison the context for every request. A NaN or inf anywhere makes the sum one.
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0:
        raise ValueError("the sampling parameters left no finite probabilities")
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class TokenLogprobs:
    """A sampled token's logprob and the ``top`` most likely tokens' (id, logprob), best first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(row: torch.Tensor, token: int, top_k: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(row.float(), dim=-1)
    top = torch.topk(logprobs, top_k) if top_k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprobs(token, float(logprobs[token]), pairs)


def sample(logits: torch.Tensor, rows: list) -> list[int | SamplingFailure]:
    """Pick one token per row. ``rows[i]`` is (params, prompt_ids, output_ids, generator or None)."""
    return sample_batch(logits, rows)[0]


def sample_batch(logits: torch.Tensor, rows: list, matchers: list | None = None
                 ) -> tuple[list[int | SamplingFailure], list[TokenLogprobs | None]]:
    """Pick one token per row, and its logprobs for rows whose params ask for them. ``rows[i]`` is
    (params, prompt_ids, output_ids, generator or None); ``matchers[i]`` row i's grammar, or None.

    Each seeded row draws from its own generator, so its text does not depend on the batch. A row
    that cannot be sampled gets a SamplingFailure; the other rows are sampled as if it were absent.
    """
    problems = apply_masks(logits, matchers) if matchers and any(m is not None for m in matchers) else None
    want_logprobs = any(params.logprobs is not None for params, *_ in rows)
    greedy = all(params.greedy and not params.penalised for params, *_ in rows)
    if greedy and problems is None:
        tokens = logits.argmax(dim=-1).tolist()
        logprobs = [token_logprobs(logits[i], t, params.logprobs) if params.logprobs is not None else None
                    for i, (t, (params, *_)) in enumerate(zip(tokens, rows))] if want_logprobs else [None] * len(rows)
        return tokens, logprobs
    tokens: list[int | SamplingFailure] = []
    logprobs: list[TokenLogprobs | None] = []
    for i, (params, prompt_ids, output_ids, generator) in enumerate(rows):
        logprobs.append(None)
        if problems is not None and problems[i] is not None:
            tokens.append(SamplingFailure(problems[i]))
            continue
        row = logits[i].clone()
        try:
            tokens.append(_sample_row(row, params, prompt_ids, output_ids, generator))
        except (RuntimeError, ValueError) as e:  # torch reports bad distributions as RuntimeError
            tokens.append(SamplingFailure(f"sampling failed: {e}"))
            continue
        if params.logprobs is not None:
            logprobs[-1] = token_logprobs(row, tokens[-1], params.logprobs)  # row: penalised in place
    return tokens, logprobs


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_k: int) -> list[dict[int, float]]:
    """One dict per row of ``logits``: the target token's logprob plus the ``top_k`` most likely
    tokens' (vLLM's shape). Logprobs are the log_softmax of the float32 logits."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, device=rows.device)
    chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
    top_ids = top_values = [()] * len(targets)  # no others when top_k is 0
    if top_k:
        top = torch.topk(rows, top_k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    out = []
    for token, logprob, others, values in zip(targets, chosen, top_ids, top_values):
        entry = {token: logprob}
        entry.update((t, v) for t, v in zip(others, values) if t != token)
        out.append(entry)
    return out
