"""Turn token bytes into printable text as they arrive.

Two things make this more than `bytes.decode`: a token can end in the middle of a
multi-byte UTF-8 character (hold it until the character is complete), and a stop
string can arrive split over several tokens (hold back any tail that could be the
start of one, and cut the text where one is found).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


def tail_starting(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`: text to hold back
    while a marker (a stop string, a tag) may be arriving cut in two."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet released: might begin a stop string
        self._released: list[str] = []
        self._n_released = 0  # characters, kept as a count: asked for every token
        self.stopped = False

    def push(self, data: bytes) -> str:
        """Feed bytes; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._pending) - self._held_back())

    def flush(self) -> str:
        """End of generation: release whatever is held."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        cut = self._find_stop()
        self.stopped = cut is not None
        return self._release(len(self._pending) if cut is None else cut)

    def _find_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that starts a stop string."""
        return max((tail_starting(self._pending, s) for s in self.stop), default=0)

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self._released.append(out)
        self._n_released += len(out)
        return out

    @property
    def received(self) -> int:
        """Characters pushed so far, released or held (a character still incomplete
        not counted): where the next push's text begins."""
        return self._n_released + len(self._pending)

    @property
    def length(self) -> int:
        """Characters released so far: after a stop string, the whole text's length."""
        return self._n_released

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)
