"""`pagedserve` with test-only hooks, for the tests that need a real process (drain, engine death).

    python -m tests.reliability.serve_with_hooks [--pace S] [--die-on-token ID] [--slow-grammar S] -- serve <flags>

--pace S: every engine step lasts at least S seconds (a long stream stays long on any machine).
--die-on-token ID: the engine loop raises once a request whose prompt holds token ID is in a step.
--slow-grammar S: compiling a request's output grammar takes S seconds more (a request stays long between the
    server's checks and the engine's queue).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--die-on-token", type=int, default=None)
    parser.add_argument("--slow-grammar", type=float, default=0.0)
    hooks = parser.parse_args(argv[:split])

    from engine.engine import EngineCore

    step = EngineCore.step

    def hooked_step(self):
        if hooks.pace:
            time.sleep(hooks.pace)
        if hooks.die_on_token is not None:
            for request_id in self.unfinished_request_ids():
                request = self.scheduler.requests.get(request_id)
                if request is not None and hooks.die_on_token in request.prompt_token_ids:
                    raise RuntimeError("injected engine loop failure")
        return step(self)

    EngineCore.step = hooked_step
    if hooks.slow_grammar:
        from engine.structured.grammar_compiler import GrammarCompiler

        compile_ = GrammarCompiler.compile

        def slow_compile(self, *args, **kwargs):
            time.sleep(hooks.slow_grammar)
            return compile_(self, *args, **kwargs)

        GrammarCompiler.compile = slow_compile
    from server.cli import main as cli_main

    return cli_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
