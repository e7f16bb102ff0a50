"""An image from what a caller sent: encoded bytes (PNG, JPEG, WebP, GIF, BMP, ...), a `data:` URL, a file under an
allowed folder, or a PIL image; decoded to RGB with Pillow. Fetching an http(s) URL is the server's (engine/ holds
no HTTP client): it hands the bytes here."""

from __future__ import annotations

import base64
import binascii
import io
import threading
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlparse

from engine.errors import InvalidParameterError

# Pillow's own guard against decompression bombs is a warning up to twice this; refused here at once.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# A request's images together (a few KiB of PNG can decode to MAX_IMAGE_PIXELS: a body of them would otherwise hold
# gigabytes of pixels at once).
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS
# The formats clients send images in; not every one Pillow opens (EPS would run Ghostscript, where installed).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO")


class PixelBudget:
    """The pixels a request's images may still decode to, together (its images decode on several threads)."""

    def __init__(self, total: int = MAX_REQUEST_PIXELS):
        self.total = self.left = total
        self._lock = threading.Lock()

    def take(self, pixels: int, param: str) -> None:
        with self._lock:
            if pixels > self.left:
                raise InvalidParameterError(param, f"takes the request's images past {self.total} pixels together")
            self.left -= pixels


def open_image(data: bytes, param: str, budget: Optional[PixelBudget] = None) -> Any:
    """The decoded image (a PIL image in RGB); InvalidParameterError naming `param` for bytes that are no image
    Pillow reads, one of more than MAX_IMAGE_PIXELS pixels, or one past the request's `budget` (checked from the
    image's header, before its pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise InvalidParameterError(
                param, f"the image is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS} allowed"
            )
        if budget is not None:
            budget.take(width * height, param)
        image.load()
    except UnidentifiedImageError:
        raise InvalidParameterError(
            param, "is not an image (no format Pillow reads: PNG, JPEG, WebP, GIF, ...)"
        ) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidParameterError(param, f"cannot be read as an image: {error}") from None
    return rgb(image)


def rgb(image: Any) -> Any:
    """A PIL image in RGB (an alpha channel composited over white, as vLLM converts RGBA)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def decode_data_url(url: str, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (a non-base64 data URL's percent-decoded text too)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:"):
        raise InvalidParameterError(param, "is not a valid data URL (data:image/<type>;base64,<data>)")
    media_type = header[5:].split(";")[0]
    if media_type and not media_type.startswith("image/"):
        raise InvalidParameterError(param, f"is a data URL of {media_type!r}, not of an image")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParameterError(param, "holds invalid base64 data") from None
    return unquote(payload).encode("latin-1", errors="replace")


def read_local_image(url: str, allowed: Optional[Path], param: str) -> bytes:
    """The bytes of a `file://` URL's file, which must lie under `allowed` (vLLM's --allowed-local-media-path;
    None: no file is read)."""
    if allowed is None:
        raise InvalidParameterError(
            param, "is a file URL; the server reads local files only under --allowed-local-media-path"
        )
    try:
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(allowed.resolve()):
            raise InvalidParameterError(param, "names a file outside --allowed-local-media-path")
        if not path.is_file():
            raise InvalidParameterError(param, "names no file under --allowed-local-media-path")
        return path.read_bytes()
    except InvalidParameterError:
        raise
    except (OSError, ValueError, RuntimeError) as error:
        # (a NUL byte, a name too long, a symlink loop, a file the server may not read: the URL's fault, not the
        # server's; only the OS's reason is told, never the error's text, which names the resolved path)
        reason = f" ({error.strerror})" if isinstance(error, OSError) and error.strerror else ""
        raise InvalidParameterError(param, f"names a file that cannot be read{reason}") from None


def offline_image(kind: str, source: Any, allowed: Optional[Path], param: str) -> Any:
    """The image of an offline chat's image part: a PIL image (`image_pil`), or an `image_url`'s `data:` or
    `file://` URL (http(s) URLs are the server's to fetch: the offline API reads none)."""
    from PIL import Image

    if kind == "image_pil":
        if not isinstance(source, Image.Image):
            raise InvalidParameterError(param, f"needs a PIL image, not {type(source).__name__}")
        return rgb(source)
    url = source.get("url") if isinstance(source, dict) else source
    if not isinstance(url, str):
        raise InvalidParameterError(param, 'needs {"url": "..."} with a data: or file:// URL')
    if url.startswith("data:"):
        return open_image(decode_data_url(url, param), param)
    if url.startswith("file:"):
        return open_image(read_local_image(url, allowed, param), param)
    raise InvalidParameterError(
        param, "is not a data: or file:// URL (the offline API fetches nothing: pass the image as image_pil)"
    )


def pil_images(value: Any, param: str) -> list[Any]:
    """vLLM's `multi_modal_data["image"]`: a PIL image or a list of them, in RGB."""
    from PIL import Image

    images = value if isinstance(value, (list, tuple)) else [value]
    for image in images:
        if not isinstance(image, Image.Image):
            raise InvalidParameterError(param, f"takes PIL images, not {type(image).__name__}")
    return [rgb(image) for image in images]
