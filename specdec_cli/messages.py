"""One-line notes and warnings on stderr, for every command and the server (stdout is
the generated text's, or JSON's)."""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    print(f"specdec: warning: {message}", file=sys.stderr)


def note(message: str) -> None:
    print(f"specdec: {message}", file=sys.stderr)
