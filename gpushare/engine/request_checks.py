"""A Sequence for a GenerationRequest, made on the caller's thread: the request's limits were fixed
by request.check_request; what is left to do here is per-sequence state (the seeded generator,
the compiled output grammar), whose failure is the request's own."""

from typing import Callable

import torch

from gpushare.engine import constraints
from gpushare.protocol.request import GenerationRequest
from gpushare.engine.sequence import Sequence
from gpushare.protocol.outputs import RequestOutput
from gpushare.catalog.model_head import LoadedModel


def new_sequence(loaded: LoadedModel, request: GenerationRequest,
                 on_output: Callable[[RequestOutput], None]) -> Sequence:
    """ValueError when the request was not checked (no effective max_tokens) or its grammar does not compile."""
    params = request.params
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise ValueError(f"max_tokens must be fixed by request.check_request before submitting, got "
                         f"{params.max_tokens!r}")
    seq = Sequence(request.request_id, request.model, list(request.prompt_ids), params, on_output, request.tenant,
                   max_tokens=params.max_tokens, priority=request.priority, fair_group=request.fair_group)
    if params.prompt_logprobs is not None:
        seq.prompt_logprobs = [None]  # the first prompt token has nothing before it to be scored by
    if params.seed is not None:
        seq.generator = torch.Generator(device=loaded.device).manual_seed(params.seed)  # the logits' device
    if params.structured is not None:
        seq.matcher = constraints.new_matcher(loaded, params.structured)  # SchemaError is a ValueError
    return seq
