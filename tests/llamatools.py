"""llama.cpp's own command-line tools, the references tests compare specdec with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def llama_tool(name: str) -> Path:
    """One of llama.cpp's tools (.ci/build_tools builds them; SPECDEC_LLAMA_TOOLS names
    their folder); the test is skipped where it is not built."""
    tool = Path(os.environ.get("SPECDEC_LLAMA_TOOLS") or "/nonexistent") / name
    if not tool.is_file():
        pytest.skip(f"llama.cpp's {name} not built: run bash .ci/build_tools")
    return tool


# Tokens a comparison asks llama.cpp's tools for beyond the text it compares: their
# logger may lose its last lines at exit (see the tests that use it).
TOOL_MARGIN = 16
