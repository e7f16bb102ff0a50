"""A chat request's images, read from its image parts before the prompt is rendered: `data:` URLs decoded,
`file://` URLs read under --allowed-local-media-path, http(s) URLs fetched (hosts limited by
--allowed-media-domains, redirects followed only to allowed hosts; each fetch, redirects included, within
--media-fetch-timeout; the request's fetched bodies together at most --max-request-body bytes, as if they had
come in its body: a request of a few URLs cannot make the server hold gigabytes). All of a request's images are
fetched at once; decoding runs off the event loop, the request's images together at most MAX_REQUEST_PIXELS pixels
(read from each image's header before it is decoded). A part that yields no image is a 400 naming it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import urljoin, urlparse

import httpx

from engine.errors import InvalidParameterError
from engine.multimodal.images import PixelBudget, decode_data_url, open_image, read_local_image
from engine.text.content_parts import ImagePart
from server.http.errors import bad_request

if TYPE_CHECKING:
    from server.state import ServerState

MAX_REDIRECTS = 5


@dataclass
class _Budget:
    """The bytes a request's fetches may still bring, together (its fetches share one event loop: no lock)."""

    left: int

    def take(self, count: int, limit: int, param: str) -> None:
        self.left -= count
        if self.left < 0:
            raise InvalidParameterError(
                param, f"takes the request's fetched images past {limit} bytes (--max-request-body)"
            )


async def load_images(state: "ServerState", parts: Sequence[tuple[str, ImagePart]]) -> list[Any]:
    """The PIL image (RGB) of each part, in order."""
    budget, pixels = _Budget(state.config.max_request_body), PixelBudget()
    async with httpx.AsyncClient(timeout=state.config.media_fetch_timeout, follow_redirects=False) as client:
        return list(await asyncio.gather(*(_load(state, client, budget, pixels, where, part) for where, part in parts)))


async def _load(
    state: "ServerState", client: httpx.AsyncClient, budget: _Budget, pixels: PixelBudget, where: str, part: ImagePart
) -> Any:
    param = f"{where}.image_url"
    if part.kind != "image_url":
        raise bad_request(
            f"content part of type {part.kind!r} is not supported over HTTP; send image_url.", param=where
        )
    source = part.source
    url = source.get("url") if isinstance(source, dict) else source
    if not isinstance(url, str) or not url:
        raise bad_request('an image_url part needs {"url": "..."}.', param=param)
    param = f"{param}.url"
    try:
        if url.startswith("data:"):
            data = decode_data_url(url, param)
        elif url.startswith("file:"):
            data = await asyncio.to_thread(read_local_image, url, state.engine.media_path, param)
        elif urlparse(url).scheme in ("http", "https"):
            data = await _fetch(state, client, budget, url, param)
        else:
            raise InvalidParameterError(param, "must be an http(s), data: or file:// URL")
        return await asyncio.to_thread(open_image, data, param, pixels)
    except InvalidParameterError as error:
        raise bad_request(f"{error}.", param=param) from None


async def _fetch(state: "ServerState", client: httpx.AsyncClient, budget: _Budget, url: str, param: str) -> bytes:
    """An http(s) URL's body (redirects followed while they lead to allowed hosts), within --media-fetch-timeout in
    all: the client's own timeout bounds each connect and each read alone, which a server dripping its body (or
    its redirects) slowly never passes."""
    timeout = state.config.media_fetch_timeout
    try:
        return await asyncio.wait_for(_follow(state, client, budget, url, param), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise InvalidParameterError(
            param, f"could not be fetched within {timeout:g} s (--media-fetch-timeout)"
        ) from None


async def _follow(state: "ServerState", client: httpx.AsyncClient, budget: _Budget, url: str, param: str) -> bytes:
    """`_fetch`'s work: each body's bytes taken from the request's budget as they come."""
    limit = state.config.max_request_body
    for _ in range(MAX_REDIRECTS + 1):
        _check_host(state, url, param)
        try:
            async with client.stream("GET", url) as response:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise InvalidParameterError(param, f"could not be fetched: HTTP {response.status_code}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    budget.take(len(chunk), limit, param)
                return bytes(body)
        except httpx.TimeoutException:  # (an HTTPError too: `_fetch` words it)
            raise
        except httpx.HTTPError as error:
            raise InvalidParameterError(param, f"could not be fetched: {type(error).__name__}") from None
    raise InvalidParameterError(param, f"redirects more than {MAX_REDIRECTS} times")


def _check_host(state: "ServerState", url: str, param: str) -> None:
    allowed = state.config.allowed_media_domains
    host = urlparse(url).hostname or ""
    if urlparse(url).scheme not in ("http", "https"):
        raise InvalidParameterError(param, "redirects to a URL that is not http(s)")
    if allowed is not None and host.lower() not in {domain.lower() for domain in allowed}:
        raise InvalidParameterError(param, f"names host {host!r}, which --allowed-media-domains does not allow")
