"""Images and audio checked before libmtmd sees them.

libmtmd decodes whatever bytes it is given (stb_image for images, miniaudio for audio), and
says only that it failed. So a file is read here first: its kind from its first bytes (the
formats this build of libmtmd decodes), an image's size from its header, and the limits
below, each refused in one line that names the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import UserError

MAX_MEDIA_BYTES = 20 * 2**20  # 20 MiB a file (OpenAI's limit on an image)
MAX_IMAGE_PIXELS = 2**26  # 8192 x 8192: 192 MiB once decoded to RGB

IMAGE_FORMATS = "PNG, JPEG, GIF or BMP"
AUDIO_FORMATS = "WAV, MP3 or FLAC"
# JPEG's start-of-frame markers, the segments that hold the image's size.
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xDA)) | {0x01}  # markers without a length


@dataclass(frozen=True)
class Media:
    """A file's bytes, checked: an image (with its size in pixels) or audio."""

    kind: str  # "image" or "audio"
    data: bytes
    name: str  # how messages call it: the file's name, or the request's part
    width: int = 0
    height: int = 0


def not_taken(media: Media, projector: str, vision: bool, audio: bool) -> str | None:
    """Why a projector (named `projector`, taking images where `vision`, audio where
    `audio`) cannot take `media`; None where it can."""
    if {"image": vision, "audio": audio}[media.kind]:
        return None
    what, other = ("an image", "audio") if media.kind == "image" else ("audio", "images")
    return f"{media.name} is {what}, but the projector {projector} takes {other} only"


def read_media(path: Path) -> Media:
    """An image or audio file, checked (see media_from_bytes)."""
    try:
        size = path.stat().st_size
        if size > MAX_MEDIA_BYTES:
            raise UserError(_too_large(path.name, size))
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path} not found; check the path") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory; pass an image or audio file") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    return media_from_bytes(data, path.name)


def media_from_bytes(data: bytes, name: str) -> Media:
    """`data` as an image or audio, by its first bytes; its size and pixels within the
    limits. Anything else is a UserError naming `name`."""
    if not data:
        raise UserError(f"{name} is empty; pass an image ({IMAGE_FORMATS}) or audio file")
    if len(data) > MAX_MEDIA_BYTES:
        raise UserError(_too_large(name, len(data)))
    if _is_audio(data):
        return Media("audio", data, name)
    image_format = _image_format(data)
    if image_format is None:
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            raise UserError(
                f"{name} is a WebP image, which this build of libmtmd cannot decode; "
                f"convert it to {IMAGE_FORMATS}"
            )
        raise UserError(
            f"{name} is not an image ({IMAGE_FORMATS}) or audio ({AUDIO_FORMATS}): "
            f"it starts with {data[:8]!r}"
        )
    size = _IMAGE_SIZES[image_format](data)
    if size is None or 0 in size:
        raise UserError(f"{name} starts like a {image_format} image but its header is damaged")
    width, height = size
    if width * height > MAX_IMAGE_PIXELS:
        raise UserError(
            f"{name} is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} an image "
            "may have; scale it down"
        )
    return Media("image", data, name, width, height)


def _too_large(name: str, size: int) -> str:
    return (
        f"{name} is {size / 2**20:.1f} MiB, more than the {MAX_MEDIA_BYTES // 2**20} MiB a "
        "file may have; send a smaller one"
    )


def _is_audio(data: bytes) -> bool:
    """libmtmd's own test (mtmd-helper.cpp): WAV, MP3 (a tag or a frame's sync bits), FLAC."""
    return (
        (data[:4] == b"RIFF" and data[8:12] == b"WAVE")
        or data[:3] == b"ID3"
        or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
        or data[:4] == b"fLaC"
    )


def _image_format(data: bytes) -> str | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM":
        return "BMP"
    return None


def _png_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 24 or data[12:16] != b"IHDR":
        return None
    return struct.unpack_from(">II", data, 16)


def _gif_size(data: bytes) -> tuple[int, int] | None:
    return struct.unpack_from("<HH", data, 6) if len(data) >= 10 else None


def _bmp_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 26:
        return None
    if struct.unpack_from("<I", data, 14)[0] == 12:  # the old OS/2 header: 16-bit sizes
        return struct.unpack_from("<HH", data, 18)
    width, height = struct.unpack_from("<ii", data, 18)
    return abs(width), abs(height)  # a negative height is stored top-down


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Walk the segments after the start marker to the first frame header."""
    i = 2
    while i + 9 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker in _JPEG_STANDALONE:
            i += 2
        elif marker in _JPEG_FRAMES:
            height, width = struct.unpack_from(">HH", data, i + 5)
            return width, height
        else:
            i += 2 + struct.unpack_from(">H", data, i + 2)[0]
    return None


_IMAGE_SIZES = {"PNG": _png_size, "JPEG": _jpeg_size, "GIF": _gif_size, "BMP": _bmp_size}
