"""The batched sampler against simple references, on the CPU (no model): what it draws follows the
softmax of the filtered logits, its top-k/top-p/min-p keep what a per-row filter keeps, a seeded
row draws the same tokens alone and in any batch, and a step reads the device back once."""

import torch
from torch.overrides import TorchFunctionMode

from gpushare.engine.sampling import filtered_probs, sample, sample_batch
from gpushare.engine.staging import Staging
from gpushare.protocol.sampling_params import SamplingParams

HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
CHI2_DF7_P001 = 24.32  # chi-square, 7 degrees of freedom, p = 0.001


def reference_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, one parameter at a time, as the documentation of each filter reads."""
    row = row / params.temperature
    if 0 < params.top_k < row.shape[-1]:
        kept = torch.zeros_like(row, dtype=torch.bool)
        kept[torch.topk(row, params.top_k).indices] = True
        row = row.masked_fill(~kept, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    if params.top_p < 1:
        values, kept, mass = probs.tolist(), torch.zeros_like(probs), 0.0
        for token in sorted(range(len(values)), key=lambda t: -values[t]):
            if mass >= params.top_p:
                break
            kept[token], mass = values[token], mass + values[token]
        probs = kept
    return probs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs / probs.sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    draws = 40_000
    params = SamplingParams(temperature=1.0)
    tokens = sample(logits.repeat(draws, 1), [(params, [], [], None)] * draws)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert chi_square(counts, torch.softmax(logits.double(), -1)) < CHI2_DF7_P001


def test_filtered_draws_follow_the_filtered_softmax_and_never_leave_it():
    torch.manual_seed(1)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    expected = reference_probs(logits, params).double()
    kept = expected > 0
    tokens = sample(logits.repeat(30_000, 1), [(params, [], [], None)] * 30_000)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert counts[~kept].sum() == 0
    assert chi_square(counts[kept], expected[kept]) < CHI2_DF7_P001


def test_filters_keep_what_a_per_row_filter_keeps():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=gen) * 3
    params = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.3, top_p=0.7),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.5, top_k=40, top_p=0.8,
                                                                             min_p=0.01),
              SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=299, top_p=0.95)]
    got = filtered_probs(logits, params, Staging("cpu"))
    for row, p, probs in zip(logits, params, got):
        want = reference_probs(row, p)
        assert torch.equal(probs > 0, want > 0)
        torch.testing.assert_close(probs, want)


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(5, 500, generator=gen) * 2 for _ in range(12)]
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, presence_penalty=0.5, seed=42)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_p=0.5, repetition_penalty=1.3), SamplingParams(temperature=0.7, seed=7)]

    def run(batched: bool) -> list[int]:
        mine, theirs = torch.Generator().manual_seed(42), torch.Generator().manual_seed(7)
        out, other_out = [], [[] for _ in others]
        for logits in steps:
            rows = [(seeded, [1, 2, 3], list(out), mine)]
            if batched:
                rows = [(p, [4, 5], other_out[k], theirs if p.seed else None) for k, p in enumerate(others[:2])] + rows + \
                       [(p, [4, 5], other_out[k + 2], theirs if p.seed else None) for k, p in enumerate(others[2:])]
                tokens = sample(logits, rows)
                out.append(tokens[2])
                for k, t in enumerate(tokens[:2] + tokens[3:]):
                    other_out[k].append(t)
            else:
                out.append(sample(logits[2:3], rows)[0])
        return out

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 1  # it did sample


def test_greedy_rows_take_the_argmax_of_their_penalised_logits():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 200, generator=gen)
    output = [int(logits[1].argmax())] * 3
    rows = [(SamplingParams(temperature=0), [], [], None),
            (SamplingParams(temperature=0, frequency_penalty=2.0), [], output, None),
            (SamplingParams(temperature=0.8, seed=1), [], [], torch.Generator().manual_seed(1))]
    tokens = sample(logits, rows)
    penalised = logits[1].clone()
    penalised[output[0]] -= 2.0 * 3
    assert tokens[:2] == [int(logits[0].argmax()), int(penalised.argmax())]
    assert tokens[1] != output[0]


class HostReads(TorchFunctionMode):
    """Counts the calls that make the host wait for a tensor's values."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


def test_a_step_reads_the_device_back_once_for_the_whole_batch():
    gen = torch.Generator().manual_seed(5)
    batch = 64
    logits = torch.randn(batch, 1000, generator=gen)
    kinds = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1, logprobs=2),
             SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3),
             SamplingParams(temperature=0, presence_penalty=0.4)]
    rows = [(kinds[i % 3], [i, i + 1], [i + 2, i + 3, i + 2], torch.Generator().manual_seed(i) if i % 3 == 0 else None)
            for i in range(batch)]
    with HostReads() as reads:
        tokens, logprobs = sample_batch(logits, rows)
    assert reads.count == 1
    assert all(isinstance(t, int) for t in tokens)
    assert all((lp is not None) == (i % 3 == 0) for i, lp in enumerate(logprobs))
