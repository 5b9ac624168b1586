"""The engine flags, declared once (specdec_cli.commands.options) for every command that loads
models: each command offers them, in one block, and receives what was given."""

import sys
from pathlib import Path

import pytest
import typer.main

from specdec_cli.commands.cli import app, main
from specdec_cli.commands.flags import ENGINE_FLAGS

MODEL_COMMANDS = ["run", "bench", "serve"]


@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_each_model_command_offers_the_engine_flags_in_one_block(name: str) -> None:
    params = [p.name for p in typer.main.get_command(app).commands[name].params]
    start = params.index("ctx_size")
    assert params[start : start + len(ENGINE_FLAGS)] == list(ENGINE_FLAGS)
    assert "engine_flags" not in params


@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_each_model_command_receives_the_engine_flags(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SPECDEC_CONFIG", raising=False)  # the user's model names stay out
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    # Refused by the config merge before any model is looked for: the values got through.
    args = [name, "-m", "no-such.gguf", "-d", "ngram", "--draft-min", "5", "--draft-max", "2"]
    args += ["-p", "hi"] if name == "run" else []  # else run reads its prompt from stdin
    monkeypatch.setattr(sys, "argv", ["specdec", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert "--draft-min (5) is above --draft-max (2)" in capsys.readouterr().err
