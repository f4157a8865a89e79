"""ModelRunner: turns a scheduled batch into tensors, runs the model over the paged cache, samples.

A step can pause between layers (the engine runs urgent work meanwhile) and resume."""

from dataclasses import dataclass, field

import torch

from gpushare.engine import constraints
from gpushare.engine.forks import fork, wants_forks
from gpushare.engine.kv_cache import BlockPool
from gpushare.engine.kv_pool import copy_block
from gpushare.engine.sampling import prompt_logprobs, sample_batch
from gpushare.engine.staging import Staging
from gpushare.protocol.sampling_params import SamplingFailure
from gpushare.engine.scheduler import Batch
from gpushare.models.cpu_kernels import WIDE_CHUNK_TOKENS
from gpushare.models.llama import AttentionBatch, ForwardState
from gpushare.catalog.model_head import LoadedModel

PROMPT_LOGITS_ROWS = 256  # prompt rows per lm_head call: bounds the [rows, vocab] float32 logits of a long chunk


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0) or 1
    return [t + [0] * (width - len(t)) for t in tables]


@dataclass
class StepInFlight:
    batch: Batch
    forward: ForwardState
    last_rows: dict[int, int]  # batch index -> row of its last token
    logit_rows: list[int]  # the rows that sample, in order: forward.logit_rows on the host
    forks: list = field(default_factory=list)  # sequences forked from an n > 1 answer in this step (forks.py)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: BlockPool, kv_caches: list):
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        self.kv_caches = kv_caches  # per layer (K, V) views into the device KV pool (kv_pool.layer_views)
        self.staging = Staging(self.device)

    def _inputs(self, seqs, chunks):
        """Token ids, positions and attention layout: wide prefill chunks first, then the other prefill
        chunks, then single tokens."""
        bs = self.pool.block_size
        order = sorted(range(len(seqs)),
                       key=lambda i: 0 if chunks[i] >= WIDE_CHUNK_TOKENS else 1 if chunks[i] > 1 else 2)
        ids, positions, slots = [], [], []
        prefill_tables, cu_seqlens, prefill_lens, decode_tables, decode_lens = [], [0], [], [], []
        last_rows, lora_slots = {}, []
        adapters = self.loaded.model.adapters if any(s.adapter is not None for s in seqs) else None
        for i in order:
            seq, chunk = seqs[i], chunks[i]
            start, end = seq.num_computed, seq.num_computed + chunk
            table = seq.block_table
            ids.extend(seq.all_ids[start:end])
            if adapters is not None:
                lora_slots.extend([adapters.slot(seq.adapter)] * chunk)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_rows[i] = len(ids) - 1
            if chunk > 1:
                prefill_tables.append(table)
                cu_seqlens.append(cu_seqlens[-1] + chunk)
                prefill_lens.append(end)
            else:
                decode_tables.append(table)
                decode_lens.append(end)
        sampling = [last_rows[i] for i, (seq, chunk) in enumerate(zip(seqs, chunks))
                    if seq.num_pending == chunk]  # the chunk ends its input: the step samples its next token
        long, int32 = torch.long, torch.int32
        (input_ids, positions, slot_mapping, logit_rows, cu_seqlens_t, prefill_lens_t, prefill_tables_t,
         decode_tables_t, decode_lens_t, *lora_slots_t) = self.staging.upload(
            (ids, long), (positions, long), (slots, long), (sampling, long), (cu_seqlens, int32),
            (prefill_lens, int32), (_padded(prefill_tables), int32), (_padded(decode_tables), int32),
            (decode_lens, int32),
            *([(lora_slots, int32)] if adapters is not None else []))
        batch = AttentionBatch(
            slot_mapping=slot_mapping,
            num_prefill_tokens=cu_seqlens[-1],
            prefill_block_tables=prefill_tables_t,
            prefill_cu_seqlens=cu_seqlens_t,
            prefill_context_lens=prefill_lens_t,
            decode_block_tables=decode_tables_t,
            decode_context_lens=decode_lens_t,
            wide_rows=sum(c for c in chunks if c >= WIDE_CHUNK_TOKENS),
            lora_slots=lora_slots_t[0] if adapters is not None else None,
        )
        return input_ids, positions, batch, last_rows, (sampling, logit_rows)

    def begin(self, batch: Batch) -> StepInFlight:
        """Start a step; ``advance`` runs it, ``complete`` samples its tokens."""
        input_ids, positions, attention, last_rows, (sampling, logit_rows) = self._inputs(batch.seqs, batch.chunks)
        forward = self.loaded.model.start(input_ids, positions, attention)
        forward.logit_rows = logit_rows if sampling else None
        return StepInFlight(batch, forward, last_rows, sampling)

    def advance(self, step: StepInFlight, should_pause=None) -> bool:
        """Run the step's layers; False when ``should_pause()`` stopped it between two layers."""
        return self.loaded.model.run_layers(step.forward, self.kv_caches, should_pause)

    def complete(self, step: StepInFlight) -> list[tuple]:
        """Finish an advanced step; returns ``(seq, token)`` for every sequence whose chunk ended its input."""
        batch, model = step.batch, self.loaded.model
        wants_prompt_logprobs = any(seq.prompt_logprobs is not None for seq in batch.seqs)
        hidden = model.finish(step.forward) if step.forward.logits is None or wants_prompt_logprobs else None
        for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            if seq.prompt_logprobs is not None:
                self._record_prompt_logprobs(seq, hidden, step.last_rows[i] - chunk + 1, chunk)
            seq.num_computed += chunk
        ready = [i for i, seq in enumerate(batch.seqs) if seq.num_pending == 0]
        if not ready:
            return []
        seqs = [batch.seqs[i] for i in ready]
        last_rows = [step.last_rows[i] for i in ready]
        for i in [k for k, seq in enumerate(seqs) if wants_forks(seq)]:
            step.forks += fork(seqs[i], self.pool, self.copy_block)
            running = [child for child in seqs[i].forks if child.num_computed]
            seqs += running  # each draws its first token from answer 0's last prompt row
            last_rows += [last_rows[i]] * len(running)
        logits = self._logits(step, hidden, last_rows)
        matchers = [s.matcher for s in seqs] if any(s.matcher is not None for s in seqs) else None
        tokens, logprobs = sample_batch(logits, [(s.params, s.prompt_ids, s.output_ids, s.generator) for s in seqs],
                                        matchers, self.staging)
        for k, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.last_logprobs = logprobs[k]
            if seq.matcher is not None and not isinstance(token, SamplingFailure):
                try:
                    constraints.advance(seq.matcher, token)
                except RuntimeError as e:
                    tokens[k] = SamplingFailure(str(e))
        return list(zip(seqs, tokens))

    def _logits(self, step: StepInFlight, hidden, last_rows: list[int]) -> torch.Tensor:
        """The logits of rows ``last_rows``: from the fused path's head where it ran (``begin`` named the
        rows that sample; forks repeat one of them), else from ``hidden``."""
        forward, model = step.forward, self.loaded.model
        if forward.logits is None:
            return model.logits(hidden, self.staging.upload((last_rows, torch.long))[0])
        computed = step.logit_rows
        if computed == last_rows:
            return model.capped(forward.logits)
        (order,) = self.staging.upload(([computed.index(r) for r in last_rows], torch.long))
        return model.capped(forward.logits[order])

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one KV block in every layer (on every rank of a tensor-parallel model)."""
        mirror = getattr(self.loaded.model, "mirror_copy_block", None)
        if mirror is not None:
            mirror(source, destination)
        copy_block(self.kv_caches, source, destination)

    def _record_prompt_logprobs(self, seq, hidden, first_row: int, chunk: int) -> None:
        """Extend ``seq.prompt_logprobs`` from this chunk's rows (``hidden[first_row:first_row + chunk]``):
        the row of position p scores prompt token p + 1. Entries a recomputation (after preemption)
        meets again are kept, not recomputed."""
        start, prompt = seq.num_computed, seq.prompt_ids
        first = max(start, len(seq.prompt_logprobs) - 1)
        last = min(start + chunk, len(prompt) - 1)
        for p in range(first, last, PROMPT_LOGITS_ROWS):
            q = min(p + PROMPT_LOGITS_ROWS, last)
            logits = self.loaded.model.logits(hidden, torch.arange(first_row + p - start, first_row + q - start,
                                                                   device=self.device))
            seq.prompt_logprobs.extend(prompt_logprobs(logits, prompt[p + 1:q + 1], seq.params.prompt_logprobs))

    def hidden_states(self, seqs, chunks):
        """Run the model at once; returns the final hidden states and each sequence's last row index."""
        input_ids, positions, attention, last_rows, _ = self._inputs(seqs, chunks)
        hidden = self.loaded.model(input_ids, positions, self.kv_caches, attention)
        for seq, chunk in zip(seqs, chunks):
            seq.num_computed += chunk
        return hidden, last_rows
