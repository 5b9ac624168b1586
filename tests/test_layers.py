"""The package's layers, as docs/layout.md gives them: each uses only the ones below it
(llamacpp/ < models/ < decoding/ < the two interfaces, commands/ and serve/), and every
layer may use the top-level modules (errors, messages, interrupt, listening), which use
nothing of the package but one another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec_cli"
LAYERS = {"llamacpp": 1, "models": 2, "decoding": 3, "commands": 4, "serve": 4}
TOP = 0  # errors.py, messages.py, interrupt.py, listening.py


def layer_of(module: str) -> int:
    """`module` a dotted name within the package ("decoding.grammar")."""
    return LAYERS.get(module.split(".")[0], TOP)


def imports(path: Path) -> list[str]:
    """The package's modules that `path` imports (dotted, without "specdec_cli.")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package = node.module == "specdec_cli"  # from specdec_cli import interrupt
            names = [f"{node.module}.{a.name}" for a in node.names] if package else [node.module]
        else:
            continue
        found += [n.removeprefix("specdec_cli.") for n in names if n.startswith("specdec_cli.")]
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path: Path) -> None:
    own = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    upward = [m for m in imports(path) if layer_of(m) > layer_of(own)]
    assert not upward, f"{own} (layer {layer_of(own)}) imports {upward} from above it"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The scan itself: an import from a higher layer is found, a lower one is not."""
    module = tmp_path / "m.py"
    module.write_text(
        "from specdec_cli.decoding.grammar import Grammar\nimport specdec_cli.errors\n"
        "from specdec_cli import interrupt\n"
    )
    assert [layer_of(m) for m in imports(module)] == [3, TOP, TOP]
