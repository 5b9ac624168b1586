"""`specdec info` and `specdec check`, run through the real entry point (exit codes included)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_gguf_meta import string, tiny_model

from specdec_cli.commands import modelinfo
from specdec_cli.commands.cli import main
from specdec_cli.models.compat import read_facts


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the user's own config file (model names) out of these tests."""
    monkeypatch.delenv("SPECDEC_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def run_cli(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `specdec ARGS`; never a traceback."""
    monkeypatch.setattr(sys, "argv", ["specdec", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return exited.value.code, out, err


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0"), (999, "999"), (292_800, "292.8K"), (46_200_000, "46.2M"), (7_241_732_096, "7.2B")],
)
def test_human_count(n: int, text: str) -> None:
    assert modelinfo.human_count(n) == text


@pytest.mark.parametrize(
    ("n", "text"), [(512, "512 B"), (1_185_376, "1.2 MB"), (4_683_073_536, "4.7 GB")]
)
def test_human_bytes(n: int, text: str) -> None:
    assert modelinfo.human_bytes(n) == text


def test_describe(target_model: Path) -> None:
    facts = modelinfo.describe(read_facts(target_model))
    assert facts == {
        "file": str(target_model),
        "architecture": "llama",
        "vocab_only": False,
        "parameters": facts["parameters"],  # checked below
        "layers": 4,
        "embedding_width": 64,
        "context_length": 256,
        "vocab_type": "llama",
        "vocab_size": 495,
        "bos": {"id": 1, "text": "<s>"},
        "eos": {"id": 2, "text": "</s>"},
        "add_bos": True,
        "quantization": "F32",
        "file_size": target_model.stat().st_size,
        "chat_template": False,
        "split_count": 1,
        "drafting_head": {
            "method": None,
            "heads": 0,
            "reads_layers": [],
            "blocks": [],
            "problem": None,
        },
    }
    # Embedding and output (495 x 64 each), output norm, 4 layers of attention and FFN.
    per_layer = 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 64 + 3 * 128 * 64
    assert facts["parameters"] == 2 * 495 * 64 + 64 + 4 * per_layer


def test_info_lines_when_piped(
    stories260k: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(["info", str(stories260k)], monkeypatch, capsys)
    assert code == 0
    lines = out.splitlines()
    for line in (
        "architecture: llama",
        "parameters: 292.8K",
        "layers: 5",
        "embedding width: 64",
        "context length (trained): 2048",
        "vocabulary: llama, 512 tokens",
        "BOS: 1 '<s>', added to prompts",
        "EOS: 2 '</s>'",
        "quantization: F32",
        "file size: 1.2 MB",
        "chat template: no",
    ):
        assert line in lines


def test_info_table_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tiny_model(tmp_path / "m.gguf", changes={"tokenizer.chat_template": string("{{x}}")})
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    modelinfo.print_info(modelinfo.describe(read_facts(path)), as_json=False)
    out = capsys.readouterr().out
    assert "architecture:" not in out
    assert "chat template" in out and "yes" in out
    assert "'<s>'" in out  # token texts are not eaten as rich markup


def test_info_says_a_vocabulary_only_file_has_no_weights(
    vocab_file: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = vocab_file("qwen2")
    code, out, _ = run_cli(["info", str(path)], monkeypatch, capsys)
    assert code == 0
    lines = out.splitlines()
    assert (
        "parameters: none: a vocabulary-only file (a tokenizer without weights), not runnable"
    ) in lines
    assert "quantization: none" in lines  # not the F16 its general.file_type claims
    assert "BOS: 151643 '<|endoftext|>'" in lines  # Qwen2 does not add it
    code, out, _ = run_cli(["info", str(path), "--json"], monkeypatch, capsys)
    facts = json.loads(out)
    assert (facts["vocab_only"], facts["parameters"], facts["quantization"]) == (True, 0, None)


def test_info_when_llama_cpp_cannot_read_the_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An architecture this llama.cpp does not know: the header is still worth showing."""
    path = tiny_model(tmp_path / "m.gguf", changes={"general.architecture": string("future")})
    code, out, _ = run_cli(["info", str(path)], monkeypatch, capsys)
    assert code == 0
    assert "architecture: future" in out.splitlines()
    assert "BOS: unknown" in out.splitlines()


def test_info_json(
    target_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(["info", str(target_model), "--json"], monkeypatch, capsys)
    assert code == 0
    assert json.loads(out) == modelinfo.describe(read_facts(target_model))


def test_info_by_config_name(
    target_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "models.toml"
    config.write_text(f'[models.tiny]\npath = "{target_model}"\n', encoding="utf-8")
    code, out, _ = run_cli(["info", "tiny", "--config", str(config), "--json"], monkeypatch, capsys)
    assert code == 0
    assert json.loads(out)["file"] == str(target_model)


@pytest.mark.parametrize(
    ("content", "phrase"),
    [(None, "not found"), (b"", "is empty"), (b"PK\x03\x04zipzip", "is not a GGUF file")],
)
def test_info_bad_file_exits_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: bytes | None,
    phrase: str,
) -> None:
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    code, out, err = run_cli(["info", str(path)], monkeypatch, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("specdec: error: ") and err.count("\n") == 1
    assert str(path) in err and phrase in err


def test_check_compatible_pair_exits_0(
    target_model: Path,
    draft_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        ["check", "-m", str(target_model), "-d", str(draft_model)], monkeypatch, capsys
    )
    assert code == 0
    assert "result: compatible" in out
    assert "problem:" not in out and "warning:" not in out


def test_check_padding_warning_with_md_alias(
    target_model: Path,
    padded_vocab_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["check", "-m", str(padded_vocab_model), "-md", str(target_model)]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0
    assert "warning: vocabulary sizes differ: target has 511 tokens, draft has 495" in out


def test_check_another_vocabulary_is_translated(
    target_model: Path,
    other_vocab_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["check", "-m", str(target_model), "--draft", str(other_vocab_model)]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0
    assert "result: compatible, with drafts translated" in out
    assert "difference: token texts differ at " in out
    # rot13 leaves the single characters and symbols alike: those texts are shared
    assert re.search(r"\((\d+) of the draft's 495 token texts are the target's too\)", out)


def test_check_vocabulary_only_draft_exits_1(
    target_model: Path,
    vocab_file: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["check", "-m", str(target_model), "--draft", str(vocab_file("qwen2"))]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 1
    assert "result: NOT compatible" in out
    assert "problem: the draft ggml-vocab-qwen2.gguf has no weights" in out


def test_check_json(
    target_model: Path,
    other_vocab_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["check", "-m", str(target_model), "-d", str(other_vocab_model), "--json"]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0
    data = json.loads(out)
    assert (data["target"], data["draft"]) == (str(target_model), str(other_vocab_model))
    assert data["ok"] is True and data["vocabulary"] == "translated"
    assert len(data["differences"]) == 1 and data["problems"] == []
    assert 0 < data["shared_token_texts"] < 495


def test_check_bad_input_exits_2(
    target_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = tmp_path / "missing.gguf"
    code, out, err = run_cli(
        ["check", "-m", str(target_model), "-d", str(missing)], monkeypatch, capsys
    )
    assert (code, out) == (2, "")
    assert str(missing) in err
    code, _, err = run_cli(["check", "-m", str(target_model)], monkeypatch, capsys)
    assert code == 2 and "check takes a draft (-d DRAFT) or a projector (--mmproj FILE)" in err
