"""The fused path (models/fused_decode.py, kernels/cpu_decode.cpp): a step run a few layers a C++ call,
decode rows alone or with prompt chunks, with LoRA adapter rows or without, gives the same bits as layer
by layer, pauses and resumes, and stays out of the models it does not take."""

import pytest
import torch

from gpushare import LLM, SamplingParams
from gpushare.kernels.paged_attention_torch import Int8KV
from gpushare.models import fused_decode
from gpushare.models.llama import AttentionBatch
from gpushare.models.loader import load_model
from gpushare.models.lora import LoraAdapter, target_shape
from gpushare.models.pause_signal import PauseSignal
from kernel_choice import use_cpu_kernel
from model_files import random_llama_folder

BLOCK_SIZE = 16
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


@pytest.fixture
def blocks(monkeypatch, request):
    use_cpu_kernel("blocks", monkeypatch, request)


def decode_inputs(model, contexts: list[int], kv_dtype=torch.float32, seed: int = 0):
    """A decode step of one token per sequence over ``contexts`` cached tokens (random K/V): the
    model's inputs and its caches."""
    config, gen = model.config, torch.Generator().manual_seed(seed)
    width = max(contexts) // BLOCK_SIZE + 1
    shape = (len(contexts) * width, BLOCK_SIZE, config.num_kv_heads, config.head_dim)

    def cache():
        if kv_dtype == torch.int8:
            return Int8KV(torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen),
                          torch.rand(shape[:3], generator=gen) / 50)
        return torch.randn(shape, generator=gen).to(kv_dtype)

    caches = [(cache(), cache()) for _ in range(config.num_layers)]
    tables = torch.arange(len(contexts) * width, dtype=torch.int32).view(len(contexts), width)
    lens = torch.tensor(contexts, dtype=torch.int32)
    slots = tables[torch.arange(len(contexts)), (lens - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (lens - 1) % BLOCK_SIZE
    none = torch.zeros(0, dtype=torch.int32)
    batch = AttentionBatch(slots, 0, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), none,
                           tables, lens)
    ids = torch.randint(0, 1000, (len(contexts),), generator=gen)
    return ids, lens.long() - 1, caches, batch


def mixed_inputs(model, seed: int = 0):
    """A step of two prompt chunks (20 rows after a cached prefix of 30; a fresh prompt of 12) and two
    decode rows (over 37 and 200 cached tokens), random K/V in the caches."""
    ids, positions, caches, batch = decode_inputs(model, [50, 12, 37, 200], seed=seed)
    tables, bs = batch.decode_block_tables, BLOCK_SIZE
    chunk_positions = torch.cat([torch.arange(30, 50), torch.arange(0, 12)])
    chunk_tables = torch.cat([tables[0:1].expand(20, -1), tables[1:2].expand(12, -1)])
    slots = torch.cat([chunk_tables[torch.arange(32), chunk_positions // bs].long() * bs + chunk_positions % bs,
                       batch.slot_mapping[2:]])
    mixed = AttentionBatch(slots, 32, tables[:2], torch.tensor([0, 20, 32], dtype=torch.int32),
                           torch.tensor([50, 12], dtype=torch.int32), tables[2:], batch.decode_context_lens[2:])
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, 1000, (34,), generator=gen), torch.cat([chunk_positions, positions[2:]]), caches, mixed


def copied(caches):
    def one(c):
        return Int8KV(c.data.clone(), c.scale.clone()) if isinstance(c, Int8KV) else c.clone()
    return [(one(k), one(v)) for k, v in caches]


def flat(caches):
    return [t for pair in caches for c in pair for t in ((c.data, c.scale) if isinstance(c, Int8KV) else (c,))]


def step(model, fused: bool, ids, positions, caches, batch, should_pause=None):
    """Final hidden states of one decode step; ``should_pause`` as the engine's (resumed until done)."""
    model.fused_decode = fused
    state = model.start(ids, positions, batch)
    while not model.run_layers(state, caches, should_pause):
        pass
    return model.finish(state)


@pytest.mark.usefixtures("blocks")
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_fused_decode_gives_the_layer_by_layer_bits(smollm2_path, weights, kv_dtype):
    model = load_model(smollm2_path, weights=weights).model
    ids, positions, caches, batch = decode_inputs(model, [1, 37, 200, 16], kv_dtype)
    fused_caches = copied(caches)
    expected = step(model, False, ids, positions, caches, batch)
    assert model._decode_weights is False  # layer by layer never gathers them
    got = step(model, True, ids, positions, fused_caches, batch)
    assert model._decode_weights is not None  # SmolLM2 on the block kernel: it took the fused path
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(flat(fused_caches), flat(caches)))  # the same K/V written
    alone = step(model, True, ids[2:3], positions[2:3], copied(caches), AttentionBatch(
        batch.slot_mapping[2:3], 0, batch.prefill_block_tables, batch.prefill_cu_seqlens, batch.prefill_context_lens,
        batch.decode_block_tables[2:3], batch.decode_context_lens[2:3]))
    assert torch.equal(alone[0], got[2])  # a row's bits do not depend on its neighbours


@pytest.mark.usefixtures("blocks")
@pytest.mark.parametrize("rows", [33, 64])
def test_a_wide_step_split_among_the_threads_gives_the_layer_by_layer_bits(smollm2_path, rows):
    """Wide enough that torch splits its own elementwise ops between the two threads (mid-row at an
    odd row count), and that the team (cpu_team.h) shares every phase: the bits are still theirs."""
    torch.set_num_threads(2)
    model = load_model(smollm2_path, weights="int4").model
    ids, positions, caches, batch = decode_inputs(model, [5 + 7 * i for i in range(rows)], torch.bfloat16)
    fused_caches = copied(caches)
    expected = step(model, False, ids, positions, caches, batch)
    got = step(model, True, ids, positions, fused_caches, batch)
    assert model._decode_weights is not None
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(flat(fused_caches), flat(caches)))


def random_adapter(model, name: str, rank: int, seed: int, targets=TARGETS) -> LoraAdapter:
    """An adapter of ``rank`` on every layer's ``targets`` of ``model``, random but seeded, not small."""
    gen = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(name, rank, 2.0)
    for layer in range(model.config.num_layers):
        for target in targets:
            out_features, in_features = target_shape(model.config, target)
            adapter.weights[layer, target] = (torch.randn(rank, in_features, generator=gen) / 10,
                                              torch.randn(out_features, rank, generator=gen) / 10)
    return adapter


@pytest.mark.usefixtures("blocks")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_step_with_adapter_rows_gives_the_layer_by_layer_bits(smollm2_path, weights, monkeypatch):
    """Rows of two adapters (ranks 8 and 16, one on the attention alone) and a base row, in one fused call."""
    model = load_model(smollm2_path, weights=weights).model
    table = model.adapter_table("base")
    table.add(random_adapter(model, "eight", 8, seed=1))
    table.add(random_adapter(model, "sixteen", 16, seed=2, targets=["q", "k", "v", "o"]))
    # a quantized base's adapters are stored (and counted) in bfloat16
    assert {t.dtype for t in table.a_stacks + table.b_stacks} == {torch.bfloat16}
    assert table.nbytes("eight") == 2 * model.config.num_layers * 8 * sum(
        sum(target_shape(model.config, t)) for t in TARGETS)
    ids, positions, caches, batch = decode_inputs(model, [1, 37, 200, 16])
    batch.lora_slots = torch.tensor([0, -1, 1, 0], dtype=torch.int32)
    calls = []
    real = fused_decode.kernels.decode_layers
    monkeypatch.setattr(fused_decode.kernels, "decode_layers", lambda *a, **k: calls.append(k) or real(*a, **k))
    fused_caches = copied(caches)
    expected = step(model, False, ids, positions, caches, batch)
    got = step(model, True, ids, positions, fused_caches, batch)
    assert calls and all(len(k["lora_a"]) == 7 * model.config.num_layers for k in calls)  # it took the fused call
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(flat(fused_caches), flat(caches)))
    batch.lora_slots = None
    base = step(model, True, ids, positions, copied(caches), batch)
    assert torch.equal(base[1], got[1]) and not torch.equal(base[0], got[0])  # the adapters did something


def head_logits(model, ids, positions, caches, batch, rows: list[int], should_pause=None):
    """The fused path's logits of ``rows`` (its call with the last layer runs the final norm and LM head)
    and the layer by layer path's, from the same inputs."""
    model.fused_decode = False
    state = model.start(ids, positions, batch)
    model.run_layers(state, copied(caches))
    expected = model.logits(model.finish(state), torch.tensor(rows))
    model.fused_decode = True
    state = model.start(ids, positions, batch)
    state.logit_rows = torch.tensor(rows)
    while not model.run_layers(state, copied(caches), should_pause):
        assert state.logits is None  # only the call that ends with the last layer runs the head
    return state.logits, expected


@pytest.mark.usefixtures("blocks")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_fused_head_gives_the_lm_heads_bits(smollm2_path, weights, monkeypatch):
    """The rows that sample, a few of a step's (a wide one's, whose threads share the head), with
    adapter rows (the call kernel by kernel), and across a pause between calls."""
    torch.set_num_threads(2)
    model = load_model(smollm2_path, weights=weights).model
    ids, positions, caches, batch = decode_inputs(model, [5 + 7 * i for i in range(33)])
    got, expected = head_logits(model, ids, positions, caches, batch, [0, 7, 32])
    assert model._decode_weights.head is not None  # SmolLM2's tied int8 LM head is on the block kernel
    assert got.shape == (3, model.config.vocab_size) and torch.equal(got, expected)
    ids, positions, caches, batch = decode_inputs(model, [1, 37, 200, 16])
    got, expected = head_logits(model, ids, positions, caches, batch, [2])
    assert torch.equal(got, expected)
    table = model.adapter_table("base")
    table.add(random_adapter(model, "eight", 8, seed=1))
    batch.lora_slots = torch.tensor([0, -1, 0, 0], dtype=torch.int32)
    got, expected = head_logits(model, ids, positions, caches, batch, [0, 1, 3])
    assert torch.equal(got, expected)
    batch.lora_slots = None
    monkeypatch.setattr(fused_decode, "LAYERS_PER_CALL", 7)
    got, expected = head_logits(model, ids, positions, caches, batch, [3, 0], should_pause=lambda: True)
    assert torch.equal(got, expected)


@pytest.mark.usefixtures("blocks")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_step_with_prompt_chunks_gives_the_layer_by_layer_bits(smollm2_path, kv_dtype):
    model = load_model(smollm2_path, weights="int4").model
    ids, positions, caches, batch = mixed_inputs(model)
    caches = [(k.to(kv_dtype), v.to(kv_dtype)) for k, v in caches]
    fused_caches = copied(caches)
    expected = step(model, False, ids, positions, caches, batch)
    got = step(model, True, ids, positions, fused_caches, batch)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(flat(fused_caches), flat(caches)))
    # the fresh prompt's rows alone, as a step of their own: the same bits
    alone_batch = AttentionBatch(batch.slot_mapping[20:32], 12, batch.prefill_block_tables[1:2],
                                 torch.tensor([0, 12], dtype=torch.int32), torch.tensor([12], dtype=torch.int32),
                                 torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    alone = step(model, True, ids[20:32], positions[20:32], copied(caches), alone_batch)
    assert torch.equal(alone, got[20:32])


@pytest.mark.usefixtures("blocks")
def test_sliding_windows_and_a_pause_between_calls_keep_the_bits(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(fused_decode, "LAYERS_PER_CALL", 5)  # 7 layers: two calls, a pause between
    folder = random_llama_folder(smollm2_path, str(tmp_path / "tiny"), layers=7, hidden=128, inter=256)
    model = load_model(folder, weights="int8").model
    for i, layer in enumerate(model.layers):
        layer.self_attn.window = [0, 5, 20][i % 3]
    ids, positions, caches, batch = decode_inputs(model, [3, 40, 90], seed=1)
    expected = step(model, False, ids, positions, copied(caches), batch)
    assert torch.equal(step(model, True, ids, positions, copied(caches), batch), expected)

    pauses = []
    state = model.start(ids, positions, batch)
    model.fused_decode = True
    while not model.run_layers(state, caches, lambda: pauses.append(state.next_layer) or True):
        pass
    assert pauses == [fused_decode.LAYERS_PER_CALL]  # 7 layers: one pause, after the first call
    assert torch.equal(model.finish(state), expected)


@pytest.mark.usefixtures("blocks")
def test_the_engines_pause_signal_stops_a_whole_step_call_after_a_layer(smollm2_path):
    """Given a PauseSignal a call stops after the layer during which the signal was set (and a step
    of several calls goes on while it is not); resumed, it ends with the uninterrupted step's bits."""
    model = load_model(smollm2_path, weights="int4").model
    ids, positions, caches, batch = decode_inputs(model, [3, 40, 90], torch.bfloat16, seed=2)
    expected = step(model, False, ids, positions, copied(caches), batch)
    signal = PauseSignal()
    model.fused_decode = True
    state = model.start(ids, positions, batch)
    assert model.run_layers(state, caches, signal)  # not set: the whole step, no pause
    assert torch.equal(model.finish(state), expected)

    caches = copied(caches)
    state = model.start(ids, positions, batch)
    signal.set()
    assert not model.run_layers(state, caches, signal)
    assert state.next_layer == 1  # set before the call: it stops after the first layer
    signal.clear()
    assert model.run_layers(state, caches, signal)
    assert torch.equal(model.finish(state), expected)


@pytest.mark.usefixtures("blocks")
def test_served_answers_are_the_same_with_and_without_it(smollm2_path, monkeypatch):
    """Through the engine: the same greedy tokens and log-probabilities, bit for bit, with the fused
    call taking the decode steps."""
    calls = []
    real = fused_decode.kernels.decode_layers
    monkeypatch.setattr(fused_decode.kernels, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(smollm2_path, weights="int4", num_threads=2, enable_prefix_caching=False)
    prompts = [[{"role": "user", "content": f"Write a short poem about the number {i}."}] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    try:
        answers = {}
        for fused in (False, True):
            llm.model.model.fused_decode = fused
            calls.clear()
            answers[fused] = [(o.token_ids, o.logprobs) for o in llm.chat(prompts, params)]
            assert bool(calls) == fused
    finally:
        llm.shutdown()
    assert answers[True] == answers[False]


def test_models_it_does_not_fit_run_layer_by_layer(smollm2_path, tmp_path, monkeypatch, request):
    # a tiny model: loading SmolLM2 three times took ~15 s
    tiny = random_llama_folder(smollm2_path, str(tmp_path / "tiny"), hidden=128, inter=256)
    use_cpu_kernel("torch", monkeypatch, request)
    assert fused_decode.decode_weights(load_model(tiny, weights="int8").model) is None  # torch's kernel
    use_cpu_kernel("blocks", monkeypatch, request)
    assert fused_decode.decode_weights(load_model(tiny, weights="float32").model) is None  # dense
    model = load_model(tiny, weights="int8").model
    model.layers[1].self_attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(256), requires_grad=False)
    assert fused_decode.decode_weights(model) is None  # a bias the C++ call does not add
    model.layers[1].self_attn.qkv_proj.bias = None
    assert fused_decode.decode_weights(model) is not None
    ids, positions, caches, batch = decode_inputs(model, [5, 9])
    monkeypatch.setenv("GPUSHARE_KERNELS", "torch")  # no C++: layer by layer, the same answer
    state = model.start(ids, positions, batch)
    assert fused_decode.run(fused_decode.decode_weights(model), state, caches) is None and state.next_layer == 0
