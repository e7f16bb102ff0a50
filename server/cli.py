"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the HTTP server")
    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    bench_kinds.add_parser(
        "scheduler", help="scheduler overhead per step (flags: python -m scheduler.bench --help)", add_help=False
    )
    bench_kinds.add_parser(
        "offline", help="offline throughput vs HF transformers (flags: python -m engine.bench --help)", add_help=False
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, rest = _build_parser().parse_known_args(argv)
    if args.command == "bench" and args.kind == "scheduler":
        from scheduler.bench import main as bench_main

        bench_main(rest)
        return 0
    if args.command == "bench" and args.kind == "offline":
        from engine.bench import main as offline_main

        offline_main(rest)
        return 0
    if rest:
        print(f"pagedserve {args.command}: unrecognized arguments: {' '.join(rest)}", file=sys.stderr)
        return 2
    print(
        "pagedserve serve: the HTTP server is not built yet (the engine and server issues come next);\n"
        "today this checkout provides the scheduler: try `pagedserve bench scheduler`.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
