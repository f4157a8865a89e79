"""One step of one model on the engine thread: schedule, run its layers (pausing between two of
them for urgent prompts), sample, hand the tokens on; and the urgent prompts' own steps.

Failures stay with the requests they touch: a failed schedule fails that model's requests, a
failed step its batch, never the engine. Functions of the ``Engine`` whose thread runs them.
"""

import logging
import time

from gpushare.engine.resident_model import ResidentModel

log = logging.getLogger(__name__)


def schedule_and_run(engine, resident: ResidentModel) -> None:
    try:
        batch = resident.scheduler.schedule()
    except Exception as e:  # this model's requests fail; other models go on
        log.exception("engine: scheduling failed for model %s", resident.name)
        for seq in list(resident.scheduler.running) + list(resident.scheduler.waiting):
            engine.step_outputs.finish(resident, seq, "error",
                                       error=f"engine scheduling failed: {type(e).__name__}: {e}")
        return
    if batch.seqs:
        run_step(engine, resident, batch)


def run_step(engine, resident: ResidentModel, batch) -> None:
    runner = resident.runner
    start_s = time.perf_counter()
    try:
        step = runner.begin(batch)
        while not runner.advance(step, engine.new_work):
            engine.take_new_work()
        sampled = runner.complete(step)
        resident.last_step_s = time.perf_counter() - start_s
        resident.scheduler.after_step(batch)
        for child in step.forks:
            engine.requests[child.request_id] = child
            resident.scheduler.adopt(child)
    except Exception as e:  # a failed step fails its batch, never the engine
        log.exception("engine step failed for model %s", resident.name)
        for seq in batch.seqs:
            for child in seq.forks:
                if child.request_id not in engine.requests:  # forked by the failed step: take it in to end it
                    engine.requests[child.request_id] = child
                    resident.scheduler.adopt(child)
            for answer in [seq, *seq.forks]:
                engine.step_outputs.finish(resident, answer, "error", error=f"engine step failed: {e}")
        return
    resident.steps += 1
    resident.virtual_steps += 1 / resident.share_weight
    engine.steps += 1
    resident.prompt_tokens += sum(c for s, c in zip(batch.seqs, batch.chunks) if s.num_computed <= len(s.prompt_ids))
    for seq, token in sampled:
        engine.step_outputs.advance_one(resident, seq, token)
    engine.flush(after_step=True)  # an urgent step's first token goes out now, not after the step it paused
    if engine.on_step is not None:
        engine.on_step(engine)


def run_urgent_prompts(engine) -> None:
    """Waiting prompts of tenants ahead of all running work get a step of their own. That step
    may pause in turn; each level admits a sequence, so ``max_num_seqs`` bounds the nesting."""
    residents = list(engine.models.values())
    waiting = {(s.fair_key, s.priority) for w in residents for s in w.scheduler.waiting}
    if not waiting:  # the usual case in a busy loop: nothing to weigh
        return
    urgent = engine.ledger.urgent_tenants(waiting, {(s.fair_key, s.priority) for w in residents
                                                  for s in w.scheduler.running})
    if not urgent:
        return
    for resident in residents:
        batch = resident.scheduler.schedule_urgent(urgent)
        if batch.seqs:
            run_step(engine, resident, batch)
