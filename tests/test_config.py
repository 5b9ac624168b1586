"""The named-models config file: where it is found, what it accepts, what it refuses."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from specdec_cli.errors import UserError
from specdec_cli.models.config import Config, ModelSpec, PairSpec, default_config_path, load_config

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never read the developer's own config."""
    monkeypatch.delenv("SPECDEC_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path | str | None) -> str:
    with pytest.raises(UserError) as info:
        load_config(None if path is None else str(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_default_file_is_an_empty_config() -> None:
    config = load_config(None)
    assert config == Config()
    assert config.resolve("some/file.gguf") == ModelSpec(path="some/file.gguf")


def test_default_path_follows_xdg_config_home(tmp_path: Path) -> None:
    assert default_config_path() == tmp_path / "xdg" / "specdec" / "models.toml"
    write(default_config_path(), '[models.m]\npath = "/m.gguf"\n')
    assert load_config(None).resolve("m") == ModelSpec(path="/m.gguf", name="m")


def test_env_var_is_used_and_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = write(tmp_path / "env.toml", '[models.m]\npath = "/env.gguf"\n')
    monkeypatch.setenv("SPECDEC_CONFIG", str(config_file))
    assert load_config(None).resolve("m").path == "/env.gguf"
    monkeypatch.setenv("SPECDEC_CONFIG", str(tmp_path / "gone.toml"))
    message = error_of(None)
    assert "gone.toml" in message and "SPECDEC_CONFIG" in message


def test_explicit_path_wins_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CONFIG", str(tmp_path / "gone.toml"))
    config_file = write(tmp_path / "cli.toml", '[models.m]\npath = "/cli.gguf"\n')
    assert load_config(str(config_file)).resolve("m").path == "/cli.gguf"


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    message = error_of(tmp_path / "nope.toml")
    assert message.startswith("config file not found:") and "nope.toml" in message


def test_models_pairs_and_relative_paths(tmp_path: Path) -> None:
    config_file = write(
        tmp_path / "conf" / "models.toml",
        textwrap.dedent("""
        [models.big]
        path = "weights/big.gguf"
        n_gpu_layers = -1
        n_ctx = 4096
        threads = 8

        [models.small]
        path = "hf://owner/repo/small-Q8_0.gguf"

        [pairs.duo]
        target = "big"
        draft = "small"
        k = 4
        temp = 0
        top_p = 0.9
        seed = 7
        """),
    )
    config = load_config(str(config_file))
    big = ModelSpec(
        path=str(tmp_path / "conf" / "weights" / "big.gguf"),
        name="big",
        n_gpu_layers=-1,
        n_ctx=4096,
        threads=8,
    )
    small = ModelSpec(path="hf://owner/repo/small-Q8_0.gguf", name="small")
    assert config.resolve("big") == big
    assert config.resolve("small") == small
    pair = config.resolve("duo")
    assert pair == PairSpec(
        name="duo", target=big, draft=small, k="4", sampling={"temp": 0.0, "top_p": 0.9, "seed": 7}
    )
    assert isinstance(pair.sampling["temp"], float)
    assert config.resolve("elsewhere.gguf") == ModelSpec(path="elsewhere.gguf")


def test_pair_members_may_be_paths_or_hub_refs(tmp_path: Path) -> None:
    config_file = write(
        tmp_path / "models.toml",
        '[pairs.p]\ntarget = "~/t.gguf"\ndraft = "owner/repo:Q4_0"\n',
    )
    pair = load_config(str(config_file)).resolve("p")
    assert isinstance(pair, PairSpec)
    assert pair.target == ModelSpec(path=str(tmp_path / "home" / "t.gguf"))
    assert pair.draft == ModelSpec(path="owner/repo:Q4_0")
    assert pair.k is None and pair.sampling == {}


def test_pair_k_may_be_auto(tmp_path: Path) -> None:
    """-k auto is the command line's default; a pair may say it too."""
    config_file = write(
        tmp_path / "models.toml", '[pairs.p]\ntarget = "a"\ndraft = "b"\nk = "auto"\n'
    )
    pair = load_config(str(config_file)).resolve("p")
    assert isinstance(pair, PairSpec) and pair.k == "auto"


def test_specs_are_frozen() -> None:
    spec = ModelSpec(path="x.gguf")
    with pytest.raises(AttributeError):
        spec.path = "y.gguf"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[models.m\n", "invalid TOML"),
        ('[models.m]\npath = "a.gguf"\npth = "b"\n', "models.m.pth: unknown key"),
        ('[models.m]\npath = "a.gguf"\nn_ctx = "4096"\n', "models.m.n_ctx: must be an integer"),
        ('[models.m]\npath = "a.gguf"\nthreads = true\n', "models.m.threads: must be an integer"),
        ('[models.m]\npath = ""\n', "models.m.path: must be a non-empty string"),
        ("[models.m]\nn_ctx = 1\n", "models.m.path: missing"),
        ('[pairs.p]\ntarget = "a.gguf"\n', "pairs.p.draft: missing"),
        ('[pairs.p]\ntarget = "a"\ndraft = "b"\ntemp = "hot"\n', "pairs.p.temp: must be a number"),
        ('[pairs.p]\ntarget = "a"\ndraft = "b"\nk = 0\n', "pairs.p.k: must be a number of at"),
        ('[pairs.p]\ntarget = "a"\ndraft = "b"\nk = "many"\n', "pairs.p.k: must be a number of"),
        ('[pairs.p]\ntarget = "a"\ndraft = "b"\ntree = 1\n', 'pairs.p.tree: must be "off", "auto"'),
        ('[pairs.p]\ntarget = "a"\ndraft = "b"\ntree = "wide"\n', "pairs.p.tree: must be"),
        ('[pairs.p]\ntarget = "a"\ndraft = "b"\nn_gpu_layers = 1\n', "pairs.p.n_gpu_layers"),
        ('[pairs.p]\ntarget = "p"\ndraft = "b"\n', "pairs.p.target: 'p' is a pair"),
        ('[model.m]\npath = "a.gguf"\n', "model: unknown table"),
        ('models = "x"\n', "models: must be a table"),
        ('[models]\nm = "a.gguf"\n', "models.m: must be a table"),
        ('[models.x]\npath = "a"\n[pairs.x]\ntarget = "a"\ndraft = "b"\n', "pairs.x: the same"),
    ],
)
def test_bad_files_name_the_file_and_the_key(tmp_path: Path, text: str, expected: str) -> None:
    config_file = write(tmp_path / "bad.toml", text)
    message = error_of(config_file)
    assert message.startswith(f"{config_file.resolve()}: ")
    assert expected in message


def test_the_example_file_is_valid() -> None:
    config = load_config(str(REPO_ROOT / "models.example.toml"))
    pair = config.resolve("qwen")
    assert isinstance(pair, PairSpec)
    assert pair.target.path == "Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M"
    assert pair.draft.name == "qwen0.5b"
    assert set(pair.sampling) == {"temp", "top_k", "top_p", "min_p", "seed", "n_predict"}
    stories = config.resolve("stories")
    assert isinstance(stories, PairSpec)
    assert stories.target.path == str(REPO_ROOT / "models" / "tinystories-110m-q8_0.gguf")
