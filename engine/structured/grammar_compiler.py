"""Compiling constraints into grammars over the model's vocabulary, cached by the constraint's text."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

from engine.errors import InvalidParameterError
from engine.structured.constraint import StructuredOutputs
from engine.structured.json_bounds import json_schema_grammar
from engine.structured.lark import is_lark, lark_source
from engine.structured.surrogates import without_surrogates

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
_CPP_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # xgrammar's C++ log line


class GrammarCompiler:
    """Turns a StructuredOutputs into an xgrammar CompiledGrammar, thread-safe, with an LRU cache.

    The server calls `compile` off the event loop and off the engine thread before it queues a request, which
    then holds the result (`GrammarRef`) until it ends: the engine thread never compiles a grammar the LRU
    dropped meanwhile (a worker rebuilt from a pickled step message compiles it itself).
    The vocabulary's token table is built on first use. `on_compile(seconds)` observes each cache miss.
    """

    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase",
        vocab_size: int,
        stop_token_ids: frozenset[int],
        cache_size: int = CACHE_SIZE,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.on_compile: Optional[Callable[[float], None]] = None
        self._compiler: Optional["xgrammar.GrammarCompiler"] = None
        self._cache: OrderedDict[tuple, "xgrammar.CompiledGrammar"] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def compiler(self) -> "xgrammar.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, constraint: StructuredOutputs, field: str = "structured_outputs") -> "xgrammar.CompiledGrammar":
        """The compiled grammar (cached); an uncompilable constraint is an InvalidParameterError on `field`."""
        key = constraint.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self.compiler()
        started = time.perf_counter()
        try:
            compiled = _compile(compiler, constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidParameterError(field, f"cannot be compiled into a grammar: {_first_line(exc)}") from None
        if not _admits_a_first_token(compiled):
            # every logit would be masked: the sampler took token 0 at each step, text outside the grammar
            raise InvalidParameterError(
                field, "matches no text: its grammar allows no first token (a rule that never reaches a terminal?)"
            )
        if self.on_compile is not None:
            self.on_compile(time.perf_counter() - started)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


def _compile(compiler: "xgrammar.GrammarCompiler", constraint: StructuredOutputs) -> "xgrammar.CompiledGrammar":
    # its one constraint, looked for in the order of `constraint.kind`
    # the JSON and regex grammars are edited to admit no UTF-16 surrogate, and the JSON ones no raw control character
    # in a string (surrogates.py): a user's own grammar is compiled as written
    if constraint.json is not None:  # bounded: numbers, whitespace and key order (json_bounds)
        return compiler.compile_grammar(_json_grammar(constraint.json))
    if constraint.regex is not None:
        import xgrammar as xgr

        return compiler.compile_grammar(without_surrogates(str(xgr.Grammar.from_regex(constraint.regex))))
    if constraint.choice is not None:
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice)
        return compiler.compile_grammar(f"root ::= {literals}")
    if constraint.grammar is not None:  # EBNF (GBNF), or Lark as vLLM tells them apart (lark.py)
        if is_lark(constraint.grammar):
            import xgrammar as xgr

            return compiler.compile_grammar(xgr.Grammar.from_lark(lark_source(constraint.grammar)))
        return compiler.compile_grammar(constraint.grammar)
    # json_object: an object, as OpenAI's json_object promises (the builtin grammar takes any value)
    return compiler.compile_grammar(_json_grammar('{"type": "object"}', strict=False))


def _admits_a_first_token(compiled: "xgrammar.CompiledGrammar") -> bool:
    """Whether a fresh matcher allows any token (a stop token counts: the empty text may match)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # [1, ceil(vocab / 32)] int32
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _json_grammar(schema_text: str, strict: bool = True) -> str:
    """The bounded JSON grammar of a schema, its strings held to valid UTF-8 and escaped controls."""
    return without_surrogates(json_schema_grammar(schema_text, strict), json_strings=True)


def _first_line(exc: BaseException) -> str:
    """The error's first line, without the `[12:34:56] /path/file.cc:123: ` that xgrammar's C++ log prefixes."""
    text = str(exc).strip() or type(exc).__name__
    return _CPP_LOG_PREFIX.sub("", text.splitlines()[0])[:300]
