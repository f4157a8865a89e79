"""Encoder models (models/bert.py) through the engine, against sentence-transformers and transformers:
tiny random BERT, XLM-RoBERTa and nomic-bert embedders and cross-encoders made here, a GGUF written
from the BERT one in llama.cpp's layout, and the batching rule beside a generating stream."""

import threading
from contextlib import contextmanager

import pytest
import torch
from encoder_models import (DOCUMENTS, QUERY, TEXTS, bert_embedder, cosines, cross_encoder, nomic_bert_embedder,
                            oracle_scores, oracle_vectors, write_bert_gguf, write_xlm_roberta_gguf,
                            xlm_roberta_embedder)

from gpushare.engine.embed_batch import PendingEmbed, take_batch
from gpushare.engine import embed_queue
from gpushare.engine.embed_queue import FIRST_BATCH_TOKENS, budget_tokens, layers_this_turn
from gpushare.engine.engine import Engine
from gpushare.protocol.engine_config import EngineConfig
from gpushare.protocol.request import EmbedRequest
from gpushare.models.loader import load_model
from gpushare.catalog.model_head import load_model_head, read_model_info


@contextmanager
def engine_with(loaded, name="enc", **config):
    """A started engine serving ``loaded`` (a LoadedModel, or a path to load) as ``name``."""
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=1 << 20, **config))
    engine.add_model(name, load_model(str(loaded)) if not hasattr(loaded, "tokenizer") else loaded)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def embed(engine: Engine, texts: list[str], name="enc") -> list[list[float]]:
    loaded = engine.encoders[name].loaded
    ids = [loaded.tokenizer.encode_input(t, loaded.config.context_length)[0] for t in texts]
    return engine.embed(engine.embed_request(name, ids)).result(timeout=120).tolist()


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return bert_embedder(tmp_path_factory.mktemp("enc") / "bert-mini")


@pytest.mark.parametrize("make", [bert_embedder, xlm_roberta_embedder, nomic_bert_embedder],
                         ids=["bert", "xlm-roberta", "nomic-bert"])
def test_vectors_equal_sentence_transformers(tmp_path, make):
    path = make(tmp_path / "model")
    with engine_with(path) as engine:
        vectors = embed(engine, TEXTS)  # one padded batch: inputs of different lengths
        alone = embed(engine, TEXTS[4:5])  # the shortest alone: padding beside longer inputs changed nothing
    assert min(cosines(vectors, oracle_vectors(path, TEXTS))) > 1 - 1e-5
    assert cosines(alone, vectors[4:5])[0] > 1 - 1e-6


def test_pooling_and_normalisation_follow_the_repo(tmp_path):
    path = bert_embedder(tmp_path / "cls", pooling="cls", normalize=False)
    head = load_model_head(str(path), "float32")
    assert (head.pooling.mode, head.pooling.normalize, head.kind) == ("cls", False, "embedding")
    with engine_with(path) as engine:
        vectors = embed(engine, TEXTS)
    expected = oracle_vectors(path, TEXTS)
    assert min(cosines(vectors, expected)) > 1 - 1e-5
    # Not normalised, as the repo has no Normalize module: the lengths are the oracle's too.
    assert torch.allclose(torch.tensor(vectors).norm(dim=1), torch.tensor(expected).norm(dim=1), rtol=1e-4)


def test_inputs_are_cut_to_max_seq_length_keeping_the_final_sep(bert):
    head = load_model_head(str(bert), "float32")
    assert head.config.context_length == 32  # sentence_bert_config.json's max_seq_length, not the 128 positions
    long_text = " ".join(["the river runs to the sea"] * 20)
    ids, full = head.tokenizer.encode_input(long_text, 32)
    assert len(ids) == 32 and full > 32 and ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    with engine_with(bert) as engine:
        (vector,) = embed(engine, [long_text])
    assert cosines([vector], oracle_vectors(bert, [long_text]))[0] > 1 - 1e-5


def test_inputs_tokenised_in_batches_are_those_of_one_at_a_time(bert):
    """The embed API tokenises many texts in batch calls (Tokenizer.encode_inputs, 256 a call): the same
    ids and uncut lengths as one by one, [CLS] ... [SEP] kept where an input is cut."""
    tokenizer = load_model_head(str(bert), "float32").tokenizer
    texts = (TEXTS + [" ".join(["the river runs to the sea"] * 20)]) * 50
    assert tokenizer.encode_inputs(texts, 32) == [tokenizer.encode_input(t, 32) for t in texts]


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_transformers(tmp_path, family):
    path = cross_encoder(tmp_path / "rerank", family)
    info = read_model_info(str(path))[2]
    assert info["kind"] == "rerank"
    with engine_with(path) as engine:
        tokenizer = engine.encoders["enc"].loaded.tokenizer
        pairs = tokenizer.encode_pairs([(QUERY, d) for d in DOCUMENTS], 128)
        request = EmbedRequest("enc", [p[0] for p in pairs], type_ids=[p[1] for p in pairs], task="score")
        scores = engine.embed(request).result(timeout=120)
    expected = oracle_scores(path, QUERY, DOCUMENTS)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert sorted(range(5), key=lambda i: -scores[i]) == sorted(range(5), key=lambda i: -expected[i])


def test_a_gguf_bert_gives_the_same_vectors(bert, tmp_path):
    gguf_path = write_bert_gguf(bert, tmp_path / "bert-mini.gguf", pooling_type=1)
    config, _, info = read_model_info(str(gguf_path))
    assert (config.arch, info["kind"], config.num_layers) == ("bert", "embedding", 2)
    from_gguf = load_model(str(gguf_path))
    from_hf = load_model(str(bert))
    for text in TEXTS:  # llama.cpp's phantom-space vocabulary tokenises as the repo's tokenizer.json
        assert from_gguf.tokenizer.encode_input(text, 128) == from_hf.tokenizer.encode_input(text, 128)
    with engine_with(from_gguf) as engine:
        vectors = embed(engine, TEXTS)
    assert min(cosines(vectors, oracle_vectors(bert, TEXTS))) > 1 - 1e-5


def test_a_gguf_nomic_bert_gives_the_same_vectors(tmp_path):
    path = nomic_bert_embedder(tmp_path / "nomic")
    gguf_path = write_bert_gguf(path, tmp_path / "nomic.gguf", arch="nomic-bert")
    loaded = load_model(str(gguf_path))
    assert (loaded.config.arch, loaded.config.rotary, loaded.kind) == ("nomic-bert", True, "embedding")
    with engine_with(loaded) as engine:
        vectors = embed(engine, TEXTS)
    assert min(cosines(vectors, oracle_vectors(path, TEXTS))) > 1 - 1e-5


def test_a_gguf_xlm_roberta_with_a_t5_vocabulary_gives_the_same_vectors(tmp_path):
    path = xlm_roberta_embedder(tmp_path / "xlmr")
    gguf_path = write_xlm_roberta_gguf(path, tmp_path / "xlmr.gguf", pooling_type=2)
    from_gguf, from_hf = load_model(str(gguf_path)), load_model(str(path))
    for text in TEXTS:  # the Unigram vocabulary and its scores tokenise as the repo's tokenizer.json
        assert from_gguf.tokenizer.encode_input(text, 120) == from_hf.tokenizer.encode_input(text, 120)
    with engine_with(from_gguf) as engine:
        vectors = embed(engine, TEXTS)
    # The GGUF's pooling_type (cls) and llama.cpp's normalising; the repo has no Normalize module: cosine.
    assert min(cosines(vectors, oracle_vectors(path, TEXTS))) > 1 - 1e-5


def test_a_gguf_pooling_type_cls_is_followed(bert, tmp_path):
    gguf_path = write_bert_gguf(bert, tmp_path / "bert-cls.gguf", pooling_type=2)
    loaded = load_model(str(gguf_path))
    assert (loaded.pooling.mode, loaded.pooling.normalize) == ("cls", True)


def _pending(lengths: list[int], name="m") -> PendingEmbed:
    from concurrent.futures import Future

    return PendingEmbed("r", name, "t", [[1] * n for n in lengths], None, "embed", Future())


def test_batches_fit_the_token_budget_first_come_first_served():
    a, b, c = _pending([10, 30, 5]), _pending([20, 20]), _pending([4], name="other")
    assert [(item is a, n) for item, n in take_batch([a, b, c], 64, padded=True)] == [(True, 2)]  # 3 x 30 > 64
    assert [(item, n) for item, n in take_batch([a, b, c], 65, padded=False)] == [(a, 3), (b, 1)]  # c: another model
    assert [(item, n) for item, n in take_batch([_pending([500]), a], 64, padded=True)][0][1] == 1  # one always


def test_beside_generating_streams_a_batch_takes_a_quarter_of_their_step():
    """Sized by time while streams generate: a quarter of 13 ms steps at 0.25 ms per token is 13 tokens."""
    assert budget_tokens(2048, None, 0.00025) == 400  # nothing generating: what fits 0.1 s
    assert budget_tokens(2048, None, 0.00001) == 2048  # ... at most the step's token budget
    assert budget_tokens(2048, None, None) == 2048  # not measured yet: the whole token budget
    assert budget_tokens(2048, 0.013, 0.00025) == 13
    assert budget_tokens(2048, 0.013, None) == 64  # not measured yet: a small first batch measures it
    assert budget_tokens(2048, 0.013, 1.0) == 1  # a slow model still moves on, an input a batch
    assert budget_tokens(16, 10.0, 0.00025) == 16  # a long step never lifts the token budget
    assert budget_tokens(2048, 0.013, 0.00025, turns=6) == 78  # a 6-layer encoder's batch spreads over turns


def test_beside_generating_streams_an_encoder_pass_runs_the_layers_that_fit_a_quarter_step():
    """One MiniLM input (6 layers, 16 tokens, 0.28 ms a token: 4.5 ms a pass) beside 4.85 ms SmolLM2
    steps: a layer a turn (0.75 ms), not the whole pass, which would double the stream's gaps."""
    assert layers_this_turn(6, 16, 0.00485, 0.00028) == 1
    assert layers_this_turn(6, 16, 0.013, 0.00028) == 4
    assert layers_this_turn(6, 16, None, 0.00028) == 6  # nothing generating: the whole pass
    assert layers_this_turn(6, 16, 0.00485, None) == 1  # not measured yet: one layer


def test_an_embedding_flood_never_holds_a_generating_stream_back_more_than_one_batch(bert, llm):
    """4,000 inputs beside a generation: between two of its steps at most one embedding batch runs."""
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=256))
    engine.add_model("chat", llm.model)
    engine.add_model("enc", load_model(str(bert)))
    encoder = engine.encoders["enc"]
    seen = []
    engine.on_step = lambda e: seen.append(encoder.steps)  # after each generation step
    engine.start()
    try:
        from gpushare import SamplingParams

        prompt = llm.model.tokenizer.encode("Tell me a long story.", add_special_tokens=True)
        done = threading.Event()
        engine.submit(engine.request("chat", prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)),
                      lambda out: done.set() if out.finished else None)
        ids = encoder.loaded.tokenizer.encode_input("the cat sat on the river bank", 32)[0]
        vectors = engine.embed(EmbedRequest("enc", [ids] * 4000)).result(timeout=600)
        assert len(vectors) == 4000 and vectors[0] == vectors[-1]
        assert done.wait(600)
    finally:
        engine.shutdown()
    batches_between_steps = [b - a for a, b in zip(seen, seen[1:])]
    assert max(batches_between_steps) == 1  # the two ran side by side, and never two batches in a row
    assert encoder.steps >= 4000 * len(ids) // 256  # the inputs shared steps by the token budget, not one each


def test_beside_a_stream_batches_are_sized_by_what_batches_beside_streams_cost(bert, llm, monkeypatch):
    """An idle flood's cost per token (big batches: cheap a token) never sizes a batch beside a stream: the
    first batch there is FIRST_BATCH_TOKENS, and its measured cost sizes the next ones, kept apart."""
    budgets = []

    def taking(pending, budget, padded):
        budgets.append(budget)
        return take_batch(pending, budget, padded)

    monkeypatch.setattr(embed_queue, "take_batch", taking)
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=2048))
    engine.add_model("chat", llm.model)
    engine.add_model("enc", load_model(str(bert)))
    engine.start()
    try:
        from gpushare import SamplingParams

        ids = engine.encoders["enc"].loaded.tokenizer.encode_input("the cat sat on the river bank", 32)[0]
        engine.embed(EmbedRequest("enc", [ids] * 1000)).result(timeout=600)  # idle: measures big batches
        idle_batches = len(budgets)
        prompt = llm.model.tokenizer.encode("Tell me a long story.", add_special_tokens=True)
        first_token, done = threading.Event(), threading.Event()
        engine.submit(engine.request("chat", prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)),
                      lambda out: (first_token.set(), out.finished and done.set()))
        assert first_token.wait(120)
        engine.embed(EmbedRequest("enc", [ids] * 200)).result(timeout=600)
        assert not done.is_set(), "the stream ended before the flood beside it: make it longer"
    finally:
        engine.shutdown()
    assert budgets[:idle_batches] == [2048] * idle_batches  # idle: whole steps' token budgets
    assert budgets[idle_batches] == FIRST_BATCH_TOKENS  # beside the stream: not sized by the idle cost
    assert engine.embeds.seconds_per_token.keys() == {("enc", False), ("enc", True)}  # the two costs, apart


def test_a_cancelled_embedding_runs_no_more_batches(bert):
    """A client that leaves cancels its future (asyncio.wrap_future does): its inputs not yet run are dropped."""
    with engine_with(bert, max_num_batched_tokens=64) as engine:
        encoder = engine.encoders["enc"]
        ids = encoder.loaded.tokenizer.encode_input("the cat sat on the river bank", 32)[0]
        future = engine.embed(EmbedRequest("enc", [ids] * 20_000))  # about 3,000 batches of 7 inputs
        for _ in range(600):
            if encoder.steps:
                break
            threading.Event().wait(0.05)
        assert future.cancel()
        steps_at_cancel = encoder.steps
        assert len(embed(engine, TEXTS[:1])) == 1  # the loop has moved on past the cancelled request
        assert engine.embeds.pending == []
        assert encoder.steps - steps_at_cancel < 100
