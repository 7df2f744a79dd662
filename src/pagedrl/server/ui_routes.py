"""The chat page at `/` (`server/ui/chat.html`) and its icon, with the headers that keep the page to itself.

The page's Content-Security-Policy is sent as a header, where `frame-ancestors` counts (a `<meta>` tag
cannot carry it, and Chromium logs an error for trying), with `X-Frame-Options` for older browsers and
`nosniff`: no other site can frame the page to click through it, and nothing it loads is read as
another type than it says. The page keeps its own `<meta>` policy too, for a copy opened from disk.
`/favicon.ico` is a small icon made here, so that the one request every browser makes is not a 404.
"""

from __future__ import annotations

import struct
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                           "form-action 'none'")
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
ACCENT = (0x1F, 0x6F, 0xEB)  # the page's --accent


def favicon_ico(size: int = 16, rgb: tuple[int, int, int] = ACCENT) -> bytes:
    """A one-image ICO file: a `size`-pixel disc in `rgb` on transparency, as a 32-bit BMP (the
    format every browser's ICO decoder reads) with its alpha channel and an all-zero AND mask."""
    r, g, b = rgb
    centre, radius = (size - 1) / 2, size / 2 - 0.5
    rows = []
    for y in range(size - 1, -1, -1):  # a BMP stores its rows bottom-up
        row = bytearray()
        for x in range(size):
            inside = (x - centre) ** 2 + (y - centre) ** 2 <= radius ** 2
            row += bytes((b, g, r, 255)) if inside else bytes(4)
        rows.append(bytes(row))
    mask_row = bytes(((size + 31) // 32) * 4)  # 1 bit a pixel, rows padded to 4 bytes; alpha decides instead
    pixels = b"".join(rows) + mask_row * size
    # BITMAPINFOHEADER: the height counts the colour rows and the mask rows
    header = struct.pack("<IiiHHIIiiII", 40, size, 2 * size, 1, 32, 0, len(pixels), 0, 0, 0, 0)
    image = header + pixels
    directory = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", size % 256, size % 256, 0, 0, 1, 32,
                                                           len(image), 6 + 16)
    return directory + image


def ui_router() -> APIRouter:
    """`/` and `/favicon.ico`, both left out of /openapi.json: they are not part of the API."""
    router = APIRouter()
    page = (Path(__file__).parent / "ui" / "chat.html").read_bytes()
    icon = favicon_ico()

    @router.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @router.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(icon, media_type="image/x-icon",
                        headers={"Cache-Control": "max-age=86400", "X-Content-Type-Options": "nosniff"})

    return router
