"""LLM: the offline Python API, shaped like vLLM's (``LLM(...).generate`` / ``.chat``)."""

import atexit
import threading
from dataclasses import dataclass

from gpushare.engine.engine import Engine, EngineConfig
from gpushare.engine.passing_threads import in_passing_thread
from gpushare.protocol.sampling_params import SamplingParams
from gpushare.models.loader import load_model
from gpushare.models.lora import read_adapter

DEFAULT_KV_CACHE_BYTES = 512 << 20


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int]
    # With SamplingParams(prompt_logprobs=k): one entry per prompt position, the first None, each
    # other {token_id: logprob} for the prompt token and the k most likely ones (vLLM's shape).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With SamplingParams(logprobs=k): one TokenLogprobs per generated token that made text.
    logprobs: list | None = None
    stop_reason: str | None = None  # the stop string that ended it (vLLM's), None otherwise


class LLM:
    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, block_size: int = 16,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, num_threads: int | None = None, weights: str = "auto",
                 kv_dtype: str = "auto", enable_prefix_caching: bool = True):
        """``dtype``: activations; ``weights``: the weight format, ``auto`` as the daemon's default (int4
        for a 4-bit GGUF, int8 for other quantized ones); ``kv_dtype``: the KV cache's (``auto``: bfloat16, float32 with float32 weights on the CPU).
        ``weights="float32"`` with ``dtype="float32"`` is the exact path. ``enable_prefix_caching``: reuse
        the K/V of prompt blocks seen before (vLLM's name); their rows were computed in other chunks, so
        where the torch attention runs (bfloat16 activations, GPUs) an answer may then differ in its last bits."""
        # loaded in a thread that ends, so that its OpenMP team does not slow the engine's (passing_threads.py)
        self.model = in_passing_thread(lambda: load_model(model, dtype=dtype, device=device,
                                                          weights=weights)).result()
        self.model_name = model
        self.engine = Engine(EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                          block_size=block_size, num_threads=num_threads, device=device,
                                          kv_cache_bytes=kv_cache_bytes, kv_dtype=kv_dtype, weights=weights,
                                          prefix_cache="tenant" if enable_prefix_caching else "off"))
        self.engine.add_model(model, self.model)
        self.engine.start()
        # Stopped before the interpreter finalizes: the engine thread is a daemon, and one that takes the
        # GIL back during finalization (after an op or a tensor's free let go of it) is ended by
        # pthread_exit, whose unwinding through torch's C++ aborts the process ("terminate called without
        # an active exception", exit 134: a script that left while a step ran, or ~half of those whose
        # last prompt was 1,500 tokens).
        atexit.register(self.engine.shutdown)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at ``path`` (a PEFT folder or a GGUF LoRA) as ``name`` on this model;
        ValueError when it does not fit (models/lora.py)."""
        self.engine.add_adapter(name, self.model_name, read_adapter(path, name))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 adapter: str | list[str | None] | None = None) -> list[CompletionOutput]:
        """Complete each prompt (a string or a list of token ids); results come back in input order.
        ``adapter``: a loaded adapter's name (load_adapter) for all prompts, or one per prompt (None: the base)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        return self._run(token_lists, params, adapter)

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             adapter: str | list[str | None] | None = None) -> list[CompletionOutput]:
        """Answer each conversation (a list of ``{"role", "content"}`` messages) with the model's template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not conversations:
            raise ValueError("conversations is empty: pass at least one conversation")
        token_lists = [self.tokenizer.encode(self.model.render_chat(c), add_special_tokens=False) for c in conversations]
        return self._run(token_lists, params, adapter)

    def shutdown(self) -> None:
        self.engine.shutdown()
        atexit.unregister(self.engine.shutdown)  # nor kept alive until exit by the registration

    def _run(self, token_lists: list[list[int]], params, adapter=None) -> list[CompletionOutput]:
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(token_lists)
        if len(adapters) != len(token_lists):
            raise ValueError(f"got {len(adapters)} adapters for {len(token_lists)} inputs")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_lists)} inputs")
        for p in params:
            p.validate()
            if p.n != 1:
                raise ValueError(f"n must be 1 in the offline API (one answer per prompt; repeat the prompt "
                                 f"instead), got {p.n}")
        results = [None] * len(token_lists)
        done = threading.Semaphore(0)
        ids = []

        def collector(index):
            texts, tokens, prompt_logprobs, logprobs = [], [], [], []

            def on_output(out):
                texts.append(out.text)
                tokens.extend(out.token_ids)
                logprobs.extend(out.logprobs or [])
                if out.prompt_logprobs is not None:
                    prompt_logprobs.append(out.prompt_logprobs)
                if out.finished:
                    first = prompt_logprobs[0] if prompt_logprobs else None
                    results[index] = (out, "".join(texts), list(tokens), first, logprobs)
                    done.release()
            return on_output

        try:
            for i, (tokens, p, name) in enumerate(zip(token_lists, params, adapters)):
                request = self.engine.request(name or self.model_name, tokens, p)
                ids.append(self.engine.submit(request, collector(i)))
        except Exception:
            for rid in ids:
                self.engine.cancel(rid)
            raise
        for _ in ids:
            done.acquire()
        outputs = []
        for tokens, p, (out, text, new_ids, prompt_logprobs, logprobs) in zip(token_lists, params, results):
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            outputs.append(CompletionOutput(text, new_ids, out.finish_reason, tokens, prompt_logprobs,
                                            logprobs if p.logprobs is not None else None, out.stop_reason))
        return outputs
