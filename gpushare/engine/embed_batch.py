"""Embedding and scoring batches on the engine thread: the inputs of waiting embed requests, first come
first served, that fit one step's token budget (``max_num_batched_tokens``, at least one input).

The engine runs at most one such batch per loop turn, between two generation steps, so however many
inputs wait (4,000 in one request), a generating stream's next token waits for one batch at most;
while streams generate, an encoder batch may run only a few of its layers a turn (EncoderBatch,
engine/embed_queue.py says how many).

An encoder (models/bert.py) reads its batch padded to the longest input and holds no KV cache; a
decoder embeds over KV blocks its inputs borrow for the one pass, charged to their tenant, and
preempts for them as a prompt would (KVCacheBusy when even that cannot make room). Scores come from a
cross-encoder's head, or from an LLM reranker's yes/no logits at each prompt's last token.
"""

import array
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from gpushare.protocol.request import KVCacheBusy, Vectors
from gpushare.protocol.sampling_params import SamplingParams
from gpushare.engine.sequence import Sequence
from gpushare.models.bert import EncoderPass
from gpushare.models.embedding_pool import pool
from gpushare.catalog.llm_rerank import yes_no_ids
from gpushare.catalog.model_head import LoadedModel


@dataclass
class ResidentEncoder:
    """A loaded encoder inside the engine: no scheduler and no KV cache, only counters."""
    name: str
    loaded: LoadedModel
    steps: int = 0
    prompt_tokens: int = 0


@dataclass
class PendingEmbed:
    """An embed request in the engine: its inputs, the results so far (in input order), its future."""
    request_id: str
    model_name: str
    tenant: str
    inputs: list[list[int]]
    type_ids: list[list[int]] | None
    task: str  # "embed": one vector per input; "score": one relevance score per input (a cross-encoder)
    future: Future
    dimensions: int | None = None  # Matryoshka: vectors cut to this many values
    results: list = field(default_factory=list)  # a float32 vector (embed) or a float (score) per input run

    @property
    def remaining(self) -> int:
        return len(self.inputs) - len(self.results)

    def answer(self) -> Vectors | list[float]:
        """What the future gets: the vectors in one flat array (Vectors), or the scores."""
        if self.task == "score":
            return self.results
        stacked = torch.stack(self.results).cpu()
        return Vectors(stacked.shape[1], array.array("f", stacked.numpy().tobytes()))


def take_batch(pending: list[PendingEmbed], budget_tokens: int, padded: bool) -> list[tuple[PendingEmbed, int]]:
    """(request, inputs taken from it) for the next batch: the first request's model, its requests in
    order, inputs while they fit ``budget_tokens`` (padded: inputs x the longest, as an encoder reads them)."""
    model = pending[0].model_name
    taken, count, longest, total = [], 0, 0, 0
    for item in pending:
        if item.model_name != model:
            continue
        start, n = len(item.results), 0
        for ids in item.inputs[start:]:
            length = len(ids)
            cost = (count + 1) * max(longest, length) if padded else total + length
            if count and cost > budget_tokens:
                break
            count, longest, total, n = count + 1, max(longest, length), total + length, n + 1
        if n:
            taken.append((item, n))
        if n < item.remaining:
            break
    return taken


@dataclass
class EncoderBatch:
    """An encoder batch in flight, perhaps across loop turns: its inputs, their owners, the pass so far."""
    worker: ResidentEncoder
    taken: list  # [(PendingEmbed, inputs taken from it)]
    owners: list  # the request of each input, in the batch's order
    ids: list
    state: EncoderPass
    spent_s: float = 0.0  # its turns' time so far
    beside_streams: bool = False  # started while streams generated (a small batch, sized by their steps)

    @property
    def tokens(self) -> int:
        """What the pass computes: the inputs padded to the longest."""
        return len(self.ids) * max(map(len, self.ids))


def start_encoder(worker: ResidentEncoder, taken: list[tuple[PendingEmbed, int]]) -> EncoderBatch:
    """The taken inputs padded into one pass, through the encoder's embeddings."""
    ids, types, owners = [], [], []
    for item, n in taken:
        start = len(item.results)
        ids += item.inputs[start:start + n]
        types += item.type_ids[start:start + n] if item.type_ids else [[0] * len(x) for x in
                                                                        item.inputs[start:start + n]]
        owners += [item] * n
    with torch.inference_mode():
        state = worker.loaded.model.start(ids, types)
    return EncoderBatch(worker, taken, owners, ids, state)


def advance_encoder(batch: EncoderBatch, layers: int) -> bool:
    """``layers`` more layers of the batch's pass; once it has run them all, each request gets its
    vectors or scores (and True comes back)."""
    model = batch.worker.loaded.model
    with torch.inference_mode():
        if not model.run_layers(batch.state, layers):
            return False
        hidden = batch.state.x
        scores = model.relevance(hidden).tolist() if any(o.task == "score" for o in batch.owners) else None
    for row, (item, x) in enumerate(zip(batch.owners, batch.ids)):
        item.results.append(scores[row] if item.task == "score" else pool(hidden[row, :len(x)],
                                                                           batch.worker.loaded.pooling,
                                                                           item.dimensions))
    batch.worker.steps += 1
    batch.worker.prompt_tokens += sum(map(len, batch.ids))
    return True


def run_decoder(scheduler, runner, taken: list[tuple[PendingEmbed, int]]) -> None:
    """The taken inputs as prompts of one pass over borrowed KV blocks, pooled as the model declares.
    Inputs past the first whose blocks cannot be had now wait for a later batch."""
    seqs, owners = [], []
    for item, n in taken:
        start = len(item.results)
        seqs += [Sequence(f"{item.request_id}-{start + i}", item.model_name, list(item.inputs[start + i]),
                          SamplingParams(max_tokens=1), lambda out: None, item.tenant) for i in range(n)]
        owners += [item] * n
    held = []
    try:
        for seq in seqs:
            try:
                _borrow_blocks(scheduler, seq)
            except KVCacheBusy:
                if not held:
                    raise
                break
            held.append(seq)
        with torch.inference_mode():
            hidden, last_rows = runner.hidden_states(held, [s.num_pending for s in held])
            scoring = owners[0].task == "score"  # one model serves one task (api/embeddings.check_serves)
            scores = _yes_scores(runner.loaded, hidden, last_rows, len(held)) if scoring else None
        for i, (seq, item) in enumerate(zip(held, owners)):
            rows = hidden[last_rows[i] - len(seq.prompt_ids) + 1:last_rows[i] + 1]
            item.results.append(scores[i] if item.task == "score" else pool(rows, runner.loaded.pooling,
                                                                             item.dimensions))
    finally:
        for seq in held:
            scheduler.pool.release(seq.block_table, seq.tenant)


def _yes_scores(loaded: LoadedModel, hidden: torch.Tensor, last_rows: dict, count: int) -> list[float]:
    """An LLM reranker's P("yes") over {"yes", "no"} at each prompt's last token (models/llm_rerank.py)."""
    yes, no = (0, 1) if loaded.config.yes_no_head else yes_no_ids(loaded.tokenizer)
    logits = loaded.model.logits(hidden, torch.tensor([last_rows[i] for i in range(count)], device=hidden.device))
    return torch.softmax(logits[:, [no, yes]].float(), dim=-1)[:, 1].tolist()


def _borrow_blocks(scheduler, seq: Sequence) -> None:
    blocks = scheduler.pool
    while (refused := blocks.grow(seq.block_table, seq.num_tokens, seq.tenant)) is not None:
        victim = scheduler.victim(seq, refused)
        if victim is seq:
            raise KVCacheBusy(f"no room in the KV cache for the input now ({refused} reached); retry later")
        scheduler.preempt(victim)
