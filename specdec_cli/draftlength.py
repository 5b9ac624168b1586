"""How many tokens to draft each round."""

from __future__ import annotations

from typing import Protocol


class DraftLength(Protocol):
    def choose(self, limit: int) -> int: ...

    def observe(self, drafted: int, accepted: int) -> None: ...


class FixedLength:
    """Always k (less near the end of -n or of the context)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, limit: int) -> int:
        return max(0, min(self.k, limit))

    def observe(self, drafted: int, accepted: int) -> None:
        pass
