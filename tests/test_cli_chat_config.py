"""`specdec run --chat`, --messages and --chat-template, vocabulary-only files refused, and
target/draft pairs from a config."""

from __future__ import annotations

import json
from collections.abc import Callable
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
    # The template writes no BOS and the vocabulary adds one, as to a plain prompt: the
    # chat prompt is exactly the hand-written one (it used to lack the BOS).
    assert chat["prompt_tokens"] == by_hand["prompt_tokens"]
    assert chat["text"] == by_hand["text"]


CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "tell me a story"},
]
CONVERSATION_CHATML = (
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\ntell me a story<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_messages_file_is_the_conversation(chat_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(CONVERSATION))
    args = ["-m", str(chat_model), "-n", "12", "--json", *GREEDY]
    # --messages implies --chat; a prompt on stdin is not read in its place.
    result = specdec("run", "--messages", str(path), *args, stdin="ignored")
    by_hand = json.loads(specdec("run", "-p", CONVERSATION_CHATML, *args).stdout)
    assert json.loads(result.stdout)["text"] == by_hand["text"]
    assert json.loads(result.stdout)["prompt_tokens"] == by_hand["prompt_tokens"]


def test_messages_from_stdin_then_the_prompt(chat_model: Path) -> None:
    """The history from stdin, -p as the last user turn."""
    args = ["-m", str(chat_model), "-n", "12", "--json", *GREEDY]
    stdin = json.dumps(CONVERSATION[:3])
    result = specdec("run", "--messages", "-", "-p", "tell me a story", *args, stdin=stdin)
    assert result.returncode == 0, result.stderr
    by_hand = json.loads(specdec("run", "-p", CONVERSATION_CHATML, *args).stdout)
    assert json.loads(result.stdout)["text"] == by_hand["text"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('[{"role": "user", "content": "a"}, {"role": "user"}]', ['messages[1] has no "content"']),
        ("not json", ["is not valid JSON", "line 1, column 1"]),
    ],
)
def test_bad_messages_file(
    chat_model: Path, tmp_path: Path, content: str, words: list[str]
) -> None:
    path = tmp_path / "messages.json"
    path.write_text(content)
    result = specdec("run", "-m", str(chat_model), "--messages", str(path))
    assert_user_error(result, str(path), *words)


def test_chat_template_supplies_a_missing_template(target_model: Path, chat_model: Path) -> None:
    """The target has no template: naming the format works (and implies --chat)."""
    args = ["-p", "hello", "-n", "12", "--json", *GREEDY]
    named = specdec("run", "-m", str(target_model), "--chat-template", "chatml", *args)
    assert named.returncode == 0, named.stderr
    own = json.loads(specdec("run", "-m", str(chat_model), "--chat", *args).stdout)
    assert json.loads(named.stdout)["prompt_tokens"] == own["prompt_tokens"]


def test_a_template_file_runs_as_jinja_unless_no_jinja(target_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    args = ["run", "-m", str(target_model), "--chat-template", str(path), "-p", "hi"]
    shown = specdec(*args, "-n", "1", "-q", "--verbose-prompt")
    assert shown.returncode == 0 and "[hi]" in shown.stderr, shown.stderr
    refused = specdec(*args, "--no-jinja")
    assert_user_error(refused, "does not recognise the chat template in", str(path))


def test_chat_without_template_is_refused(target_model: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-p", "hello", "--chat")
    assert_user_error(result, target_model.name, "no chat template", "--chat-template")


def test_vocabulary_only_file_is_refused(
    target_model: Path, vocab_file: Callable[[str], Path]
) -> None:
    vocab = vocab_file("qwen2")
    for args in (["-m", str(vocab)], ["-m", str(target_model), "-d", str(vocab)]):
        result = specdec("run", *args, "-p", "hi")
        assert_user_error(result, f"{vocab.name} has no weights: it is a vocabulary-only file")


def test_pair_from_config(target_model: Path, draft_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(
        f'[models.big]\npath = "{target_model}"\n\n[models.small]\npath = "{draft_model}"\n\n'
        '[pairs.tiny]\ntarget = "big"\ndraft = "small"\nk = 2\ntemp = 0\nn_predict = 9\n'
        "tree = 6\n"
    )
    result = specdec(
        "run", "-m", "tiny", "--config", str(config), "-p", "Once", "--json", "-t", "1"
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["k"] == "2" and record["tokens"] == 9 and record["drafted"] > 0
    assert record["tree"] == "6"
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
        "--tree",
        "off",
        "--json",
        "-t",
        "1",
    )
    record = json.loads(longer.stdout)
    assert record["tokens"] == 5 and record["k"] == "1" and record["tree"] == "off"


def test_unknown_config_name_is_a_missing_file(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text("")
    result = specdec("run", "-m", "nosuchmodel", "--config", str(config), "-p", "x")
    assert_user_error(result, "not found")
