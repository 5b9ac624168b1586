"""Where prompts come from: -p, -f, stdin, a --prompts file; text that is not UTF-8; the
images and audio of --image and --audio."""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.media import Media, read_media
from specdec_cli.messages import warn


def read_prompt(prompt: str | None, file: Path | None, messages: str | None) -> str | None:
    """The prompt from -p, -f or stdin; None when --messages gives the conversation and
    neither -p nor -f is given (stdin is then left alone). Never empty: generating from
    BOS alone is not what anyone asks for."""
    if prompt is not None and file is not None:
        raise UserError("give the prompt with -p or with -f, not both")
    # Like llama.cpp's -f: one trailing newline is the file's end, not part of the prompt.
    if file is not None:
        text, origin = read_text(file).removesuffix("\n"), str(file)
    elif prompt is None and messages is not None:
        return None
    elif prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        text, origin = decode(sys.stdin.buffer.read(), "stdin").removesuffix("\n"), "stdin"
    elif prompt is None:
        raise UserError("no prompt: give -p TEXT, -f FILE, or pipe text on stdin")
    else:
        text, origin = prompt, "-p"
    if not text:
        raise UserError(f"the prompt ({origin}) is empty; give some text with -p, -f or stdin")
    return text


def read_prompts(path: Path) -> dict[int, str]:
    """The prompts of a --prompts file by line number (from 1); blank lines are skipped."""
    return prompt_lines(read_text(path), path)


def prompt_lines(text: str, path: Path) -> dict[int, str]:
    """The prompts of a --prompts file's text (see read_prompts)."""
    lines = {number: line for number, line in enumerate(text.splitlines(), start=1) if line.strip()}
    if not lines:
        raise UserError(f"{path} has no prompts; write one prompt per line")
    return lines


def read_text(path: Path) -> str:
    try:
        return decode(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise UserError(f"file not found: {path}; check the path") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None


def decode(data: bytes, origin: str) -> str:
    """UTF-8 text; other bytes (a Latin-1 file, binary input) become U+FFFD, said once."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        warn(
            f"{origin} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "bytes that are not UTF-8 were replaced with U+FFFD (convert the text to UTF-8 "
            "to keep them)"
        )
        return data.decode("utf-8", errors="replace")


def read_media_files(images: list[Path], audio: list[Path]) -> list[Media]:
    """--image's and --audio's files, read and checked (see media.py), the images first.
    A file of the other kind is refused: it was passed with the wrong flag."""
    media = []
    for kind, flag, paths in (("image", "--image", images), ("audio", "--audio", audio)):
        for path in paths:
            item = read_media(path)
            if item.kind != kind:
                other = "--audio" if kind == "image" else "--image"
                raise UserError(
                    f"{path} is not {'an image' if kind == 'image' else 'audio'} "
                    f"({flag}); pass it with {other}"
                )
            media.append(item)
    return media
