"""A request's own reference to its compiled grammar, from admission to its end."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import xgrammar


class GrammarRef:
    """The compiled grammar of one constrained request, held by its scheduler `Request` and handed to the runner
    in `NewRequestData.grammar` (admission, and again on each resume after a preemption).

    The compiler's LRU cache may drop a grammar while requests still decode with it (more distinct grammars in
    flight than it holds); held here, it is never compiled again, and above all never on the engine thread, where
    a compile stalls every request's step.

    Pickled (a step message sent to a worker process) it travels empty: a compiled grammar is a native object of
    this process, and the worker compiles the request's constraint itself (its own cache).
    """

    __slots__ = ("compiled",)

    def __init__(self, compiled: Optional["xgrammar.CompiledGrammar"]):
        self.compiled = compiled

    def __reduce__(self) -> tuple[Any, ...]:
        return GrammarRef, (None,)

    def __repr__(self) -> str:
        return f"GrammarRef({'compiled' if self.compiled is not None else 'empty'})"
