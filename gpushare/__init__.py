"""gpushare: a node-local GPU sharing daemon for LLM serving.

The offline API mirrors vLLM's: ``from gpushare import LLM, SamplingParams``. Both are
imported lazily so that the CLI, which only talks HTTP, starts without loading torch.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from gpushare.llm import LLM

        return LLM
    if name == "SamplingParams":
        from gpushare.protocol.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'gpushare' has no attribute {name!r}")
