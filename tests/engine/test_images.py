"""engine/multimodal/images.py: what a caller's bytes decode to, and what they may not."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from engine.errors import InvalidParameterError
from engine.multimodal.images import PixelBudget, decode_data_url, open_image
from tests.engine.vision_factories import data_url, random_image


def encoded(image, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format)
    return buffer.getvalue()


def test_a_requests_images_share_one_pixel_budget():
    """Checked from each image's header: the image past the budget is refused before its pixels decode."""
    budget = PixelBudget(total=2 * 30 * 30)
    small = encoded(random_image(0, 30, 30))
    assert open_image(small, "a", budget).size == (30, 30)
    assert open_image(small, "b", budget).size == (30, 30)
    with pytest.raises(InvalidParameterError, match="past 1800 pixels together") as caught:
        open_image(small, "c", budget)
    assert caught.value.field == "c"


def test_transparency_is_composited_over_white_and_formats_are_limited():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    assert open_image(encoded(rgba), "x").getpixel((0, 0)) == (255, 255, 255)
    for image_format in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        assert open_image(encoded(random_image(1, 8, 8), image_format), "x").mode == "RGB"
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"
    with pytest.raises(InvalidParameterError, match="is not an image"):
        open_image(eps, "x")


def test_data_urls():
    image = random_image(2, 8, 8)
    assert open_image(decode_data_url(data_url(image), "u"), "u").size == (8, 8)
    with pytest.raises(InvalidParameterError, match="invalid base64"):
        decode_data_url("data:image/png;base64,@@@", "u")
    with pytest.raises(InvalidParameterError, match="not of an image"):
        decode_data_url("data:text/plain;base64,aGk=", "u")
