"""The batched sampler (grammar masks, penalties, temperature, top-k/top-p/min-p, seeds),
logprobs of sampled tokens and of prompts.

The whole batch is sampled in a few tensor operations on the logits' device, and the step waits
for the device once, when it reads the chosen ids back (with the logprobs asked for). Greedy rows
take the argmax of their (penalised) logits. The other rows draw by inverse CDF: one uniform number
per row, a seeded row's from its own generator (on the logits' device), so a seeded request's
tokens do not depend on the rows beside it.

Logprobs of a sampled token come from the logits the sampler used: after the grammar mask and the
penalties, before temperature and the top-k/top-p/min-p filters (vLLM's default).

Ranges are bounded so that no accepted value pushes logits to +-inf, and a row that still fails
(non-finite probabilities) yields a ``SamplingFailure`` for that row alone: one request's odd
parameters never fail the other sequences of its batch.
"""

import torch

from gpushare.engine.constraints import apply_masks
from gpushare.engine.staging import Staging
from gpushare.protocol.sampling_params import SamplingFailure, SamplingParams, TokenLogprobs

NO_FINITE_PROBABILITIES = "sampling failed: the sampling parameters left no finite probabilities"


def apply_penalties(logits: torch.Tensor, rows: list, staging: Staging) -> None:
    """Penalise the rows of ``logits`` in place: HF-style repetition over prompt+output, OpenAI-style
    presence and frequency over output. ``rows[i]`` is (params, prompt_ids, output_ids, ...)."""
    repeated = [(i, params.repetition_penalty, sorted(set(prompt_ids) | set(output_ids)))
                for i, (params, prompt_ids, output_ids, *_) in enumerate(rows) if params.repetition_penalty != 1]
    counted = [(i, params, output_ids) for i, (params, _, output_ids, *_) in enumerate(rows)
               if output_ids and (params.presence_penalty or params.frequency_penalty)]
    if repeated:
        row_of = [i for i, _, seen in repeated for _ in seen]
        factor = [penalty for _, penalty, seen in repeated for _ in seen]
        seen_rows, seen_ids, factors = staging.upload((row_of, torch.long), ([t for *_, seen in repeated for t in seen],
                                                      torch.long), (factor, torch.float32))
        values = logits[seen_rows, seen_ids]
        factors = factors.to(logits.dtype)
        logits[seen_rows, seen_ids] = torch.where(values > 0, values / factors, values * factors)
    if counted:
        row_of = [k for k, (_, _, output_ids) in enumerate(counted) for _ in output_ids]
        which, row_of, token_ids, frequency, presence = staging.upload(
            ([i for i, *_ in counted], torch.long), (row_of, torch.long),
            ([t for *_, output_ids in counted for t in output_ids], torch.long),
            ([p.frequency_penalty for _, p, _ in counted], torch.float32),
            ([p.presence_penalty for _, p, _ in counted], torch.float32))
        counts = torch.zeros(len(counted), logits.shape[1], dtype=logits.dtype, device=logits.device)
        counts.index_put_((row_of, token_ids), torch.ones_like(token_ids, dtype=logits.dtype), accumulate=True)
        frequency, presence = frequency.to(logits.dtype)[:, None], presence.to(logits.dtype)[:, None]
        logits[which] = logits[which] - (frequency * counts + presence * (counts > 0).to(logits.dtype))


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], staging: Staging) -> torch.Tensor:
    """Temperature-scaled probabilities of each row after its top-k, top-p and min-p: ``params[i]``
    is row i's (none greedy). Unnormalised where a filter removed tokens."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    by_top_p = any(p.top_p < 1 for p in params)
    by_min_p = any(p.min_p > 0 for p in params)
    temperature, k, top_p, min_p = staging.upload(
        ([p.temperature for p in params], torch.float32), (top_k, torch.long),
        # a row without top-p keeps everything: no rounding of its cumulative sum may reach the bound
        ([p.top_p if p.top_p < 1 else float("inf") for p in params], torch.float32),
        ([p.min_p for p in params], torch.float32))
    logits = logits / temperature.to(logits.dtype)[:, None]
    candidates = None
    if any(top_k):
        # Exactly k tokens stay (ties at the k-th as torch.topk breaks them): the candidates then hold
        # all of a row's mass, which top-p below relies on.
        candidates = torch.topk(logits, max(top_k), dim=-1)
        ranks = torch.arange(candidates.indices.shape[1], device=logits.device)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, candidates.indices, ranks < k[:, None])
        logits = logits.masked_fill(~(keep | (k == 0)[:, None]), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if by_min_p:
        probs = probs.masked_fill(probs < min_p.to(probs.dtype)[:, None] * probs.amax(dim=-1, keepdim=True), 0)
    if by_top_p:
        # Where every top-p row has a top-k, its candidates are already in order (softmax keeps the
        # order of the logits) and hold all its mass: no sort over the vocabulary.
        within_k = all(k_row > 0 for k_row, p in zip(top_k, params) if p.top_p < 1)
        order = candidates.indices if within_k else torch.sort(probs, dim=-1, descending=True).indices
        sorted_probs = probs.gather(1, order)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs >= top_p.to(probs.dtype)[:, None]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0))
    return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's token by inverse CDF at ``uniforms[i]`` in [0, 1), and whether row i could be sampled
    (finite, positive mass). A token of probability zero is never drawn."""
    cdf = probs.float().cumsum(-1)
    total = cdf[:, -1:]
    ok = (torch.isfinite(total) & (total > 0))[:, 0]
    # Below the total however uniforms * total rounds: the drawn token's mass is never zero.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    return tokens, ok


def uniforms_for(rows: list, device: torch.device, staging: Staging) -> torch.Tensor:
    """One uniform number per row: a seeded row's from its own generator, the others' from torch's."""
    uniforms = torch.rand(len(rows), device=device)
    seeded = [(k, generator) for k, (*_, generator) in enumerate(rows) if generator is not None]
    if seeded:
        (at,) = staging.upload(([k for k, _ in seeded], torch.long))
        uniforms[at] = torch.cat([torch.rand(1, generator=generator, device=device) for _, generator in seeded])
    return uniforms


def sample(logits: torch.Tensor, rows: list) -> list[int | SamplingFailure]:
    """Pick one token per row. ``rows[i]`` is (params, prompt_ids, output_ids, generator or None)."""
    return sample_batch(logits, rows)[0]


def sample_batch(logits: torch.Tensor, rows: list, matchers: list | None = None, staging: Staging | None = None
                 ) -> tuple[list[int | SamplingFailure], list[TokenLogprobs | None]]:
    """Pick one token per row, and its logprobs for rows whose params ask for them. ``rows[i]`` is
    (params, prompt_ids, output_ids, generator or None); ``matchers[i]`` row i's grammar, or None;
    ``staging`` the step's (a new one when None).

    Each seeded row draws from its own generator, so its text does not depend on the batch. A row
    that cannot be sampled gets a SamplingFailure; the other rows are sampled as if it were absent.
    """
    problems = apply_masks(logits, matchers) if matchers and any(m is not None for m in matchers) else None
    params = [p for p, *_ in rows]
    plain = problems is None and all(p.greedy and not p.penalised for p in params)
    if plain and all(p.logprobs is None for p in params):
        return logits.argmax(dim=-1).tolist(), [None] * len(rows)
    staging = staging or Staging(logits.device)
    if plain:
        return _read_back(logits, logits.argmax(dim=-1), None, params, problems, staging)
    scores = logits.to(torch.float32, copy=True)  # the logits the sampler used: penalised, never the model's
    if any(p.penalised for p in params):
        apply_penalties(scores, rows, staging)
    tokens = scores.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy and (problems is None or problems[i] is None)]
    ok = None
    if sampled:
        (at,) = staging.upload((sampled, torch.long))
        picked, picked_ok = draw(filtered_probs(scores[at], [params[i] for i in sampled], staging),
                                 uniforms_for([rows[i] for i in sampled], scores.device, staging))
        tokens[at] = picked
        ok = torch.ones_like(tokens, dtype=torch.bool)
        ok[at] = picked_ok
    return _read_back(scores, tokens, ok, params, problems, staging)


def _read_back(scores, tokens, ok, params, problems, staging):
    """The host's one wait for the device: the chosen ids, which rows could be sampled, and the
    logprobs asked for, in one copy."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    parts = [tokens.double()] + ([ok.double()] if ok is not None else [])
    top_k = max((params[i].logprobs for i in want), default=0)
    if want:
        (at,) = staging.upload((want, torch.long))
        logprobs = torch.log_softmax(scores[at].float(), dim=-1)
        parts.append(logprobs.gather(1, tokens[at][:, None])[:, 0].double())
        if top_k:
            top = torch.topk(logprobs, top_k, dim=-1)
            parts += [top.indices.double().flatten(), top.values.double().flatten()]
    values = torch.cat(parts).tolist()
    n = len(params)
    ids, rest = [int(t) for t in values[:n]], values[n:]
    good = [v > 0 for v in rest[:n]] if ok is not None else [True] * n
    rest = rest[n:] if ok is not None else rest
    tops = len(want) * top_k
    chosen, top_ids, top_values = rest[:len(want)], rest[len(want):len(want) + tops], rest[len(want) + tops:]
    out: list[int | SamplingFailure] = []
    for i in range(n):
        if problems is not None and problems[i] is not None:
            out.append(SamplingFailure(problems[i]))
        else:
            out.append(ids[i] if good[i] else SamplingFailure(NO_FINITE_PROBABILITIES))
    logprobs_out: list[TokenLogprobs | None] = [None] * n
    for j, i in enumerate(want):
        if isinstance(out[i], int):
            k = params[i].logprobs
            pairs = zip(top_ids[j * top_k:j * top_k + k], top_values[j * top_k:j * top_k + k])
            logprobs_out[i] = TokenLogprobs(out[i], chosen[j], [(int(t), v) for t, v in pairs])
    return out, logprobs_out


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
