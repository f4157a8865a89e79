"""ResidentModel: one model resident in the engine, its state there (scheduler, runner, counters)."""

from dataclasses import dataclass

from gpushare.engine.model_runner import ModelRunner
from gpushare.engine.scheduler import Scheduler
from gpushare.catalog.model_head import LoadedModel


@dataclass
class ResidentModel:
    name: str
    loaded: LoadedModel
    scheduler: Scheduler
    runner: ModelRunner
    share_weight: float = 1.0
    steps: int = 0
    virtual_steps: float = 0.0  # steps / share_weight, lifted when the model turns busy (fairness)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_step_s: float = 0.0  # how long its latest generation step took (embed batches are sized by it)
