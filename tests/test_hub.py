"""Hub references, resolved by the real huggingface-hub code against a cache laid out on disk
exactly as huggingface-hub lays it out, or against a fake Hub served in-process. No test here
may touch the network: a guard makes any socket connection fail the test."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants, set_client_factory
from huggingface_hub.utils import httpx as hub_http  # httpx2 in huggingface-hub 2.x
from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

from specdec_cli.errors import UserError
from specdec_cli.models.hub import fetch_gguf, fetch_mmproj, is_hub_ref

COMMIT = "3f2a1c0e9b8d7c6a5f4e3d2c1b0a99887766554f"
GGUF_HEADER = b"GGUF" + (3).to_bytes(4, "little") + bytes(16)  # v3, no tensors, no metadata
NETWORK_GUARD = """
import socket
def _no_network(*args, **kwargs):
    raise AssertionError(f"network access attempted: {args!r}")
socket.socket.connect = socket.socket.connect_ex = _no_network
socket.create_connection = socket.getaddrinfo = _no_network
"""


class NetworkAttempted(AssertionError):
    """Not an OSError, so no error handling on the way can mistake it for a network failure."""


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple]]:
    attempts: list[tuple] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise NetworkAttempted(f"network access attempted: {args!r}")

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse)
    for name in ("create_connection", "getaddrinfo"):
        monkeypatch.setattr(socket, name, refuse)
    yield attempts
    assert attempts == [], "a test tried to reach the network"


def gguf_bytes(name: str) -> bytes:
    """A valid (empty) GGUF file whose bytes differ per name, as real files' blobs do."""
    return GGUF_HEADER + name.encode()


def add_to_cache(
    cache: Path, repo_id: str, names: list[str], contents: dict[str, bytes] | None = None
) -> Path:
    """Lay out a cached repo as huggingface-hub does; return its snapshot directory.
    Files hold `contents[name]` where given, else an empty GGUF of their own.

    models--OWNER--REPO/refs/main holds the commit; snapshots/COMMIT/FILE is a relative
    symlink to blobs/SHA256 (LFS files are stored under their sha256).
    """
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)  # no newline, as huggingface-hub writes it
    snapshot = repo_dir / "snapshots" / COMMIT
    for name in names:
        data = (contents or {}).get(name) or gguf_bytes(name)
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture
def hub_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point huggingface-hub at an empty cache under tmp_path; return the hub cache dir.

    huggingface-hub reads HF_* variables once, at import, into huggingface_hub.constants, and
    reads those constants at call time: so set both.
    """
    home, cache = tmp_path / "hf", tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for var, value in {"HF_HOME": home, "HF_HUB_CACHE": cache}.items():
        monkeypatch.setenv(var, str(value))
        monkeypatch.setattr(constants, var, str(value))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return cache


@pytest.fixture
def offline_cache(hub_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_home


def error_of(ref: str) -> str:
    with pytest.raises(UserError) as info:
        fetch_gguf(ref)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- references ---


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("hf://owner/repo/model.gguf", True),
        ("hf://owner/repo:Q4_K_M", True),
        ("owner/repo:Q4_K_M", True),
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", True),
        ("models/tiny.gguf", False),
        ("./owner/repo", False),
        ("/abs/path/model.gguf", False),
        ("~/models/x", False),
        ("model.gguf", False),
        ("a/b/c", False),
    ],
)
def test_is_hub_ref(ref: str, expected: bool) -> None:
    assert is_hub_ref(ref) is expected


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("hf://owner/repo/README.md", "does not name a .gguf file"),
        ("hf://owner", "not a Hugging Face reference: hf://owner;"),
        ("owner/repo:Q4 K", "not a Hugging Face reference"),
    ],
)
def test_malformed_references(ref: str, expected: str) -> None:
    assert expected in error_of(ref)


# --- offline, from the cache ---


def test_hf_url_resolves_to_the_cached_snapshot_file(offline_cache: Path) -> None:
    snapshot = add_to_cache(offline_cache, "owner/repo", ["model-Q8_0.gguf", "sub/dir/x-F16.gguf"])
    path = fetch_gguf("hf://owner/repo/model-Q8_0.gguf")
    assert path == snapshot / "model-Q8_0.gguf"
    # The snapshot symlink, not the hash-named blob (see test_split_model_*).
    assert path.is_symlink() and path.read_bytes() == gguf_bytes("model-Q8_0.gguf")
    assert fetch_gguf("hf://owner/repo/sub/dir/x-F16.gguf") == snapshot / "sub/dir/x-F16.gguf"


def test_quant_tag_picks_the_matching_file(offline_cache: Path) -> None:
    names = [
        "m-Q4_K_M.gguf",
        "m-Q4_K_S.gguf",
        "m-IQ4_XS.gguf",
        "m.Q8_0.gguf",
        "m-BF16.gguf",
        "mmproj-m-F16.gguf",
        "m-F16.gguf",
    ]
    snapshot = add_to_cache(offline_cache, "owner/repo", names)
    assert fetch_gguf("owner/repo:Q8_0") == snapshot / "m.Q8_0.gguf"
    assert fetch_gguf("owner/repo:q4_k_m") == snapshot / "m-Q4_K_M.gguf"
    assert fetch_gguf("hf://owner/repo:IQ4_XS") == snapshot / "m-IQ4_XS.gguf"
    # F16 is neither BF16 nor the vision projector.
    assert fetch_gguf("owner/repo:F16") == snapshot / "m-F16.gguf"


def test_bare_repo_takes_q4_k_m_or_the_only_gguf(offline_cache: Path) -> None:
    many = add_to_cache(offline_cache, "owner/many", ["m-Q8_0.gguf", "m-Q4_K_M.gguf"])
    assert fetch_gguf("owner/many") == many / "m-Q4_K_M.gguf"
    one = add_to_cache(offline_cache, "owner/one", ["tiny-F32.gguf", "mmproj-tiny-F16.gguf"])
    assert fetch_gguf("owner/one") == one / "tiny-F32.gguf"
    add_to_cache(offline_cache, "owner/two", ["m-Q8_0.gguf", "m-Q6_K.gguf"])
    message = error_of("owner/two")
    assert "matches the default Q4_K_M" in message and "m-Q6_K.gguf, m-Q8_0.gguf" in message


def test_the_projector_beside_the_model(offline_cache: Path) -> None:
    """A model's mmproj*.gguf, as llama-server's -hf finds it: the one in its folder; of
    several, the one of the model's quant, else F16; none where the folder has none."""
    names = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-BF16.gguf", "mmproj-m-F16.gguf"]
    names += ["mmproj-m-Q8_0.gguf", "sub/x-Q5_K_M.gguf", "sub/mmproj-x.gguf", "other/y.gguf"]
    snapshot = add_to_cache(offline_cache, "owner/vision", names)
    assert fetch_mmproj("owner/vision") == snapshot / "mmproj-m-F16.gguf"
    assert fetch_mmproj("owner/vision:Q8_0") == snapshot / "mmproj-m-Q8_0.gguf"
    assert fetch_mmproj("hf://owner/vision/sub/x-Q5_K_M.gguf") == snapshot / "sub/mmproj-x.gguf"
    assert fetch_mmproj("hf://owner/vision/other/y.gguf") is None


def test_split_model_returns_the_first_part_next_to_the_others(offline_cache: Path) -> None:
    parts = [f"big-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    snapshot = add_to_cache(offline_cache, "owner/big", [*parts, "big-Q8_0.gguf"])
    first = fetch_gguf("owner/big:Q4_K_M")
    assert first == snapshot / parts[0]
    # llama.cpp finds parts 2 and 3 by name in the first part's directory.
    assert all((first.parent / part).exists() for part in parts)
    assert fetch_gguf(f"hf://owner/big/{parts[1]}") == first


def test_split_model_with_a_part_missing_from_the_cache(offline_cache: Path) -> None:
    add_to_cache(offline_cache, "owner/big", ["big-Q4_K_M-00001-of-00002.gguf"])
    message = error_of("owner/big:Q4_K_M")
    assert message.startswith("owner/big/big-Q4_K_M-00002-of-00002.gguf is not in the local")


def test_single_file_is_preferred_to_a_split_set(offline_cache: Path) -> None:
    names = ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf", "m-Q8_0.gguf"]
    snapshot = add_to_cache(offline_cache, "owner/repo", names)
    assert fetch_gguf("owner/repo:Q8_0") == snapshot / "m-Q8_0.gguf"


def test_ambiguous_quant_lists_the_candidates(offline_cache: Path) -> None:
    add_to_cache(offline_cache, "owner/repo", ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf", "a-Q8_0.gguf"])
    assert error_of("owner/repo:Q4_K_M") == (
        "Q4_K_M matches several files in the cached copy of owner/repo: "
        "a-Q4_K_M.gguf, b-Q4_K_M.gguf; name one with hf://owner/repo/FILE"
    )


def test_unknown_quant_lists_the_available_files(offline_cache: Path) -> None:
    add_to_cache(offline_cache, "owner/repo", ["m-Q4_K_M.gguf", "m-Q8_0.gguf"])
    assert error_of("owner/repo:Q5_K_M") == (
        "no .gguf file in the cached copy of owner/repo matches Q5_K_M; "
        "available: m-Q4_K_M.gguf, m-Q8_0.gguf"
    )


def test_not_cached_while_offline(offline_cache: Path) -> None:
    add_to_cache(offline_cache, "owner/repo", ["m-Q8_0.gguf"])
    advice = "is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; " + (
        "run once online or unset HF_HUB_OFFLINE"
    )
    assert error_of("hf://owner/repo/other.gguf") == f"owner/repo/other.gguf {advice}"
    assert error_of("owner/absent:Q8_0") == f"owner/absent:Q8_0 {advice}"
    assert error_of("owner/absent") == f"owner/absent {advice}"
    assert error_of("hf://owner/absent/m.gguf") == f"owner/absent/m.gguf {advice}"


def test_env_vars_are_honoured_by_a_fresh_process(tmp_path: Path) -> None:
    """The real start-up path: huggingface-hub reads HF_HUB_CACHE/HF_HUB_OFFLINE at import."""
    cache = tmp_path / "cache"
    snapshot = add_to_cache(cache, "owner/repo", ["m-Q8_0.gguf"])
    code = NETWORK_GUARD + textwrap.dedent("""
        from specdec_cli.models.hub import fetch_gguf
        print(fetch_gguf("owner/repo:Q8_0"))
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(cache)}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot / "m-Q8_0.gguf")
    assert result.stderr == ""


# --- online, against an in-process fake of the Hub ---


class FakeHub:
    """Answers the requests huggingface-hub makes to list a repo and download its files."""

    def __init__(self) -> None:
        self.repos: dict[str, list[str]] = {}
        self.gated: set[str] = set()
        self.requests: list[str] = []

    def handle(self, request: hub_http.Request) -> hub_http.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        parts = request.url.path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:  # /api/models/OWNER/REPO/tree/main
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
        else:  # /OWNER/REPO/resolve/main/FILE
            repo_id, rest = "/".join(parts[:2]), parts[2:]
        if repo_id in self.gated:
            return self.error(403, "GatedRepo")
        if repo_id not in self.repos:
            return self.error(401, "RepoNotFound")
        files = self.repos[repo_id]
        if rest[:2] == ["tree", "main"]:
            listing = [
                {"type": "file", "path": name, "size": len(gguf_bytes(name)), "oid": "0" * 40}
                for name in files
            ]
            return hub_http.Response(200, json=listing)
        name = "/".join(rest[2:])
        if rest[:2] != ["resolve", "main"] or name not in files:
            return self.error(404, "EntryNotFound")
        data = gguf_bytes(name)
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "Content-Length": str(len(data)),
        }
        return hub_http.Response(200, headers=headers, content=data)

    def error(self, status: int, code: str) -> hub_http.Response:
        return hub_http.Response(status, headers={"X-Error-Code": code}, content=b"{}")


@pytest.fixture
def fake_hub(hub_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub = FakeHub()
    transport = hub_http.MockTransport(lambda request: hub.handle(request))
    # As huggingface-hub's default client, but with the fake in place of the internet. Its
    # request hook is what enforces HF_HUB_OFFLINE.
    set_client_factory(
        lambda: hub_http.Client(
            transport=transport,
            event_hooks={"request": [hf_request_event_hook]},
            follow_redirects=True,
        )
    )
    yield hub
    set_client_factory(default_client_factory)


def test_online_quant_ref_lists_then_downloads_every_part(fake_hub: FakeHub) -> None:
    parts = [f"m-Q4_K_M-{i:05d}-of-00002.gguf" for i in (1, 2)]
    fake_hub.repos["owner/repo"] = ["README.md", "m-Q8_0.gguf", *parts]
    first = fetch_gguf("owner/repo:Q4_K_M")
    assert first.name == parts[0] and (first.parent / parts[1]).is_file()
    assert first.read_bytes() == gguf_bytes(parts[0])
    downloads = [r for r in fake_hub.requests if r.startswith("GET /owner/repo/resolve/main/")]
    assert downloads == [f"GET /owner/repo/resolve/main/{part}" for part in parts]


def test_online_download_is_cached_for_offline_use(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.repos["owner/repo"] = ["m-Q8_0.gguf"]
    online = fetch_gguf("owner/repo:Q8_0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    count = len(fake_hub.requests)
    assert fetch_gguf("owner/repo:Q8_0") == online
    assert fetch_gguf("hf://owner/repo/m-Q8_0.gguf") == online
    assert len(fake_hub.requests) == count


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_only_on_a_terminal(
    fake_hub: FakeHub, terminal: bool, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    fake_hub.repos["owner/repo"] = ["m-Q8_0.gguf"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    fetch_gguf("owner/repo:Q8_0")
    assert ("100%" in capsys.readouterr().err) is terminal


def test_file_not_in_repo(fake_hub: FakeHub) -> None:
    fake_hub.repos["owner/repo"] = ["m-Q8_0.gguf"]
    assert error_of("hf://owner/repo/m-Q2_K.gguf") == (
        "owner/repo has no file m-Q2_K.gguf; see https://huggingface.co/owner/repo/tree/main"
    )


def test_repo_not_found(fake_hub: FakeHub) -> None:
    expected = "Hugging Face repository not found: owner/nope; check the name"
    assert error_of("owner/nope:Q8_0").startswith(expected)
    assert error_of("hf://owner/nope/m.gguf").startswith(expected)


def test_gated_repo(fake_hub: FakeHub) -> None:
    fake_hub.gated.add("meta/llama")
    assert error_of("hf://meta/llama/m.gguf").startswith("meta/llama is gated: accept its terms")


def test_repo_without_gguf_files(fake_hub: FakeHub) -> None:
    fake_hub.repos["owner/safetensors"] = ["model.safetensors", "config.json"]
    assert error_of("owner/safetensors") == (
        "owner/safetensors has no .gguf files; check the repository name"
    )


def test_unreachable_hub_is_asked_once(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface-hub retries an unreachable Hub five times, waiting up to half a minute:
    one request says it does not answer, and the line says what to download."""

    def unreachable(request: hub_http.Request) -> hub_http.Response:
        fake_hub.requests.append(f"{request.method} {request.url.path}")
        raise hub_http.ConnectError("Name or service not known", request=request)

    def no_waiting(seconds: float) -> None:
        raise AssertionError(f"waited {seconds} s to retry")

    monkeypatch.setattr(fake_hub, "handle", unreachable)
    monkeypatch.setattr(time, "sleep", no_waiting)
    assert error_of("owner/repo:Q8_0") == (
        "owner/repo:Q8_0 is not in the local Hugging Face cache, and the Hub cannot be reached "
        f"({constants.ENDPOINT}: Name or service not known); download it where the Hub answers "
        "(`hf download owner/repo --include '*Q8_0*.gguf'`), or check your connection, proxy "
        "or HF_ENDPOINT"
    )
    assert "`hf download owner/repo m.gguf`" in error_of("hf://owner/repo/m.gguf")
    assert len(fake_hub.requests) == 2  # one a reference


def test_unreachable_hub_serves_from_the_cache(
    fake_hub: FakeHub, hub_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(request: hub_http.Request) -> hub_http.Response:
        raise hub_http.ConnectError("Name or service not known", request=request)

    monkeypatch.setattr(fake_hub, "handle", unreachable)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    snapshot = add_to_cache(hub_home, "owner/repo", ["m-Q8_0.gguf"])
    assert fetch_gguf("owner/repo:Q8_0") == snapshot / "m-Q8_0.gguf"
    assert fetch_gguf("hf://owner/repo/m-Q8_0.gguf") == snapshot / "m-Q8_0.gguf"


def closed_port() -> int:
    """A local port nothing listens on: connections to it are refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_run_without_a_network_fails_fast(target_model: Path, tmp_path: Path) -> None:
    """`specdec run` with the Hub unreachable: one line saying what to download, well
    before huggingface-hub's retries (waits of 1+2+4+8+8 s) would have ended."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "SPECDEC_CONFIG": ""}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HUB_OFFLINE": "0"}
    args = ["-m", "owner/repo:Q8_0", "-d", str(target_model), "-p", "Once", "-n", "4"]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "run", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - started < 20
    assert result.returncode == 2 and "Retrying" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("specdec: error: owner/repo:Q8_0 is not in the local")
    assert "hf download owner/repo --include '*Q8_0*.gguf'" in line


def test_the_network_guard_works(no_network: list[tuple]) -> None:
    with pytest.raises(NetworkAttempted):
        socket.create_connection(("huggingface.co", 443))
    assert no_network == [(("huggingface.co", 443),)]
    no_network.clear()
