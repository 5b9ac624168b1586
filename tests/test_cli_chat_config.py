"""`specdec run --chat` with a GGUF chat template, and target/draft pairs from a config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TARGET_HPARAMS, target_tensors
from gguf import GGUFValue, GGUFValueType
from ggufgen import Vocab, llama_metadata, write_gguf
from test_cli_run import GREEDY, assert_user_error, specdec

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> Path:
    """The target, with a ChatML template in its metadata."""
    metadata = llama_metadata(TARGET_HPARAMS, vocab)
    metadata["tokenizer.chat_template"] = GGUFValue(CHATML, GGUFValueType.STRING)
    path = tmp_path_factory.mktemp("chat") / "chat.gguf"
    return write_gguf(path, metadata, target_tensors(vocab))


def test_chat_wraps_the_prompt_in_the_template(chat_model: Path) -> None:
    args = ["-n", "12", "--json", *GREEDY]
    chat = json.loads(specdec("run", "-m", str(chat_model), "-p", "hello", "--chat", *args).stdout)
    system = json.loads(
        specdec(
            "run", "-m", str(chat_model), "-p", "hello", "--chat", "--system", "be brief", *args
        ).stdout
    )
    templated = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    by_hand = json.loads(specdec("run", "-m", str(chat_model), "-p", templated, *args).stdout)
    plain = json.loads(specdec("run", "-m", str(chat_model), "-p", "hello", *args).stdout)
    assert chat["prompt_tokens"] > plain["prompt_tokens"]
    assert system["prompt_tokens"] > chat["prompt_tokens"]
    # The chat prompt is the template's text (the template brings no BOS of its own).
    assert chat["prompt_tokens"] == by_hand["prompt_tokens"] - 1


def test_chat_without_template_is_refused(target_model: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-p", "hello", "--chat")
    assert_user_error(result, "no chat template", "--chat")


def test_pair_from_config(target_model: Path, draft_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(
        f'[models.big]\npath = "{target_model}"\n\n[models.small]\npath = "{draft_model}"\n\n'
        '[pairs.tiny]\ntarget = "big"\ndraft = "small"\nk = 2\ntemp = 0\nn_predict = 9\n'
    )
    result = specdec(
        "run", "-m", "tiny", "--config", str(config), "-p", "Once", "--json", "-t", "1"
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["k"] == "2" and record["tokens"] == 9 and record["drafted"] > 0
    alone = specdec(
        "run", "-m", "big", "--config", str(config), "-p", "Once", "-n", "9", "--json", *GREEDY
    )
    assert json.loads(alone.stdout)["text"] == record["text"]  # the pair's temp 0 applied
    # The command line wins over the pair's defaults.
    longer = specdec(
        "run",
        "-m",
        "tiny",
        "--config",
        str(config),
        "-p",
        "Once",
        "-n",
        "5",
        "-k",
        "1",
        "--json",
        "-t",
        "1",
    )
    record = json.loads(longer.stdout)
    assert record["tokens"] == 5 and record["k"] == "1"


def test_unknown_config_name_is_a_missing_file(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text("")
    result = specdec("run", "-m", "nosuchmodel", "--config", str(config), "-p", "x")
    assert_user_error(result, "not found")
