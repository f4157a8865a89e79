"""For people switching from Ollama, against a live daemon: their model store, Modelfiles, `cp`,
context truncation and /api/show, through the official `ollama` client and the `gpushare` CLI.

The store is a real Ollama layout in a temp folder built from the SmolLM2 GGUF (manifests,
`sha256-…` blobs, params/system/template/license layers), plus a broken manifest and one
whose blob is missing. Answers are compared with the offline LLM (greedy).
"""

import json
import subprocess

import ollama
import pytest
from daemon_fixture import GPUSHARE, MODEL, http, serving
from ollama_store_fixture import add_model, tree_digest

from gpushare import SamplingParams
from gpushare.catalog.modelfile import parse_modelfile

SYSTEM = "You are a helpful assistant who answers in one short sentence."
QUESTION = "What is the capital of France?"
CONFIG_NUM_CTX = 2048


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2_path, served_llm):
    """The Ollama store, with a stop string taken from the greedy answer itself (so it must cut it)."""
    root = tmp_path_factory.mktemp("ollama-store")
    full = served_llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                           SamplingParams(temperature=0, max_tokens=24))[0].text
    words = full.split()
    stop = words[len(words) // 2]
    gguf = open(smollm2_path, "rb").read()
    add_model(root, "smolpet", "latest", gguf, {
        # an option from a newer Ollama is logged and ignored, not worth losing the model over
        "params": {"stop": [stop], "temperature": 0, "num_predict": 24, "some_future_option": 1}, "system": SYSTEM,
        "template": "{{ .System }} {{ .Prompt }}", "license": "Apache 2.0 (test)"})
    add_model(root, "shadow", "latest", gguf, {"system": "from the store"})  # the config's shadow:latest wins
    add_model(root, "tiny", "q4", gguf, {}, namespace="someone")
    broken = add_model(root, "broken", "latest", gguf, {})
    broken.write_text('{"schemaVersion": 2,\n "layers": [oops]}')
    missing = add_model(root, "missing", "latest", gguf, {"system": "never read"})
    doc = json.loads(missing.read_text())
    doc["layers"][1]["digest"] = "sha256:" + "0" * 64
    missing.write_text(json.dumps(doc))
    return {"root": root, "before": tree_digest(root), "answer": full[:full.index(stop)], "stop": stop,
            "broken": broken, "missing": missing}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, smollm2_path, store):
    overrides = {"models": [{"name": MODEL, "path": smollm2_path, "preload": True,
                             "options": {"num_ctx": CONFIG_NUM_CTX}},
                            {"name": "shadow:latest", "path": smollm2_path}]}
    with serving(tmp_path_factory.mktemp("compat"), smollm2_path, overrides,
                 env={"OLLAMA_MODELS": str(store["root"])}) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url, timeout=300)


def gpushare(daemon, *args, cwd=None):
    return subprocess.run([str(GPUSHARE), *args], capture_output=True, text=True, env=daemon.env(), timeout=300,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def test_the_store_lists_as_ollama_names_and_broken_manifests_are_named(client, daemon, store):
    names = {m.model for m in client.list().models}
    assert {"smolpet:latest", "someone/tiny:q4", "shadow:latest", MODEL} <= names
    assert not names & {"broken:latest", "missing:latest"}
    log = daemon.log()
    assert f"{store['broken']}:2: not valid JSON" in log  # the file and the line
    assert f"{store['missing']}: the system layer's blob is missing" in log
    assert "ignoring the unknown parameter 'some_future_option'" in log
    r = gpushare(daemon, "list")
    assert r.returncode == 0 and "smolpet:latest" in r.stdout and "someone/tiny:q4" in r.stdout
    assert f"skipped: {store['broken']}:2: not valid JSON" in r.stderr
    assert f"skipped: {store['missing']}: the system layer's blob is missing" in r.stderr


def test_a_store_model_answers_with_its_system_prompt_and_stop_string(client, store):
    r = client.chat("smolpet", messages=[{"role": "user", "content": QUESTION}])
    assert r.message.content == store["answer"]
    assert r.done_reason == "stop"
    # a request's own options win over the model's: without the stop string the answer runs on
    longer = client.chat("smolpet", messages=[{"role": "user", "content": QUESTION}], options={"stop": ["@@"]})
    assert longer.message.content.startswith(store["answer"] + store["stop"])


def show_system(daemon, model: str) -> str:
    """/api/show's `system` (the ollama 0.6 client's ShowResponse drops it)."""
    return http("POST", daemon.url + "/api/show", {"model": model})[1]["system"]


def test_the_openai_dialect_uses_the_same_presets(daemon, store):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=300)
    r = client.chat.completions.create(model="smolpet:latest", messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].message.content == store["answer"] and r.choices[0].finish_reason == "stop"


def test_show_returns_the_store_models_parameters(client, daemon, store):
    shown = client.show("smolpet")
    assert f'stop                           "{store["stop"]}"' in shown.parameters
    assert "temperature                    0" in shown.parameters
    assert shown.license == "Apache 2.0 (test)" and show_system(daemon, "smolpet") == SYSTEM
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert shown.modelinfo["tokenizer.ggml.tokens"] is None  # arrays only with verbose
    assert "<|im_start|>" in shown.template  # the GGUF's own Jinja template, not the store's Go one
    parsed = parse_modelfile(shown.modelfile)
    digest = next(m.digest for m in client.list().models if m.model == "smolpet:latest")
    assert parsed.base == str(store["root"] / "blobs" / f"sha256-{digest}")
    assert parsed.preset.options == {"stop": [store["stop"]], "temperature": 0.0, "num_predict": 24}
    verbose = http("POST", daemon.url + "/api/show", {"model": "smolpet", "verbose": True})[1]
    assert len(verbose["model_info"]["tokenizer.ggml.tokens"]) == 49152
    assert {"name": "output_norm.weight", "type": "F32", "shape": [576]} in verbose["tensors"]


def test_the_config_wins_a_name_clash_and_the_store_is_never_removed(client, daemon):
    assert show_system(daemon, "shadow") == ""
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("smolpet")
    assert info.value.status_code == 400 and "ollama rm smolpet:latest" in info.value.error


def test_create_takes_a_blob_without_gguf_suffix(daemon, store, tmp_path):
    blob = next(p for p in (store["root"] / "blobs").iterdir() if p.stat().st_size > 1 << 20)
    r = gpushare(daemon, "create", "fromblob", "--from", str(blob))
    assert r.returncode == 0, r.stderr
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello")
    r = gpushare(daemon, "create", "bad", "--from", str(not_gguf))
    assert r.returncode == 1 and "neither a GGUF file" in r.stderr
    r = gpushare(daemon, "rm", "fromblob")
    assert r.returncode == 0, r.stderr


MODELFILE = '''# a pet that answers greedily
FROM {path}
PARAMETER temperature 0
PARAMETER num_predict 6
parameter stop "<|im_end|>"
SYSTEM """You are a pirate.
Answer briefly."""
MESSAGE user Hello
MESSAGE assistant Ahoy!
LICENSE "MIT"
'''


def test_modelfile_round_trip_and_its_parameters_under_the_request(client, daemon, served_llm, smollm2_path,
                                                                   tmp_path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(MODELFILE.format(path=smollm2_path))
    (tmp_path / "Other").write_text(f"FROM {smollm2_path}\nPARAMETER seed 3\n")
    r = gpushare(daemon, "create", "pirate", "-f", str(modelfile))
    assert r.returncode == 0, r.stderr
    r = gpushare(daemon, "show", "pirate", "--modelfile")
    assert r.returncode == 0, r.stderr
    assert parse_modelfile(r.stdout).preset == parse_modelfile(modelfile.read_text()).preset
    # a copy printed by show rebuilds the same model
    (tmp_path / "Again").write_text(r.stdout)
    assert gpushare(daemon, "create", "pirate2", "-f", str(tmp_path / "Again")).returncode == 0
    assert client.show("pirate2").parameters == client.show("pirate").parameters
    # creating an existing name of ours replaces it, as `ollama create` does; a store model's name is refused
    assert gpushare(daemon, "create", "pirate2", "-f", str(tmp_path / "Other")).returncode == 0
    assert client.show("pirate2").parameters == "seed                           3"
    r = gpushare(daemon, "create", "smolpet:latest", "-f", str(tmp_path / "Other"))
    assert r.returncode == 1 and "cannot be replaced" in r.stderr and "ollama rm" in r.stderr

    chat = [{"role": "system", "content": "You are a pirate.\nAnswer briefly."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Ahoy!"}, {"role": "user", "content": "Where is the treasure?"}]
    expected = served_llm.chat(chat, SamplingParams(temperature=0, max_tokens=6, stop=["<|im_end|>"]))[0]
    r = client.chat("pirate", messages=[chat[-1]])
    assert r.message.content == expected.text and r.eval_count == len(expected.token_ids)
    r = client.chat("pirate", messages=[chat[-1]], options={"num_predict": 3})  # the request's option wins
    assert r.eval_count == 3
    # replaced while loaded: the next request has the new presets (no system prompt, no MESSAGEs) at once
    assert "pirate" in daemon.loaded()
    assert gpushare(daemon, "create", "pirate", "-f", str(tmp_path / "Other")).returncode == 0
    plain = client.chat(MODEL, messages=[chat[-1]], options={"num_predict": 1})
    assert client.chat("pirate", messages=[chat[-1]], options={"num_predict": 1}).prompt_eval_count == \
        plain.prompt_eval_count
    r = gpushare(daemon, "rm", "pirate", "pirate2")
    assert r.returncode == 0 and "deleted 'pirate'" in r.stdout and "deleted 'pirate2'" in r.stdout


def test_bad_modelfiles_name_the_file_and_line(daemon, smollm2_path, tmp_path):
    bad = tmp_path / "Modelfile"
    bad.write_text(f"FROM {smollm2_path}\nPARAMETER temperature 0\nFOO bar\n")
    r = gpushare(daemon, "create", "bad", "-f", str(bad))
    assert r.returncode == 1 and f"{bad}:3: unknown instruction 'FOO'" in r.stderr
    bad.write_text(f"FROM {smollm2_path}\nTEMPLATE \"\"\"{{{{ .System }}}} {{{{ .Prompt }}}}\"\"\"\n")
    r = gpushare(daemon, "create", "bad", "-f", str(bad))
    assert r.returncode == 1 and f"{bad}:2: this TEMPLATE is a Go template" in r.stderr
    bad.write_text(f"FROM {smollm2_path}\nPARAMETER temprature 0\n")
    r = gpushare(daemon, "create", "bad", "-f", str(bad))
    assert r.returncode == 1 and f"{bad}:2: unknown parameter 'temprature'" in r.stderr
    assert "bad" not in gpushare(daemon, "list").stdout.split()


def test_a_broken_modelfile_in_models_dir_is_named_and_the_rest_still_list(daemon, smollm2_path):
    broken = daemon.models_dir / "hand-written.modelfile"
    broken.write_text(f"FROM {smollm2_path}\nSYSTEM hi\nWHATEVER x\n")
    try:
        r = gpushare(daemon, "list")
        assert r.returncode == 0 and MODEL in r.stdout and "hand-written" not in r.stdout
        assert f"skipped: {broken}:3: unknown instruction 'WHATEVER'" in r.stderr
    finally:
        broken.unlink()


def test_api_create_json_and_copy_through_the_ollama_client(client, daemon, smollm2_path):
    client.create("jsonpet", from_=smollm2_path, system="Be terse.", parameters={"temperature": 0, "seed": 7},
                  template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    shown = client.show("jsonpet")
    assert show_system(daemon, "jsonpet") == "Be terse." and "seed                           7" in shown.parameters
    assert shown.template.startswith("{% for m in messages %}")
    client.copy("jsonpet", "jsonpet2")
    assert client.show("jsonpet2").parameters == shown.parameters
    with pytest.raises(ollama.ResponseError) as info:
        client.create("gopet", from_=smollm2_path, template="{{ .Prompt }}")
    assert info.value.status_code == 400 and "Go template" in info.value.error
    client.delete("jsonpet")
    client.delete("jsonpet2")
    # FROM a model: its weights and presets, the new ones on top
    client.create("petkid", from_="smolpet", parameters={"num_predict": 5})
    kid = client.show("petkid")
    assert "num_predict                    5" in kid.parameters and "temperature                    0" in kid.parameters
    assert show_system(daemon, "petkid") == SYSTEM
    client.delete("petkid")


def test_a_chat_longer_than_num_ctx_drops_its_oldest_turns(client, daemon):
    turns = [{"role": "system", "content": "You are brief."}]
    for i in range(8):
        turns += [{"role": "user", "content": f"Fact {i}: the number {i} is written {'x' * (i + 1)}. Remember it."},
                  {"role": "assistant", "content": f"Noted fact {i}."}]
    turns.append({"role": "user", "content": "Which facts do you remember?"})
    options = {"temperature": 0, "num_predict": 8}

    def prompt_tokens(messages):
        return client.chat(MODEL, messages=messages, options={**options, "num_predict": 1}).prompt_eval_count

    full = prompt_tokens(turns)
    num_ctx = full - 40
    # Ollama's rule: drop from the front (system messages kept) until the prompt fits.
    start = next(i for i in range(1, len(turns)) if prompt_tokens(turns[:1] + turns[i:]) < num_ctx)
    truncated = client.chat(MODEL, messages=turns, options={**options, "num_ctx": num_ctx})
    direct = client.chat(MODEL, messages=turns[:1] + turns[start:], options=options)
    assert truncated.prompt_eval_count == direct.prompt_eval_count < num_ctx
    assert truncated.message.content == direct.message.content
    status, body, _ = http("POST", daemon.url + "/api/chat", {"model": MODEL, "messages": turns, "stream": False,
                                                              "truncate": False, "options": {"num_ctx": num_ctx}})
    assert status == 400 and "the usable context is 249 tokens" in body["error"]


def test_ps_context_is_what_a_request_can_get(client, daemon):
    client.generate(MODEL, "hi", options={"num_predict": 1})
    model = next(m for m in http("GET", daemon.url + "/api/ps")[1]["models"] if m["name"] == MODEL)
    assert model["context_length"] == CONFIG_NUM_CTX and model["trained_context_length"] == 8192
    r = gpushare(daemon, "ps")
    assert f"{CONFIG_NUM_CTX}" in next(line for line in r.stdout.splitlines() if line.startswith(MODEL))
    # a Modelfile's num_ctx sizes what its requests get: a long chat is cut to fit it
    client.create("smallctx", from_=MODEL, parameters={"num_ctx": 64})
    long_chat = [{"role": "user", "content": f"Point {i}: " + "word " * 12} for i in range(6)]
    whole = client.chat(MODEL, messages=long_chat, options={"num_predict": 1})
    assert client.chat("smallctx", messages=long_chat, options={"num_predict": 1}).prompt_eval_count < 64 < \
        whole.prompt_eval_count
    assert next(m for m in client.ps().models if m.model == "smallctx").context_length == 64
    client.delete("smallctx")


def test_ollama_host_reaches_the_daemon(daemon):
    env = {k: v for k, v in daemon.env().items() if k != "GPUSHARE_HOST"} | {"OLLAMA_HOST": daemon.url}
    r = subprocess.run([str(GPUSHARE), "list"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "smolpet:latest" in r.stdout


def test_show_parts_keepalive_and_stopping_several_models(client, daemon, store):
    r = gpushare(daemon, "show", "smolpet", "--parameters")
    assert r.returncode == 0 and r.stdout == client.show("smolpet").parameters + "\n"
    assert gpushare(daemon, "show", "smolpet", "--system").stdout == SYSTEM + "\n"
    assert gpushare(daemon, "show", "smolpet", "--license").stdout == "Apache 2.0 (test)\n"
    assert "<|im_start|>" in gpushare(daemon, "show", "smolpet", "--template").stdout
    r = gpushare(daemon, "load", "smolpet", "--keepalive", "-1")
    assert r.returncode == 0, r.stderr
    assert daemon.loaded()["smolpet:latest"]["keep_alive"] < 0  # --keepalive is --keep-alive
    r = gpushare(daemon, "stop", "smolpet:latest", MODEL)
    assert r.returncode == 0, r.stderr
    assert not {"smolpet:latest", MODEL} & set(daemon.loaded())


def test_nothing_in_the_store_changed(client, store):
    client.chat("smolpet", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert tree_digest(store["root"]) == store["before"]
