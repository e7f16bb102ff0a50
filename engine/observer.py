"""What a served engine tells whoever watches it (the server's metrics): one typed interface, registered
once with `AsyncEngine.observe`, instead of callbacks set on the engine's parts from outside."""

from __future__ import annotations

from engine.outputs import RequestOutput


class EngineObserver:
    """The events of a served engine. Every method does nothing here: an observer overrides the ones it
    wants. Each is called on the thread named, so it must be quick and must not call back into the engine."""

    def on_step(self, num_tokens: int) -> None:
        """Engine thread: a step ran over `num_tokens` tokens."""

    def on_output(self, output: RequestOutput) -> None:
        """Event loop: every output of every request, the aborted ones' last included (`abort_reason`)."""

    def on_grammar_compile(self, seconds: float) -> None:
        """A structured-output constraint was compiled (a cache miss), on whichever thread asked for it."""

    def on_grammar_fill(self, seconds: float) -> None:
        """Engine thread: a step's token masks of constrained requests were filled."""
