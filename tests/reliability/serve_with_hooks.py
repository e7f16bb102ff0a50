"""`pagedserve` with test-only hooks, for the tests that need a real process (drain, engine death).

    python -m tests.reliability.serve_with_hooks [--pace S] [--die-on-token ID] -- serve <serve flags>

--pace S: every engine step lasts at least S seconds (a long stream stays long on any machine).
--die-on-token ID: the engine loop raises once a request whose prompt holds token ID is in a step.
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
    from server.cli import main as cli_main

    return cli_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
