"""Structured output: grammar-constrained decoding (JSON Schema, regex, choice, EBNF) with xgrammar."""

from engine.structured.constraint import StructuredOutputs
from engine.structured.grammar_compiler import GrammarCompiler
from engine.structured.vllm_params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GrammarCompiler", "GuidedDecodingParams", "StructuredOutputs", "StructuredOutputsParams"]
