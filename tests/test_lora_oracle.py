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
NEAR_TIE = 0.1  # a parting within this many standard deviations of the logits is a near tie


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


def int8_oracles(base_folder: str, folders: dict) -> dict:
    """transformers and peft over the weights an int8 load holds: each matrix int8 gpushare quantizes,
    through its int8 round trip."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpushare.models.quantized import quantize_int8
    from gpushare.protocol.weight_format import target_of

    def rounded_base():
        model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if target_of(name, "int8") == "int8":
                    p.copy_(quantize_int8(p.detach()).dequantize())
        return model.eval()

    oracles = {None: rounded_base()}
    for name, folder in folders.items():
        oracles[name] = PeftModel.from_pretrained(rounded_base(), folder).eval()
    return oracles


def test_an_adapter_of_q_and_v_alone_matches_peft_and_reads_no_other_stack(family, expected, tmp_path):
    """PEFT's default targets on a Llama (q and v only): with no loaded adapter on the other five
    targets their stacks are rank 0, which the kernels skip, and the answers are still peft's."""
    base, _, _, prompts = family
    oracle = make_adapter(base, str(tmp_path / "qv"), 16, seed=7, targets=["q_proj", "v_proj"])
    want = [greedy_transformers(oracle, ids, NEW_TOKENS) for ids in prompts]
    model = LLM(base, dtype="float32", weights="float32", kv_dtype="float32", num_threads=2, block_size=4)
    try:
        model.load_adapter("qv", str(tmp_path / "qv"))
        table = model.model.model.adapters
        ranks = [stack.shape[1] for stack in table.a_stacks]
        got = [o.token_ids for o in model.generate(prompts, greedy(), adapter="qv")]
    finally:
        model.shutdown()
    layers = len(ranks) // 7  # q, k, v, o, gate, up, down a layer
    assert ranks == [16, 0, 16, 0, 0, 0, 0] * layers
    assert got == want and want != expected[None]


def test_int8_base_with_adapters_stays_close_to_peft(family):
    """Per position of a text, each model's next-token choice on int8 weights (activations rounded too, by
    the block kernel) is peft's over the same int8 weights almost everywhere, all four models' rows in one
    pass; as test_kv_pool does for bfloat16 KV, every parting is checked to be a near tie in peft's logits
    (this tiny random model has many: on this machine 3 to 6 of 53 positions part, each within 0.07 of
    the best logit, whose spread is 1.3)."""
    base, folders, _, _ = family
    loaded = load_model(base, weights="int8")
    ids = loaded.tokenizer.encode(" ".join(PROMPTS) + " The quick brown fox jumps over the lazy dog while the sun "
                                  "sets slowly behind the hills and the birds fly home.")
    assert loaded.model.layers[0].mlp.down_proj.format == "int8"
    engine = Engine(EngineConfig(kv_dtype="float32", kv_cache_bytes=8 << 20))
    engine.add_model("base", loaded)
    for name, folder in folders.items():
        engine.add_adapter(name, "base", read_adapter(folder, name))
    assert loaded.model.adapters.a_stacks[0].dtype == torch.bfloat16  # an int8 base's adapters: bfloat16
    oracles = int8_oracles(base, folders)
    seqs = []
    for name in oracles:
        seq = Sequence(f"x-{name}", "base", ids, greedy(), lambda out: None)
        seq.adapter = name
        assert engine.models["base"].scheduler.pool.grow(seq.block_table, len(ids)) is None
        seqs.append(seq)
    hidden, _ = engine.models["base"].runner.hidden_states(seqs, [len(ids)] * len(seqs))
    choices = loaded.model.logits(hidden).argmax(dim=-1).view(len(seqs), len(ids))
    references = []
    for row, (name, oracle) in zip(choices, oracles.items()):
        with torch.no_grad():
            logits = oracle(torch.tensor([ids])).logits[0]
        references.append(logits.argmax(dim=-1))
        # how far below peft's best logit our choice is: 0 where we agree
        gaps = logits.max(dim=-1).values - logits.gather(1, row[:, None].cpu()).squeeze(1)
        assert int((gaps == 0).sum()) >= 0.8 * len(ids), (name, gaps)
        assert gaps.max() < NEAR_TIE * logits.std(), (name, gaps)
    assert len({tuple(r.tolist()) for r in references}) == len(references)  # each adapter's choices its own


def test_an_adapter_for_another_base_is_refused_naming_both(llm, tmp_path, smollm2_path):
    other = save_hf_model("qwen3", str(tmp_path / "qwen3"), smollm2_path)
    make_adapter(other, str(tmp_path / "qwen-lora"), 8, seed=9)
    with pytest.raises(ValueError, match=r"adapter 'qwen-lora' does not fit base '.*base': layer 0 down lora_A "
                                         r"is \[8, 128\], the base needs \[8, 512\]"):
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
