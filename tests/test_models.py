"""locate_model: from what the user typed to a checked local GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec_cli.errors import UserError
from specdec_cli.models import resolve
from specdec_cli.models.config import load_config
from specdec_cli.models.resolve import locate_draft, locate_model

GGUF_HEADER = b"GGUF" + (3).to_bytes(4, "little") + bytes(16)  # v3, no tensors, no metadata


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECDEC_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def hub_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stand in for the Hub (tested in test_hub.py): record refs, return a local file."""
    calls: list[str] = []
    downloaded = gguf(tmp_path / "downloaded.gguf")

    def fake_fetch(ref: str) -> Path:
        calls.append(ref)
        return downloaded

    monkeypatch.setattr(resolve, "fetch_gguf", fake_fetch)
    return calls


def gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(GGUF_HEADER)
    return path


def error_of(ref: str, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        locate_model(ref, **kwargs)
    return str(info.value)


def test_local_file(tmp_path: Path) -> None:
    model = gguf(tmp_path / "m.gguf")
    assert locate_model(str(model)) == model


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model = gguf(tmp_path / "m.gguf")
    assert locate_model("~/m.gguf") == model


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    message = error_of(str(missing))
    assert message.startswith(f"model file not found: {missing}; check the path")


def test_missing_file_names_the_config(tmp_path: Path) -> None:
    config_file = tmp_path / "models.toml"
    config_file.write_text("")
    message = error_of("nope.gguf", config=load_config(str(config_file)))
    assert f"name a model from {config_file}" in message


def test_directory(tmp_path: Path) -> None:
    assert "is a directory" in error_of(str(tmp_path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert "is not a GGUF file" in error_of(str(text))


def test_config_name(tmp_path: Path) -> None:
    model = gguf(tmp_path / "weights" / "small.gguf")
    config_file = tmp_path / "models.toml"
    config_file.write_text('[models.small]\npath = "weights/small.gguf"\n')
    assert locate_model("small", load_config(str(config_file))) == model


def test_config_is_read_when_not_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = gguf(tmp_path / "small.gguf")
    config_file = tmp_path / "models.toml"
    config_file.write_text(f'[models.small]\npath = "{model}"\n')
    monkeypatch.setenv("SPECDEC_CONFIG", str(config_file))
    assert locate_model("small") == model


def test_config_name_of_a_hub_model(tmp_path: Path, hub_calls: list[str]) -> None:
    config_file = tmp_path / "models.toml"
    config_file.write_text('[models.qwen]\npath = "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0"\n')
    located = locate_model("qwen", load_config(str(config_file)))
    assert located == tmp_path / "downloaded.gguf"
    assert hub_calls == ["Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0"]


def test_pair_name_is_not_a_model(tmp_path: Path) -> None:
    config_file = tmp_path / "models.toml"
    config_file.write_text('[pairs.duo]\ntarget = "t.gguf"\ndraft = "d.gguf"\n')
    message = error_of("duo", config=load_config(str(config_file)))
    assert message.startswith("'duo' is a target/draft pair")


def test_hub_refs_go_to_the_hub(hub_calls: list[str]) -> None:
    locate_model("hf://owner/repo/m.gguf")
    locate_model("owner/repo:Q4_K_M")
    assert hub_calls == ["hf://owner/repo/m.gguf", "owner/repo:Q4_K_M"]


def test_an_existing_file_wins_over_a_hub_shaped_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub_calls: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    gguf(tmp_path / "models" / "tiny")
    assert locate_model("models/tiny") == Path("models/tiny")
    assert hub_calls == []


@pytest.mark.parametrize("ref", ["none", "None", "NONE"])
def test_draft_none_means_no_draft(ref: str) -> None:
    assert locate_draft(ref) is None


def test_draft_is_located_like_a_model(tmp_path: Path) -> None:
    model = gguf(tmp_path / "d.gguf")
    assert locate_draft(str(model)) == model
    with pytest.raises(UserError, match="model file not found"):
        locate_draft(str(tmp_path / "missing.gguf"))
