"""--enable-ssl-refresh: the TLS key, certificate and CA files read again when they change (a renewed certificate
from cert-manager or certbot), so new connections get them without a restart (vLLM's flag). Connections already
open keep what they were made with."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Optional

logger = logging.getLogger(__name__)


def _stamps(paths: list[str]) -> list[Optional[tuple[int, int]]]:
    stamps: list[Optional[tuple[int, int]]] = []
    for path in paths:
        try:
            status = os.stat(path)
            stamps.append((status.st_mtime_ns, status.st_size))
        except OSError:
            stamps.append(None)
    return stamps


async def refresh_tls(
    context: ssl.SSLContext, certfile: str, keyfile: str, ca_certs: Optional[str], interval: float = 1.0
) -> None:
    """Watch the files (their modification time and size, every `interval` seconds) and load them into `context`
    when any changes; a set that does not load (a key that does not match the new certificate, a file half
    written) is logged and the previous one kept, until the next change."""
    paths = [certfile, keyfile, *([ca_certs] if ca_certs else [])]
    seen = _stamps(paths)
    while True:
        await asyncio.sleep(interval)
        now = _stamps(paths)
        if now == seen:
            continue
        seen = now
        try:
            context.load_cert_chain(certfile, keyfile)
            if ca_certs:
                context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as error:
            logger.error("the TLS files changed but do not load (%s): new connections keep the previous ones", error)
        else:
            logger.info("the TLS files changed: new connections get them")
