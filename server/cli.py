"""The `pagedserve` command line: `serve` (the HTTP server) and `bench`."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from server.version import package_version

if TYPE_CHECKING:
    from engine.cpu_threads import CpuThreads
    from server.config.server_config import ServerConfig
    from server.config.settings import Settings

logger = logging.getLogger("server.cli")

_RESPONSE_TAIL_S = 5  # after the drain, seconds the last responses get to be written out


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM inference server")
    parser.add_argument("--version", action="version", version=f"pagedserve {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the HTTP server (flags: pagedserve serve --help)", add_help=False)
    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    bench_kinds.add_parser(
        "scheduler", help="scheduler overhead per step (flags: pagedserve bench scheduler --help)", add_help=False
    )
    bench_kinds.add_parser(
        "offline", help="offline throughput vs HF transformers (flags: pagedserve bench offline --help)", add_help=False
    )
    bench_kinds.add_parser(
        "serve",
        help="load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput "
        "(flags: pagedserve bench serve --help)",
        add_help=False,
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, rest = _build_parser().parse_known_args(argv)
    if args.command == "serve":
        return serve(rest, os.environ)
    if args.kind == "serve":
        from server.benchmark.serve import main as serve_bench_main

        return serve_bench_main(rest)
    if args.kind == "scheduler":
        from scheduler.bench import main as bench_main

        bench_main(rest)
        return 0
    from engine.bench import main as offline_main

    offline_main(rest)
    return 0


def serve(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """Load the settings, build the engine and serve until interrupted; the exit status.

    0: stopped by SIGTERM or SIGINT after the graceful drain (see server.http.drain); 1: the port or the
    model could not be had, or the engine loop died while serving; 2: a bad setting (message on stderr), a
    --max-model-len over the model's context length included;
    130: Ctrl-C before the server started serving (while the model loads). A second SIGTERM/SIGINT
    during the drain exits at once with 128 + the signal (143 / 130).
    """
    from server.config.settings import SettingsError, load_settings, warn_unknown_variables

    try:
        settings = load_settings(argv, environ)
    except SettingsError as error:
        print(f"pagedserve serve: error: {error}\n(pagedserve serve --help lists the flags)", file=sys.stderr)
        return 2
    server_config = settings.server
    try:  # the server's own settings, before the model loads: a bad one is exit 2 at once
        log_config = _check_server_settings(server_config)
        _configure_logging(server_config.log_level, log_config)
    except ValueError as error:
        print(f"pagedserve serve: error: {error}", file=sys.stderr)
        return 2
    warn_unknown_variables(environ)
    logger.debug("settings: %r", settings)  # the repr leaves out the API keys
    if settings.engine.parallel.headless:
        return _run_headless(_with_cpu_runtime(settings)[0])
    where = server_config.uds or f"{server_config.host}:{server_config.port}"
    try:
        if server_config.uds is not None:
            sock = bind_unix_socket(server_config.uds)
        else:
            sock = bind_socket(server_config.host, server_config.port)
    except OSError as error:
        flags = "--uds" if server_config.uds is not None else "--host/--port"
        print(
            f"pagedserve serve: error: cannot listen on {where} ({flags}): {error.strerror or error}", file=sys.stderr
        )
        return 1
    try:
        return _run(*_with_cpu_runtime(settings), sock, log_config)
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()


def _with_cpu_runtime(settings: "Settings") -> tuple["Settings", "CpuThreads"]:
    """The settings with the engine's CPU thread count resolved, and that count; the OpenMP variables are set in
    this process's environment first: torch is not imported yet (server/cpu_runtime.py)."""
    from server.cpu_runtime import prepare_cpu_runtime

    threads = prepare_cpu_runtime(settings.engine.cpu_threads, os.environ)
    engine = settings.engine.model_copy(update={"cpu_threads": threads.count})
    return settings.model_copy(update={"engine": engine}), threads


def _run_headless(settings: "Settings") -> int:
    """`--headless`: this node's tensor-parallel ranks, no API server (they follow node 0's)."""
    from engine.errors import SettingsConflictError
    from engine.tp_workers import run_headless_node

    try:
        return run_headless_node(settings.engine)
    except SettingsConflictError as error:
        print(f"pagedserve serve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(settings: "Settings", threads: "CpuThreads", sock: socket.socket, log_config: Optional[dict]) -> int:
    import asyncio
    import gc

    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.builder import build_engine
    from engine.errors import SettingsConflictError
    from engine.loading.loader import CheckpointError
    from engine.loading.model_config import ContextLengthError
    from engine.runner.scratch_thread import run_on_scratch_thread

    server_config = settings.server
    try:  # off the main thread, so the engine thread's OpenMP pool is the only one (see scratch_thread.py)
        engine = run_on_scratch_thread(
            lambda: build_engine(
                settings.engine,
                served_model_name=server_config.served_model_name[0] if server_config.served_model_name else None,
            )
        )
    except ContextLengthError as error:  # a setting, not the model: exit 2 as for any bad setting
        print(
            f"pagedserve serve: error: --max-model-len {error.requested} is larger than the model's context "
            f"length, {error.limit} (its {error.key}): give {error.limit} or less, or none for the model's own",
            file=sys.stderr,
        )
        return 2
    except SettingsConflictError as error:  # settings that cannot run here or together: as a bad flag
        print(f"pagedserve serve: error: {error}", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError) as error:
        print(f"pagedserve serve: error: cannot load the model: {error}", file=sys.stderr)
        return 1
    # This process serves this one engine until it exits: the weights and long-lived state need no scanning
    # by the cyclic GC. (Not in the builder: an LLM or a test suite that builds engines again must not
    # freeze them, since a frozen reference cycle is never collected.)
    gc.collect()
    gc.freeze()
    logger.info(
        "authentication: %s",
        f"{len(server_config.api_keys)} API key(s)"
        if server_config.api_keys
        else "none (set --api-key or PAGEDSERVE_API_KEY to require one)",
    )
    port = sock.getsockname()[1] if server_config.uds is None else 0
    keys = server_config.api_keys
    message = ready_message(
        server_config.host,
        port,
        engine.model_name,
        bool(keys),
        scheme=server_config.scheme,
        key=keys[0] if keys and _is_terminal(sys.stdout) else None,
        uds=server_config.uds,
        pooling=None if engine.pooler is None else engine.pooler.task,
    )

    from server.app import create_app
    from server.http.access_log_filter import QuietPaths
    from server.http.drain import GracefulShutdown
    from server.http.ssl_refresh import refresh_tls

    server: Optional[uvicorn.Server] = None
    exit_status = [0]

    def request_exit() -> None:
        assert server is not None  # called only once uvicorn runs
        server.should_exit = True

    def on_engine_death(error: BaseException) -> None:
        exit_status[0] = 1  # non-zero: a supervisor restarts the process
        request_exit()

    tasks: list[asyncio.Task] = []  # (held: the loop keeps only a weak reference to a task)

    async def announce() -> None:
        # The warm-up ends inside uvicorn's start-up, before it listens: a client that connects as soon as the line
        # is printed (a supervisor, a test) would be refused, so the line waits until uvicorn serves.
        while server is not None and not server.started:
            if server.should_exit:  # it never came to listen (a failed start-up, a signal): nothing to announce
                return
            await asyncio.sleep(0.01)
        print(message, flush=True)

    def on_ready() -> None:  # on the event loop, once warmed up
        loop = asyncio.get_running_loop()
        shutdown.bind(loop)
        if server_config.enable_ssl_refresh:
            assert server is not None and server.config.ssl is not None and server_config.ssl_keyfile is not None
            certfile = server_config.ssl_certfile or ""
            refresh = refresh_tls(server.config.ssl, certfile, server_config.ssl_keyfile, server_config.ssl_ca_certs)
            tasks.append(loop.create_task(refresh))
        tasks.append(loop.create_task(announce()))

    from server.cpu_runtime import thread_governor

    governor = thread_governor(threads, settings.engine, engine.runner.device.type)
    async_engine = AsyncEngine(engine, governor=governor)
    app = create_app(async_engine, server_config, on_ready=on_ready, on_engine_death=on_engine_death)
    shutdown = GracefulShutdown(app.state.server, server_config.shutdown_timeout, request_exit)
    tls: dict = {}
    if server_config.ssl_certfile is not None:
        tls = {
            "ssl_keyfile": server_config.ssl_keyfile,
            "ssl_certfile": server_config.ssl_certfile,
            "ssl_ca_certs": server_config.ssl_ca_certs,
            "ssl_cert_reqs": server_config.ssl_cert_reqs,
        }
        if server_config.ssl_ciphers is not None:
            tls["ssl_ciphers"] = server_config.ssl_ciphers
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=port,
        uds=server_config.uds,
        log_level=server_config.uvicorn_log_level or server_config.log_level,
        log_config=log_config if log_config is not None else uvicorn.config.LOGGING_CONFIG,
        access_log=server_config.uvicorn_access_log,
        timeout_graceful_shutdown=_RESPONSE_TAIL_S,
        root_path=server_config.root_path,
        h11_max_incomplete_event_size=server_config.h11_max_incomplete_event_size,
        **tls,
    )
    if server_config.disable_access_log_for_endpoints:  # (after the Config: it sets up uvicorn's loggers)
        logging.getLogger("uvicorn.access").addFilter(QuietPaths(server_config.disable_access_log_for_endpoints))
    server = uvicorn.Server(config)
    server.handle_exit = shutdown.handle_signal  # type: ignore[method-assign]  # what uvicorn installs as the SIGINT / SIGTERM handler
    server.run(sockets=[sock])
    if not async_engine.is_alive and async_engine.error is None:  # stopped cleanly (not stuck, not failed)
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - the process is exiting anyway; say why the release failed
            logger.exception("releasing the engine's memory failed")
    if not server.started:
        return 1
    return exit_status[0]


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to host:port; port 0 picks a free one.

    Bound before the model loads, so a busy port fails at once and port 0 is known
    in time for the ready message.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """A Unix domain socket bound (not yet listening) at `path` (--uds); a socket file left there by a server that
    is gone is replaced, anything else (a server still listening there included) is an error."""
    import errno
    import stat

    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            if _accepts_connections(path):  # unlinked, the running server would stay up but unreachable
                raise OSError(errno.EADDRINUSE, "a server is listening on that socket")
            os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _accepts_connections(path: str) -> bool:
    """Whether a server may listen on the Unix socket at `path`: only a refused connection says that none does
    (one that times out may be a busy server's, whose socket must not be taken)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True


def ready_message(
    host: str,
    port: int,
    model_name: str,
    needs_key: bool,
    *,
    key: Optional[str] = None,
    scheme: str = "http",
    uds: Optional[str] = None,
    pooling: Optional[str] = None,
) -> str:
    """The URL and a ready-to-paste curl line: a completion, or for a model served for pooling (which generates
    nothing; `pooling` its task, "embed" or "classify") an embedding or a classification.

    With API keys, the line carries `key` itself when given (the CLI gives it only when stdout is a
    terminal: the screen of whoever started the server); otherwise `$PAGEDSERVE_API_KEY`, with a line
    saying to export it first, so a log never holds a key. Over HTTPS, curl gets `-k`: the line talks to
    127.0.0.1, a name that the certificate rarely carries.
    """
    reachable = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    url = f"{scheme}://[{reachable}]:{port}" if ":" in reachable else f"{scheme}://{reachable}:{port}"
    socket_flag = ""
    if uds is not None:  # (the host part of the URL names no one: curl connects to the socket)
        url, socket_flag = f"{scheme}://localhost", " --unix-socket " + shlex.quote(uds)
    if pooling is not None:
        route = "/classify" if pooling == "classify" else "/v1/embeddings"
        body = json.dumps({"model": model_name, "input": "The capital of France is"})
    else:
        route = "/v1/completions"
        body = json.dumps(
            {"model": model_name, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        )
    insecure = " -k" if scheme == "https" else ""
    auth, before = "", ""
    if needs_key and key is not None:
        auth = " -H " + shlex.quote(f"Authorization: Bearer {key}")
    elif needs_key:
        auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"'
        before = "  export PAGEDSERVE_API_KEY=...  # one of the keys given with --api-key or PAGEDSERVE_API_KEY\n"
    curl = f'curl{insecure}{socket_flag} {url}{route} -H "Content-Type: application/json"{auth} -d {shlex.quote(body)}'
    where = f"{url}/v1 on the Unix socket {uds}" if uds is not None else f"{url}/v1"
    return f"pagedserve: serving {model_name!r} at {where} (metrics at {url}/metrics)\ntry:\n{before}  {curl}"


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def check_tls_files(
    certfile: Optional[str], keyfile: Optional[str], ca_certs: Optional[str] = None, ciphers: Optional[str] = None
) -> Optional[str]:
    """Why --ssl-certfile / --ssl-keyfile (with --ssl-ca-certs and --ssl-ciphers) cannot serve HTTPS (checked
    before the model loads), or None."""
    if certfile is None or keyfile is None:
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        if ca_certs is not None:
            context.load_verify_locations(ca_certs)
    except (OSError, ssl.SSLError) as error:
        return f"--ssl-ca-certs {ca_certs!r}: cannot load it: {getattr(error, 'strerror', None) or error}"
    try:
        if ciphers is not None:
            context.set_ciphers(ciphers)
    except ssl.SSLError as error:
        return f"--ssl-ciphers {ciphers!r}: OpenSSL takes none of them: {error}"
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as error:
        return (
            f"--ssl-certfile {certfile!r} / --ssl-keyfile {keyfile!r}: cannot load them: "
            f"{getattr(error, 'strerror', None) or error}"
        )
    return None


def _check_server_settings(config: "ServerConfig") -> Optional[dict]:
    """The server's own files and imports, checked before the model loads: the TLS files, the --log-config-file
    (returned, for logging and uvicorn to apply), the --middleware paths. ValueError names the setting."""
    from server.http.user_middleware import load_middleware

    tls_error = check_tls_files(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_ciphers)
    if tls_error is not None:
        raise ValueError(tls_error)
    log_config = read_log_config(config.log_config_file)
    for path in config.middleware:
        load_middleware(path)  # (MiddlewareError, a ValueError)
    return log_config


def read_log_config(path: Optional[str]) -> Optional[dict]:
    """--log-config-file's JSON (a logging.config.dictConfig dictionary), or None; LogConfigError for a file that
    cannot be read or is not such an object."""
    if path is None:
        return None
    try:
        config = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as error:
        raise LogConfigError(f"--log-config-file {path!r}: cannot read it as JSON: {error}") from None
    if not isinstance(config, dict) or "version" not in config:
        raise LogConfigError(f"--log-config-file {path!r}: not a logging config (a JSON object with a version)")
    return config


class LogConfigError(ValueError):
    """A --log-config-file that cannot be used; the message names it."""


def _configure_logging(level: str, config: Optional[dict] = None) -> None:
    if config is not None:
        try:
            logging.config.dictConfig(config)
        except ValueError as error:  # the file read, but it does not configure
            raise LogConfigError(f"--log-config-file: {error}") from None
        return
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


if __name__ == "__main__":
    sys.exit(main())
