"""`specdec run --image` as users call it: the same greedy text as llama.cpp's own
llama-mtmd-cli on the same files, speculating or not; bad images and projectors refused
in one line, exit 2, before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from llamatools import TOOL_MARGIN, llama_tool
from mtmdgen import COLORS, VisionPair, png, write_mlp_projector, write_vision_pair
from test_cli_run import GREEDY, assert_user_error, specdec
from test_mtmd import png_header, wav

from specdec_cli.llamacpp.media import MAX_MEDIA_BYTES

QUESTION = "What colour is it?"
N_PREDICT = "8"
SETTINGS = ["-fa", "off", "-c", "512"]


def with_pictures(folder: Path, mrope: bool) -> VisionPair:
    """A test pair (see mtmdgen), and a red and a blue picture beside it."""
    pair = write_vision_pair(folder, mrope=mrope)
    for colour in ("red", "blue"):
        (folder / f"{colour}.png").write_bytes(png(16, 16, COLORS[colour]))
    return pair


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionPair:
    return with_pictures(tmp_path_factory.mktemp(request.param), request.param == "qwen2vl")


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> VisionPair:
    """One pair for the refusals: they come before anything is loaded."""
    return with_pictures(tmp_path_factory.mktemp("llava"), mrope=False)


def picture(pair: VisionPair, colour: str) -> str:
    return str(pair.target.parent / f"{colour}.png")


def specdec_text(pair: VisionPair, colour: str, *drafting: str) -> str:
    """`specdec run --chat --image` at temperature 0: its text."""
    args = ["run", "-m", str(pair.target), "--mmproj", str(pair.mmproj)]
    args += ["--image", picture(pair, colour), "-p", QUESTION, "--chat", "-n", N_PREDICT]
    result = specdec(*args, *drafting, *GREEDY, *SETTINGS, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["text"]


def mtmd_cli_text(pair: VisionPair, colour: str) -> str:
    """llama.cpp's llama-mtmd-cli on the same files (its chat template, greedy)."""
    marker = "--- specdec: the answer follows ---"
    command = [str(llama_tool("llama-mtmd-cli")), "-m", str(pair.target)]
    command += ["--mmproj", str(pair.mmproj), "--image", picture(pair, colour)]
    # Tokens past ours: llama.cpp's logger, through which the tool prints, may lose its last
    # lines at exit (it is leaked, never flushed: common/log.cpp, llama.cpp issue #22142).
    n = str(int(N_PREDICT) + TOOL_MARGIN)
    command += ["-p", QUESTION, "-n", n, "--temp", "0", "-t", "1", *SETTINGS]
    env = os.environ | {"MTMD_TEST_RESPONSE_MARKER": marker}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split(marker, 1)[1]


def test_run_with_an_image_writes_what_llama_mtmd_cli_writes(pair: VisionPair) -> None:
    """The target alone, and speculating with a draft model that sees the text alone,
    write llama-mtmd-cli's text, which names the image's colour (a red one's differs:
    test_vision)."""
    colour = "blue"
    theirs = mtmd_cli_text(pair, colour).strip()
    assert theirs.startswith(colour)
    ours = specdec_text(pair, colour, "-d", "none").strip()
    assert theirs.startswith(ours) and len(ours) > len(colour)
    assert specdec_text(pair, colour, "-d", str(pair.target), "-k", "3").strip() == ours


def test_a_marker_in_the_prompt_places_the_image(pair: VisionPair) -> None:
    """-p with <__media__>: the image goes there, as given (not before the text)."""
    args = ["run", "-m", str(pair.target), "--mmproj", str(pair.mmproj), "-d", "ngram"]
    args += ["--image", picture(pair, "blue"), "-p", "Look: <__media__>\n", "-n", "3"]
    result = specdec(*args, *GREEDY, *SETTINGS, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"].startswith(" blue")


def run_with(pair: VisionPair, *args: str) -> subprocess.CompletedProcess[str]:
    return specdec("run", "-m", str(pair.target), "-p", QUESTION, "-n", "4", *args, *GREEDY)


def test_an_image_without_a_projector_is_refused(llava: VisionPair) -> None:
    result = run_with(llava, "--image", picture(llava, "red"))
    assert_user_error(result, "this model takes no images or audio: add --mmproj")


def test_a_projector_for_another_model_is_refused(llava: VisionPair, tmp_path: Path) -> None:
    wider = replace(llava.dims, n_embd=llava.dims.n_embd + 64)
    other, *_ = write_mlp_projector(tmp_path / "mmproj-other.gguf", wider)
    result = run_with(llava, "--mmproj", str(other), "--image", picture(llava, "red"))
    assert_user_error(result, "mmproj-other.gguf writes embeddings", "made for another model")


@pytest.mark.parametrize(
    ("name", "data", "flag", "says"),
    [
        ("notes.txt", b"Hello, world\n", "--image", "notes.txt is not an image"),
        ("huge.png", png_header(9000, 9000), "--image", "9000x9000 pixels"),
        ("broken.png", png_header(16, 16), "--image", "could not decode broken.png as image"),
        ("speech.wav", wav(), "--audio", "speech.wav is audio, but the projector"),
        ("speech.wav", wav(), "--image", "speech.wav is not an image (--image)"),
    ],
)
def test_bad_media_is_refused_in_one_line(
    llava: VisionPair, tmp_path: Path, name: str, data: bytes, flag: str, says: str
) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    result = run_with(llava, "--mmproj", str(llava.mmproj), flag, str(path))
    assert_user_error(result, says)


def test_a_file_too_large_is_refused(llava: VisionPair, tmp_path: Path) -> None:
    path = tmp_path / "huge.png"
    with path.open("wb") as file:
        file.truncate(MAX_MEDIA_BYTES + 1)  # sparse: nothing written
    result = run_with(llava, "--mmproj", str(llava.mmproj), "--image", str(path))
    assert_user_error(result, "huge.png is 20.0 MiB, more than the 20 MiB")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--mmproj", "nowhere.gguf"], "projector file not found: nowhere.gguf"),
        (["--mmproj", "x.gguf", "--no-mmproj"], "--mmproj names a projector and --no-mmproj"),
    ],
)
def test_projector_flags_are_checked(llava: VisionPair, args: list[str], says: str) -> None:
    assert_user_error(run_with(llava, *args, "--image", picture(llava, "red")), says)


def test_info_describes_a_projector(llava: VisionPair) -> None:
    result = specdec("info", str(llava.mmproj), "--json")
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert (facts["projector_type"], facts["vision"], facts["audio"]) == ("mlp", True, False)
    assert facts["embedding_width"] == llava.dims.n_embd


def test_check_says_whether_a_projector_fits_the_target(llava: VisionPair, tmp_path: Path) -> None:
    fits = specdec("check", "-m", str(llava.target), "--mmproj", str(llava.mmproj))
    assert fits.returncode == 0 and "result:    compatible" in fits.stdout
    assert "takes:     images (mlp)" in fits.stdout
    wider = replace(llava.dims, n_embd=llava.dims.n_embd + 64)
    other, *_ = write_mlp_projector(tmp_path / "mmproj-other.gguf", wider)
    unfit = specdec("check", "-m", str(llava.target), "--mmproj", str(other), "--json")
    assert unfit.returncode == 1
    assert "made for another model" in json.loads(unfit.stdout)["problem"]
