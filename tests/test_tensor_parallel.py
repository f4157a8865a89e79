"""Tensor parallelism: how a model splits over N ranks, and SmolLM2 over two CPU worker processes
(torch.distributed gloo) answering as one device does."""

import io
import pickle
import threading
import time
from types import SimpleNamespace

import pytest

from gpushare import SamplingParams
from gpushare.protocol.engine_config import EngineConfig
from gpushare.protocol.request import GenerationRequest
from gpushare.protocol.messages import GroupSpec, WorkerSpec
from gpushare.catalog.model_config import ModelConfig
from gpushare.catalog.model_head import read_model_info
from gpushare.catalog.tensor_split import split_model
from gpushare.residency.group_client import GroupClient
from gpushare.residency.worker_client import WorkerClient
from tests.test_oracle import PROMPTS

TP_PROMPTS = PROMPTS + ["What is the boiling point of water at sea level?", "Name three planets of the solar system."]
NEW_TOKENS = 24
KV_BYTES = 64 << 20


def _config(heads: int, kv_heads: int, intermediate: int = 1536) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=100, hidden_size=heads * 64, intermediate_size=intermediate,
                       num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, context_length=256)


def test_smollm2_splits_in_whole_kv_groups(smollm2_path):
    config, _, _ = read_model_info(smollm2_path)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (9, 3, 1536)
    two = split_model(config, 2)
    assert [(p.kv_heads, p.q_heads, p.mlp) for p in two] == [((0, 2), (0, 6), (0, 768)), ((2, 3), (6, 9), (768, 1536))]
    three = split_model(config, 3)
    assert [p.kv_heads for p in three] == [(0, 1), (1, 2), (2, 3)]
    assert [p.q_heads for p in three] == [(0, 3), (3, 6), (6, 9)]


class NoTorch(pickle.Unpickler):
    """Unpickles what names no torch class: no tensor, so no device, is in the bytes."""

    def find_class(self, module, name):
        assert not module.startswith("torch"), f"{module}.{name} in a tensor-parallel message"
        return super().find_class(module, name)


def test_a_forward_message_carries_host_arrays_and_lands_on_the_receivers_device():
    """A pickled CUDA tensor unpickles onto the device index it left, another rank's GPU: the bytes
    between ranks hold host arrays, and the receiver puts them on its own device ("meta" stands in
    for a GPU here: any device but the host)."""
    import torch

    from gpushare.engine.tp_runtime import Forward, Logits, decode_op, encode_op
    from gpushare.models.llama import AttentionBatch

    i32 = torch.int32
    batch = AttentionBatch(slot_mapping=torch.arange(5), num_prefill_tokens=3,
                           prefill_block_tables=torch.tensor([[4, 7]], dtype=i32),
                           prefill_cu_seqlens=torch.tensor([0, 3], dtype=i32),
                           prefill_context_lens=torch.tensor([3], dtype=i32),
                           decode_block_tables=torch.tensor([[2], [9]], dtype=i32),
                           decode_context_lens=torch.tensor([5, 1], dtype=i32),
                           lora_slots=torch.tensor([-1] * 5, dtype=i32))
    for op in (Forward("m", torch.tensor([11, 12, 13, 14, 15]), torch.tensor([0, 1, 2, 4, 0]), batch),
               Logits("m", torch.tensor([2, 3, 4]))):
        data = encode_op(op)
        NoTorch(io.BytesIO(data)).load()
        sent, on_host, elsewhere = (tensors_of(o) for o in (op, decode_op(data, "cpu"), decode_op(data, "meta")))
        assert len(sent) == len(on_host) == len(elsewhere) >= 1
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(sent, on_host))
        assert all(t.device.type == "meta" and t.shape == a.shape for t, a in zip(elsewhere, sent))


def tensors_of(op) -> list:
    import torch

    fields = vars(op) | (vars(op.batch) if hasattr(op, "batch") else {})
    return [v for v in fields.values() if isinstance(v, torch.Tensor)]


def test_fewer_kv_heads_than_ranks_replicates_them():
    parts = split_model(_config(32, 8), 16)
    assert [p.kv_heads for p in parts[:4]] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.q_heads for p in parts[:3]] == [(0, 2), (2, 4), (4, 6)]


@pytest.mark.parametrize("heads, kv_heads, n, says", [
    (9, 3, 4, "tensor_parallel 4 cannot split its 9 attention heads (3 KV heads)"),
    (9, 3, 6, "quotient divides the 3 query heads"),
    (8, 8, 2, "less than 32 MLP channels per rank"),
])
def test_splits_that_cannot_work_are_refused_by_name(heads, kv_heads, n, says):
    intermediate = 48 if "MLP" in says else 1536
    with pytest.raises(ValueError, match="smol: tensor_parallel") as err:
        split_model(_config(heads, kv_heads, intermediate), n, "smol")
    assert says in str(err.value)


@pytest.fixture(scope="module")
def served(smollm2_path):
    """SmolLM2 in float32 over two worker processes, one CPU each."""
    devices = ["cpu:0", "cpu:1"]
    # An idle model gives its KV slabs back after 1 s: on every rank (the Decommit op).
    config = {"device": "cpu", "num_threads": 1, "kv_cache_bytes": KV_BYTES, "kv_idle_release_s": 1.0,
              "weights": "float32"}  # the exact path, float32 KV included, as the single-device llm
    ranks = [WorkerClient(WorkerSpec(name, EngineConfig(cpus=[i], **config), GroupSpec(i, 2, "", devices)), {}, KV_BYTES)
             for i, name in enumerate(devices)]
    client = GroupClient(ranks)
    client.start()
    head, _, _ = client.load("smol", smollm2_path, "float32", "float32", 1.0, None, None, ("smol",))
    yield SimpleNamespace(client=client, head=head)
    client.shutdown()


@pytest.fixture
def group(served):
    return served.client


def _generate(client, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    """Submit every prompt at once; each answer's outputs."""
    outputs = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i):
        def on_output(out):
            outputs[i].append(out)
            if out.finished:
                done[i].set()
        return on_output

    for i, ids in enumerate(prompts):
        client.submit(GenerationRequest("smol", ids, params), sink(i))
    for event in done:
        assert event.wait(120)
    return outputs


def _prompt_ids(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(llm.model.render_chat([{"role": "user", "content": p}])) for p in TP_PROMPTS]


def _tokens(outputs) -> list[int]:
    assert outputs[-1].finish_reason in ("length", "stop"), outputs[-1].error
    return [t for out in outputs for t in out.token_ids]


def _logprobs(outputs) -> list:
    return [lp for out in outputs for lp in (out.logprobs or [])]


@pytest.mark.slow  # ~20 s; test_tensor_parallel_daemon checks a group's answers against the oracle by default
def test_two_ranks_answer_as_one_device_alone_and_in_a_batch(group, llm):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=5)
    prompts = _prompt_ids(llm)
    single = llm.generate(prompts, params)
    alone = [_generate(group, [ids], params)[0] for ids in prompts]
    batch = _generate(group, prompts, params)
    for run in (alone, batch):
        same = [_tokens(out) == s.token_ids for out, s in zip(run, single)]
        assert sum(same) >= 9, f"token for token: {same}"
        for out, s, equal in zip(run, single, same):
            if not equal:
                continue
            for ours, theirs in zip(_logprobs(out), s.logprobs):
                assert ours.token_id == theirs.token_id
                assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
                assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
                for (_, a), (_, b) in zip(ours.top, theirs.top):
                    assert a == pytest.approx(b, abs=1e-4)


def test_forked_answers_copy_their_kv_on_every_rank(group, llm):
    """n = 2: answer 1 forks from answer 0 after the prefill, copying the shared partial KV block
    (a CopyBlock op on the other rank); greedy, both answers are the single device's one."""
    prompt = _prompt_ids(llm)[4]
    single = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0].token_ids
    answers: dict[int, list[int]] = {0: [], 1: []}
    finished = threading.Semaphore(0)

    def on_output(out):
        answers[out.index].extend(out.token_ids)
        if out.finished:
            assert out.finish_reason in ("length", "stop"), out.error
            finished.release()

    group.submit(GenerationRequest("smol", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, n=2)),
                 on_output)
    assert finished.acquire(timeout=120) and finished.acquire(timeout=120)
    assert answers == {0: single, 1: single}


def test_answers_stay_exact_after_every_rank_gave_its_idle_kv_back(group, llm):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    prompt = _prompt_ids(llm)[2]
    _generate(group, [prompt], params)
    deadline = time.monotonic() + 30
    while group.stats().kv_committed_bytes and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group.stats().kv_committed_bytes == 0  # the first rank's slabs went back, and a Decommit op out
    assert _tokens(_generate(group, [prompt], params)[0]) == llm.generate([prompt], params)[0].token_ids


def test_a_warm_model_comes_back_on_every_rank(served, llm, smollm2_path):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    prompt, group = _prompt_ids(llm)[3], served.client
    kept = group.unload("smol", served.head, ("smol-warm",))
    assert kept is served.head
    served.head, _, warm = group.load("smol", smollm2_path, "float32", "float32", 1.0, None, kept, ("smol-warm",))
    assert warm is True  # every rank took its part from its own warm tier
    assert _tokens(_generate(group, [prompt], params)[0]) == llm.generate([prompt], params)[0].token_ids
