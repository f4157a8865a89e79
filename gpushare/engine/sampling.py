"""The batched sampler (grammar masks, penalties, temperature, top-k/top-p/min-p, seeds),
logprobs of sampled tokens and of prompts.

Logprobs of a sampled token come from the logits the sampler used: after the grammar mask and the
penalties, before temperature and the top-k/top-p/min-p filters (vLLM's default).

Ranges are bounded so that no accepted value pushes logits to +-inf, and a row that still fails
(non-finite probabilities) yields a ``SamplingFailure`` for that row alone: one request's odd
parameters never fail the other sequences of its batch.
"""

import math

import torch

from gpushare.engine.constraints import apply_masks
from gpushare.protocol.sampling_params import SamplingFailure, SamplingParams, TokenLogprobs


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
