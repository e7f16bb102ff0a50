"""--middleware: the operator's own ASGI middleware, by import path (vLLM's flag): a class is added as ASGI
middleware (constructed with the app), an async function is installed as `@app.middleware("http")` (called with
the request and `call_next`). Resolved before the model loads, so a wrong path fails at once."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from fastapi import FastAPI


class MiddlewareError(ValueError):
    """An import path that names no middleware; the message names the path and why."""


def load_middleware(path: str) -> Any:
    """The class or async function `path` ("package.module.Name") names."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise MiddlewareError(f"--middleware {path!r}: give module.Name, e.g. my_package.middleware.AddHeader")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except ImportError as error:
        raise MiddlewareError(f"--middleware {path!r}: cannot import {module_name!r}: {error}") from None
    except AttributeError:
        raise MiddlewareError(f"--middleware {path!r}: {module_name!r} has no {name!r}") from None
    if not (inspect.isclass(target) or inspect.iscoroutinefunction(target)):
        raise MiddlewareError(f"--middleware {path!r}: neither a class nor an async function")
    return target


def install_middleware(app: FastAPI, paths: list[str]) -> None:
    """Each of `paths` on `app`, in order (the last added runs first, as Starlette stacks them)."""
    for path in paths:
        target: Any = load_middleware(path)
        is_class = inspect.isclass(target)  # (not in the `if`: that would narrow the operator's class to `object`)
        if is_class:
            app.add_middleware(target)
        else:
            app.middleware("http")(target)
