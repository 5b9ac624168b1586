"""Hugging Face Hub references, as llama.cpp's `-hf` takes them.

    hf://OWNER/REPO/path/to/FILE.gguf   that file
    OWNER/REPO:QUANT                    the file named with that quant tag (Q4_K_M, Q8_0, ...)
    OWNER/REPO                          Q4_K_M if there is one, else the repo's only GGUF

(`hf://OWNER/REPO[:QUANT]` is accepted too.) A model's multimodal projector is the
mmproj*.gguf file beside it (fetch_mmproj), as `-hf` finds it. huggingface-hub does the
downloading and caching, so HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN and `hf auth
login` work as usual.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from huggingface_hub import (
    CacheNotFound,
    HfApi,
    constants,
    get_session,
    hf_hub_download,
    is_offline_mode,
    scan_cache_dir,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import disable_progress_bars
from huggingface_hub.utils import httpx as hub_http  # whichever HTTP library this version uses
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from tqdm.auto import tqdm

from specdec_cli.errors import UserError

HF_PREFIX = "hf://"
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when no quant is given

_REPO_ID = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_BARE_REF = re.compile(rf"(?P<repo>{_REPO_ID})(?::(?P<quant>[\w.-]+))?")
_HF_URL = re.compile(rf"hf://(?P<repo>{_REPO_ID})(?::(?P<quant>[\w.-]+)|/(?P<file>.+))?")
# llama.cpp's gguf-split names: model-00001-of-00003.gguf
_SPLIT = re.compile(r"-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")
# What huggingface-hub raises: its HTTP errors are OSErrors, LocalEntryNotFoundError is a
# FileNotFoundError, offline mode a ConnectionError; connection failures come from its HTTP library.
_HUB_ERRORS = (EntryNotFoundError, HFValidationError, OSError, hub_http.HTTPError)
PROBE_SECONDS = 5.0  # how long the one request that asks whether the Hub answers may take
# Where a folder holds several projectors and none carries the model's quant tag: the
# first of these precisions its name carries, else the first by name.
PROJECTOR_PRECISIONS = ("F16", "BF16", "F32", "Q8_0")


class RichBar(tqdm):
    """huggingface-hub's download progress, drawn by rich on stderr.

    huggingface-hub reports through a tqdm class; this one keeps tqdm's counting and
    hands the drawing to a rich Progress.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface-hub's own keyword, unknown to tqdm
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TaskProgressColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task: TaskID | None = None
        super().__init__(*args, **kwargs)
        if not self.disable:
            self._progress.start()
            self._task = self._progress.add_task(self.desc or "download", total=self.total)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self._task is not None:
            self._progress.update(self._task, completed=self.n, total=self.total)
        return True

    def close(self) -> None:
        if self._task is not None:
            self.display()
            self._progress.stop()
            self._task = None
        super().close()


def is_hub_ref(ref: str) -> bool:
    """Whether ref has the shape of a Hub reference (a `.gguf` name is always a local path)."""
    if ref.startswith(HF_PREFIX):
        return True
    return _BARE_REF.fullmatch(ref) is not None and not ref.lower().endswith(".gguf")


def is_cached(ref: str) -> bool:
    """Whether the file an hf://OWNER/REPO/FILE.gguf reference names is in the local cache
    (other references name no file until the Hub is asked: never cached)."""
    repo_id, filename, _ = _parse(ref)
    return filename is not None and isinstance(try_to_load_from_cache(repo_id, filename), str)


def hub_unreachable() -> str | None:
    """Why the Hub (HF_ENDPOINT) cannot be reached, from one request with a short timeout
    and no retries; None where it answers."""
    try:
        status = get_session().head(constants.ENDPOINT, timeout=PROBE_SECONDS).status_code
    except (hub_http.TransportError, OSError) as err:
        return f"{constants.ENDPOINT}: {_first_line(err)}"
    return f"{constants.ENDPOINT} answers HTTP {status}" if status >= 500 else None


def fetch_gguf(ref: str) -> Path:
    """Download (or find in the cache) the GGUF file ref names; return its local path.

    For a split model every part is fetched and the first part's path is returned: llama.cpp
    finds the other parts next to it.
    """
    lookup = _lookup(ref)
    paths = []
    try:
        parts = _split_parts(lookup.filename or _pick_file(lookup, _repo_files(lookup)))
        # Progress bars are for people watching; keep pipes and logs clean.
        watched = sys.stderr.isatty()
        with contextlib.nullcontext() if watched else disable_progress_bars():
            for part in parts:
                lookup = lookup._replace(filename=part)
                bar = RichBar if watched else None
                paths.append(
                    hf_hub_download(
                        lookup.repo_id, part, tqdm_class=bar, local_files_only=lookup.from_cache
                    )
                )
    except _HUB_ERRORS as err:
        raise _explain(err, lookup) from err
    # Return the snapshot path, not the resolved blob: the blobs are named by hash, so only in
    # the snapshot directory do a split model's parts sit next to each other under their names.
    return Path(paths[0])


def fetch_mmproj(ref: str) -> Path | None:
    """Download (or find in the cache) the multimodal projector beside the model ref names:
    an mmproj*.gguf file in the same folder of the repo (see _projector_beside). None
    where there is none."""
    lookup = _lookup(ref)
    try:
        files = _repo_files(lookup)
        name = _projector_beside(lookup.filename or _pick_file(lookup, files), files, lookup.quant)
        if name is None:
            return None
        lookup = lookup._replace(filename=name)
        return Path(hf_hub_download(lookup.repo_id, name, local_files_only=lookup.from_cache))
    except _HUB_ERRORS as err:
        raise _explain(err, lookup) from err


def _lookup(ref: str) -> _Lookup:
    """A reference about to be fetched: from the cache where it must be (offline, or the
    Hub does not answer), asking the Hub once at most."""
    repo_id, part, quant = _parse(ref)  # `part` names the file being fetched, for errors
    local = is_offline_mode() or is_cached(ref)
    unreachable = None if local else hub_unreachable()
    return _Lookup(ref, repo_id, part, quant, unreachable)


class _Lookup(NamedTuple):
    """One reference being fetched, and why it must come from the cache (if it must)."""

    ref: str
    repo_id: str
    filename: str | None  # the file (or split part) being fetched, once known
    quant: str | None
    unreachable: str | None  # why the Hub cannot be reached (None: it answered, or not asked)

    @property
    def from_cache(self) -> bool:
        return self.unreachable is not None or is_offline_mode()

    @property
    def what(self) -> str:
        return f"{self.repo_id}/{self.filename}" if self.filename else self.ref

    def download_command(self) -> str:
        """The `hf` command (huggingface-hub's own) that downloads the file, where the Hub
        answers."""
        if self.filename:
            return f"hf download {self.repo_id} {self.filename}"
        return f"hf download {self.repo_id} --include '*{self.quant or DEFAULT_QUANT}*.gguf'"

    def not_cached(self) -> UserError:
        if self.unreachable is None:  # HF_HUB_OFFLINE
            return UserError(
                f"{self.what} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                "set; run once online or unset HF_HUB_OFFLINE"
            )
        return UserError(
            f"{self.what} is not in the local Hugging Face cache, and the Hub cannot be "
            f"reached ({self.unreachable}); download it where the Hub answers "
            f"(`{self.download_command()}`), or check your connection, proxy or HF_ENDPOINT"
        )


def _parse(ref: str) -> tuple[str, str | None, str | None]:
    """Split ref into (repo_id, file or None, quant or None)."""
    match = (_HF_URL if ref.startswith(HF_PREFIX) else _BARE_REF).fullmatch(ref)
    if match is None:
        raise UserError(
            f"not a Hugging Face reference: {ref}; "
            "use hf://OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT"
        )
    groups = match.groupdict()
    filename = groups.get("file")
    if filename is not None and not filename.lower().endswith(".gguf"):
        raise UserError(f"{ref} does not name a .gguf file; use hf://OWNER/REPO/FILE.gguf")
    return groups["repo"], filename, groups["quant"]


def _repo_files(lookup: _Lookup) -> list[str]:
    """The repo's files: the Hub's list, or the cached snapshot's."""
    repo_id, quant = lookup.repo_id, lookup.quant
    if not lookup.from_cache:
        return HfApi().list_repo_files(repo_id)
    files = _cached_files(repo_id)
    if not files:
        raise lookup._replace(ref=f"{repo_id}:{quant}" if quant else repo_id).not_cached()
    return files


def _is_projector(name: str) -> bool:
    return PurePosixPath(name).name.lower().startswith("mmproj")


def _projector_beside(model: str, files: list[str], quant: str | None) -> str | None:
    """The mmproj*.gguf file in the model's folder: the only one, else the one carrying
    the model's quant tag, else by PROJECTOR_PRECISIONS; None where there is none."""
    folder = PurePosixPath(model).parent
    found = sorted(
        name
        for name in files
        if _is_projector(name)
        and name.lower().endswith(".gguf")
        and PurePosixPath(name).parent == folder
    )
    if len(found) <= 1:
        return found[0] if found else None
    for tag in (quant or DEFAULT_QUANT, *PROJECTOR_PRECISIONS):
        tagged = _matching(found, tag)
        if tagged:
            return tagged[0]
    return found[0]


def _pick_file(lookup: _Lookup, files: list[str]) -> str:
    """Choose the GGUF file for OWNER/REPO[:QUANT] from the repo's file list."""
    repo_id, quant = lookup.repo_id, lookup.quant
    where = f"the cached copy of {repo_id}" if lookup.from_cache else repo_id
    # One entry per model: skip vision projectors and the later parts of split models.
    models = [
        name
        for name in files
        if name.lower().endswith(".gguf")
        and not _is_projector(name)
        and _split_index(name) in (None, 1)
    ]
    if not models:
        raise UserError(f"{where} has no .gguf files; check the repository name")
    matches = _matching(models, quant or DEFAULT_QUANT)
    if not matches and quant is None and len(models) == 1:
        matches = models
    if not matches:
        wanted = quant or f"the default {DEFAULT_QUANT} (add :QUANT to choose)"
        raise UserError(
            f"no .gguf file in {where} matches {wanted}; available: {', '.join(models)}"
        )
    # A single file beats a split set of the same quant.
    whole = [name for name in matches if _split_index(name) is None]
    chosen = whole or matches
    if len(chosen) > 1:
        raise UserError(
            f"{quant or DEFAULT_QUANT} matches several files in {where}: {', '.join(chosen)}; "
            f"name one with hf://{repo_id}/FILE"
        )
    return chosen[0]


def _matching(files: list[str], quant: str) -> list[str]:
    """Files whose path carries the quant tag as a whole word: Q4_K matches neither Q4_K_M nor
    IQ4_K. The tag may be a folder name, as in unsloth's Q4_K_M/model-00001-of-00002.gguf."""
    tag = re.compile(rf"(?:^|[^a-z0-9]){re.escape(quant.lower())}(?=[./-])")
    return [name for name in files if tag.search(name.lower())]


def _cached_files(repo_id: str) -> list[str]:
    """Files of the cached snapshot that `main` points to, relative to the snapshot."""
    try:
        # Pass the cache dir: scan_cache_dir's default is bound when huggingface-hub is imported,
        # while hf_hub_download reads constants.HF_HUB_CACHE on each call. Same value in a
        # normal run; this keeps the two in step when the constant is changed later (tests).
        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    for repo in cache.repos:
        if repo.repo_id != repo_id or repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            if "main" in revision.refs:
                return sorted(
                    file.file_path.relative_to(revision.snapshot_path).as_posix()
                    for file in revision.files
                )
    return []


def _split_index(filename: str) -> int | None:
    match = _SPLIT.search(filename)
    return int(match["part"]) if match else None


def _split_parts(filename: str) -> list[str]:
    """All parts of a split model (whichever part was named), or just the file."""
    match = _SPLIT.search(filename)
    if match is None:
        return [filename]
    stem, total = filename[: match.start()], match["total"]
    return [f"{stem}-{part:05d}-of-{total}.gguf" for part in range(1, int(total) + 1)]


def _explain(err: Exception, lookup: _Lookup) -> UserError:
    """One line for each way a Hub look-up fails."""
    ref, repo_id, filename, what = lookup.ref, lookup.repo_id, lookup.filename, lookup.what
    # Subclasses before their bases: GatedRepoError is a RepositoryNotFoundError, and
    # LocalEntryNotFoundError an EntryNotFoundError; the first three are HfHubHTTPErrors.
    if isinstance(err, GatedRepoError):
        return UserError(
            f"{repo_id} is gated: accept its terms at https://huggingface.co/{repo_id}, "
            "then log in with `hf auth login` or set HF_TOKEN"
        )
    if isinstance(err, RepositoryNotFoundError):
        return UserError(
            f"Hugging Face repository not found: {repo_id}; check the name "
            "(for a private repo, log in with `hf auth login` or set HF_TOKEN)"
        )
    if isinstance(err, RevisionNotFoundError):
        return UserError(f"{repo_id} has no 'main' branch; check the repository name")
    if isinstance(err, LocalEntryNotFoundError):
        if lookup.from_cache:
            return lookup.not_cached()
        return UserError(
            f"could not reach the Hugging Face Hub to download {what}, and it is not in the local "
            "cache; check your connection"
        )
    if isinstance(err, EntryNotFoundError):
        return UserError(
            f"{repo_id} has no file {filename}; see https://huggingface.co/{repo_id}/tree/main"
        )
    if isinstance(err, HFValidationError):
        return UserError(f"invalid Hugging Face repository name in {ref}: {_first_line(err)}")
    if isinstance(err, HfHubHTTPError):
        return UserError(f"Hugging Face Hub request for {what} failed: {_first_line(err)}")
    if isinstance(err, (ConnectionError, hub_http.TransportError)):
        return UserError(
            f"cannot reach the Hugging Face Hub for {what} ({_first_line(err)}); check your "
            "connection, or set HF_HUB_OFFLINE=1 to use cached models"
        )
    return UserError(f"cannot fetch {what}: {_first_line(err)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
