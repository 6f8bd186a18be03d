"""Structured outputs (JSON schema, any JSON, regex, choice, EBNF) through xgrammar.

:class:`StructuredOutputsParams` is what a request asks for
(``SamplingParams(structured_outputs=...)``); :class:`StructuredOutputManager` is what the
engine keeps: compiled grammars (cached, compiled off the engine thread) and one matcher
per constrained sequence, whose packed token bitmask the sampler applies to the logits.
"""

from inference_engine.structured_output.compiler import CompiledConstraint, GrammarCompilerPool
from inference_engine.structured_output.manager import StructuredOutputManager
from inference_engine.structured_output.params import StructuredOutputsParams

__all__ = [
    "CompiledConstraint",
    "GrammarCompilerPool",
    "StructuredOutputManager",
    "StructuredOutputsParams",
]
