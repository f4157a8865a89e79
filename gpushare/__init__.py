"""gpushare: a node-local GPU sharing daemon for LLM serving.

The offline API mirrors vLLM's: ``from gpushare import LLM, SamplingParams``.
"""

from gpushare.engine.sampling import SamplingParams
from gpushare.llm import LLM

__all__ = ["LLM", "SamplingParams"]
