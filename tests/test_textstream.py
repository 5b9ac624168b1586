"""Token bytes to text: whole UTF-8 characters only, stop strings cut where they start."""

from __future__ import annotations

from specdec_cli.decoding.textstream import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.push(p) for p in pieces] + [stream.flush()]


def test_multibyte_character_split_over_tokens_is_held_until_complete() -> None:
    euro = "€".encode()  # three bytes
    out = feed(TextStream(), [b"price: ", euro[:1], euro[1:2], euro[2:], b"5"])
    assert out == ["price: ", "", "", "€", "5", ""]


def test_invalid_bytes_become_replacement_characters_not_errors() -> None:
    stream = TextStream()
    assert stream.push(b"a\xff") == "a\ufffd"
    assert stream.flush() == ""


def test_stop_string_across_tokens_is_never_shown() -> None:
    stream = TextStream(stop=["</end>"])
    out = feed(stream, [b"hello </", b"en", b"d> after"])
    assert "".join(out) == "hello "
    assert stream.stopped
    assert out[0] == "hello "  # the possible start of the stop string was held back
    assert stream.text == "hello "


def test_held_text_that_is_not_a_stop_string_is_released() -> None:
    stream = TextStream(stop=["STOP"])
    assert stream.push(b"ST") == ""
    assert stream.push(b"ART") == "START"
    assert stream.flush() == ""
    assert not stream.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    stream = TextStream(stop=["world", "lo"])
    assert "".join(feed(stream, [b"hello world"])) == "hel"


def test_pending_tail_is_released_at_the_end() -> None:
    stream = TextStream(stop=["\n\n"])
    assert stream.push(b"line\n") == "line"
    assert stream.flush() == "\n"
    assert stream.text == "line\n"
