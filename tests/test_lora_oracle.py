"""LoRA adapters against peft, the oracle: three adapters (ranks 8, 16, 32, all seven targets, not zero)
on a tiny random Llama; greedy answers equal peft's for each adapter and for the base, alone and all four
mixed in one batch; with int8 weights, per-position choices within the quantized-weights tests' tolerance.
Bad adapters are refused with a message naming the adapter, the base and the shapes."""

import json
import os

import pytest
import torch

from arch_models import save_hf_model
from gpushare import LLM, SamplingParams
from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.sequence import Sequence
from gpushare.models.loader import load_model
from gpushare.models.lora import read_adapter
from test_architectures import greedy_transformers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"fine-a": 8, "fine-b": 16, "fine-c": 32}
PROMPTS = ["Tell me about the history of Paris and the river that runs through it.",
           "Write a short poem about the sea, the wind and the gulls."]
NEW_TOKENS = 16


def make_adapter(base_folder: str, folder: str, rank: int, seed: int, targets=TARGETS):
    """A peft LoRA on a fresh copy of the base, saved in ``folder``; returns the peft model (the oracle)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            init_lora_weights=False))
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def family(tmp_path_factory, smollm2_path):
    """(base folder, {adapter name: folder}, {None or adapter name: oracle model}, prompt ids)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = save_hf_model("llama", str(root / "base"), smollm2_path)
    oracles = {None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                          attn_implementation="eager").eval()}
    folders = {}
    for seed, (name, rank) in enumerate(RANKS.items(), start=1):
        folders[name] = str(root / name)
        oracles[name] = make_adapter(base, folders[name], rank, seed)
    prompts = [load_model(base, weights="float32").tokenizer.encode(p) for p in PROMPTS]
    return base, folders, oracles, prompts


@pytest.fixture(scope="module")
def expected(family):
    """peft's (and for None transformers') greedy answers: {model: [answer per prompt]}."""
    _, _, oracles, prompts = family
    return {name: [greedy_transformers(model, ids, NEW_TOKENS) for ids in prompts] for name, model in oracles.items()}


@pytest.fixture(scope="module")
def llm(family):
    base, folders, _, _ = family
    model = LLM(base, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2, block_size=4)
    for name, folder in folders.items():
        model.load_adapter(name, folder)
    yield model
    model.shutdown()


def greedy():
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_the_adapters_change_the_answers(expected):
    """Not a test that cannot fail: each adapter's answers are its own, none the base's."""
    answers = [tuple(map(tuple, a)) for a in expected.values()]
    assert len(set(answers)) == len(answers)


@pytest.mark.parametrize("name", [None, *RANKS])
def test_each_adapter_alone_matches_peft(llm, family, expected, name):
    prompts = family[3]
    outs = llm.generate(prompts, greedy(), adapter=name)
    assert [o.token_ids for o in outs] == expected[name]


def test_base_and_three_adapters_mixed_in_one_batch_match_peft(llm, family, expected):
    """Eight requests in one call (each prompt under every model): shared steps, and prompts already in
    the prefix cache under the other adapters, whose blocks must not be reused across adapters."""
    prompts = family[3]
    names = [None, *RANKS]
    jobs = [(name, ids) for ids in prompts for name in names]
    outs = llm.generate([ids for _, ids in jobs], greedy(), adapter=[name for name, _ in jobs])
    for (name, ids), out in zip(jobs, outs):
        assert out.token_ids == expected[name][prompts.index(ids)], name


def test_int8_base_with_adapters_stays_close_to_peft(family):
    """Per position of a text, each model's next-token choice on int8 weights is peft's float32 one almost
    everywhere (test_quantized_weights' tolerance), all four models' rows in one forward pass."""
    base, folders, oracles, prompts = family
    ids = prompts[0] + prompts[1]
    loaded = load_model(base, weights="int8")
    assert loaded.model.layers[0].mlp.down_proj.format == "int8"
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=8 << 20))
    engine.add_model("base", loaded)
    for name, folder in folders.items():
        engine.add_adapter(name, "base", read_adapter(folder, name))
    seqs = []
    for name in oracles:
        seq = Sequence(f"x-{name}", "base", ids, greedy(), lambda out: None)
        seq.adapter = name
        assert engine.models["base"].scheduler.pool.grow(seq.block_table, len(ids)) is None
        seqs.append(seq)
    hidden, _ = engine.models["base"].runner.hidden_states(seqs, [len(ids)] * len(seqs))
    choices = loaded.model.logits(hidden).argmax(dim=-1).view(len(seqs), len(ids))
    for row, (name, oracle) in zip(choices, oracles.items()):
        with torch.no_grad():
            reference = oracle(torch.tensor([ids])).logits[0].argmax(dim=-1)
        agreement = (row == reference).float().mean().item()
        assert agreement >= 0.9, (name, agreement)


def test_an_adapter_for_another_base_is_refused_naming_both(llm, tmp_path, smollm2_path):
    other = save_hf_model("qwen3", str(tmp_path / "qwen3"), smollm2_path)
    make_adapter(other, str(tmp_path / "qwen-lora"), 8, seed=9)
    with pytest.raises(ValueError, match=r"adapter 'qwen-lora' does not fit base .*lora_A is \[8, 64\], "
                                         r"the base needs \[8, 256\]"):
        llm.load_adapter("qwen-lora", str(tmp_path / "qwen-lora"))
    assert llm.generate(["Why?"], greedy())[0].finish_reason == "length"  # the base keeps serving


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)


def test_rank_4096_unknown_targets_and_corrupt_files_are_refused(family, tmp_path):
    base, folders, _, _ = family
    bad = tmp_path / "bad"
    make_adapter(base, str(bad), 8, seed=5)
    _edit_config(str(bad), r=4096)
    with pytest.raises(ValueError, match=r"adapter 'bad': rank 4096 is not covered \(ranks 1 to 64\)"):
        read_adapter(str(bad), "bad")
    _edit_config(str(bad), r=8, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"adapter 'bad': target modules \['lm_head'\] are not covered"):
        read_adapter(str(bad), "bad")
    _edit_config(str(bad), target_modules=TARGETS)
    with open(bad / "adapter_model.safetensors", "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"adapter 'bad': adapter_model.safetensors cannot be read"):
        read_adapter(str(bad), "bad")
    with pytest.raises(ValueError, match=r"is neither a PEFT folder nor a GGUF file"):
        read_adapter(str(tmp_path / "missing"), "missing")
