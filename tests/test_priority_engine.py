"""Prompts of a tenant ahead of all running work (higher priority, or within its fair share) run in a
step of their own, before the next step or between two layers of the one in flight."""

import threading

import pytest
import torch

from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.kv_pool import kv_bytes_per_block
from gpushare.protocol.tenant_policy import TenantPolicy
from test_engine import PROMPTS, chat_ids, greedy

FLOOD_PROMPTS = PROMPTS[:4]
CHAT_PROMPT = PROMPTS[4]


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of every prompt, in one batch (the exact path answers alone and batched alike:
    test_oracle)."""
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], greedy(24))
    return {p: out.token_ids for p, out in zip(PROMPTS, outputs)}


class Run:
    """An engine with a batch-priority "flood" tenant and an interactive "chat" tenant; every output
    goes into one ordered log (outputs are emitted on the engine thread)."""

    def __init__(self, llm, flood_priority="batch", chat_priority="interactive"):
        self.llm = llm
        per_block = kv_bytes_per_block(llm.model.config, 16, torch.float32)
        self.engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=64 * per_block))
        self.engine.add_model("m", llm.model)
        self.engine.set_tenants([TenantPolicy("flood", priority=flood_priority),
                                 TenantPolicy("chat", priority=chat_priority), TenantPolicy("chat2")])
        self.chat_tenant = "chat"
        self.num_requests = len(FLOOD_PROMPTS) + 1
        self.log: list[tuple[str, int | None]] = []  # (prompt or marker, token)
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.request_ids: dict[str, str] = {}
        self.done = threading.Event()

    def submit(self, prompt: str, tenant: str) -> None:
        tokens = self.tokens.setdefault(prompt, [])

        def on_output(out):
            for token in out.token_ids:
                self.log.append((prompt, token))
            tokens.extend(out.token_ids)
            if out.finished:
                self.reasons[prompt] = out.finish_reason
                if len(self.reasons) == self.num_requests:
                    self.done.set()

        self.request_ids[prompt] = self.engine.submit(self.engine.request("m", chat_ids(self.llm, prompt), greedy(24), tenant=tenant), on_output)

    def start_flood(self) -> None:
        """Queue the flood, then start the engine: its first step prefills the whole flood together,
        whatever the test thread's timing. Later arrivals come from the engine thread (hooks)."""
        for p in FLOOD_PROMPTS:
            self.submit(p, "flood")
        self.engine.start()

    def flood_is_decoding(self) -> bool:
        return all(len(self.tokens.get(p, [])) >= 2 for p in FLOOD_PROMPTS)

    def after_marker(self) -> list[str]:
        """Whose tokens came out after the marker, in order."""
        return [who for who, _ in self.log[self.log.index(("marker", None)) + 1:]]

    def finish(self) -> None:
        try:
            assert self.done.wait(300), "requests did not finish"
            assert self.engine.stats().models["m"].blocks_used == 0
        finally:
            self.engine.shutdown()


def chat_arrives_between_flood_steps(run: Run) -> None:
    """Flood, then the chat request once the flood decodes (sent from the engine thread between
    two steps, after the marker); waits for everything."""
    def on_step(engine):
        if run.flood_is_decoding() and CHAT_PROMPT not in run.tokens:
            run.log.append(("marker", None))
            run.submit(CHAT_PROMPT, run.chat_tenant)

    run.engine.on_step = on_step
    run.start_flood()
    run.finish()


def test_interactive_prompt_runs_before_the_next_batch_step(llm, reference):
    run = Run(llm)
    chat_arrives_between_flood_steps(run)
    assert run.after_marker()[0] == CHAT_PROMPT
    assert run.tokens == {p: reference[p] for p in run.tokens}


def flood_with_arrivals_at_layer_10(llm, run: Run, arrive) -> None:
    """Flood; once it decodes, mark the log and call ``arrive()`` at layer 10 of every forward
    pass (on the engine thread, in the middle of a step); waits for everything."""
    armed = threading.Event()

    def on_step(engine):
        if run.flood_is_decoding() and not armed.is_set():
            armed.set()
            run.log.append(("marker", None))

    def at_layer_10(module, args, output):
        if armed.is_set():
            arrive()

    hook = llm.model.model.layers[10].register_forward_hook(at_layer_10)
    try:
        run.engine.on_step = on_step
        run.start_flood()
        run.finish()
    finally:
        hook.remove()


def test_interactive_prompt_runs_between_the_layers_of_a_batch_step(llm, reference):
    """The chat request arrives while the flood's step is at layer 10 of 30; a flood request is
    cancelled at the same moment. The chat's first token comes before that step's tokens, the
    paused step's results are the same as unpaused, and the cancelled request's blocks come back."""
    run = Run(llm)
    cancelled = FLOOD_PROMPTS[0]

    def arrive():
        if CHAT_PROMPT not in run.tokens:
            run.submit(CHAT_PROMPT, "chat")
            run.engine.cancel(run.request_ids[cancelled])

    flood_with_arrivals_at_layer_10(llm, run, arrive)
    assert run.after_marker()[0] == CHAT_PROMPT
    assert run.reasons[cancelled] == "abort"
    assert run.tokens[cancelled] == reference[cancelled][:len(run.tokens[cancelled])]
    assert {p: run.tokens[p] for p in PROMPTS[1:5]} == {p: reference[p] for p in PROMPTS[1:5]}


def test_same_priority_tenant_within_its_fair_share_also_goes_first(llm, reference):
    """Both tenants interactive: the chat tenant has computed far fewer tokens than the flood (its
    counter starts level with the flood's when it turns busy), so its prompt goes first too."""
    run = Run(llm, flood_priority="interactive")
    chat_arrives_between_flood_steps(run)
    assert run.after_marker()[0] == CHAT_PROMPT
    assert run.tokens == {p: reference[p] for p in run.tokens}


@pytest.mark.parametrize("case", ["same tenant", "lower priority"])
def test_a_prompt_not_ahead_of_the_running_work_joins_the_next_step(llm, reference, case):
    """A new prompt of a tenant already running, or of a lower-priority tenant, is admitted into
    the next step with everyone's decodes (continuous batching), so their tokens come out first."""
    run = Run(llm, flood_priority="interactive", chat_priority="batch")
    if case == "same tenant":
        run.chat_tenant = "flood"
    chat_arrives_between_flood_steps(run)
    assert run.after_marker()[:len(FLOOD_PROMPTS) + 1] == [*FLOOD_PROMPTS, CHAT_PROMPT]
    assert run.tokens == {p: reference[p] for p in run.tokens}


def test_an_urgent_step_pauses_in_turn_for_a_newer_tenant(llm, reference):
    """The chat request pauses the flood's step at layer 10; a third tenant's request arrives at
    layer 10 of the chat's own step and pauses that one: first tokens come newest first."""
    run = Run(llm)
    run.num_requests += 1
    second = PROMPTS[5]

    def arrive():
        if CHAT_PROMPT not in run.tokens:
            run.submit(CHAT_PROMPT, "chat")
        elif second not in run.tokens:
            run.submit(second, "chat2")

    flood_with_arrivals_at_layer_10(llm, run, arrive)
    assert run.after_marker()[:3] == [second, CHAT_PROMPT, FLOOD_PROMPTS[0]]
    assert run.tokens == {p: reference[p] for p in run.tokens}
