"""Prompts with images or audio, as the decode loop reads them.

A projector (llamacpp/mtmd.py) tokenizes a prompt with media into chunks. Here they become
one list of tokens, as every other prompt is, with each media chunk's cells written as its
placeholder: a negative number made from the SHA-256 of the media's bytes. So a slot's
cache, the prompt cache and the scheduler compare prompts with media as they compare any
(two prompts with different images part at the first image), and the target decodes a
placeholder's cells through its chunk (llama.MediaCells) where it reads the prompt.

A lookup drafts from the text alone (`text_tokens`), and so does a draft model without a
projector of its own, at its own contiguous positions. That is exact: a draft only
proposes, and the target, which saw the media, decides. A draft model with a projector
of its own (`--mmproj-draft`) reads the media as the target does, through its own
embeddings of them (MediaChunk.draft); a drafting head reads the target's states over
them, by the target's positions (PromptMedia.positions_of). Both learn where the media
lie from PromptMedia: media are only ever in a prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import llama_cpp.llama_cpp as llama_cpp
import numpy as np

from specdec_cli.llamacpp.llama import MediaCells
from specdec_cli.llamacpp.mtmd import Chunk, Projector, Prompt

# Embeddings kept for media sent again (a conversation's next turn, once another prompt
# has taken its cells): an image of a few thousand tokens of a 4096-wide model is ~50 MiB.
ENCODINGS_BYTES = 256 * 2**20


def placeholder(media_id: str) -> int:
    """The number that stands for each cell of the media whose bytes hash to `media_id`
    (hexadecimal SHA-256): negative, as no token is, and the whole hash, so that only the
    same media matches it."""
    return -1 - int(media_id, 16)


def text_tokens(tokens: list[int]) -> list[int]:
    """A prompt's text tokens, its media left out."""
    return [t for t in tokens if t >= 0]


class Encodings:
    """Media embeddings by the hash of the media's bytes, the least recently used
    dropped past `max_bytes`: media decoded again is not encoded again. `encoded` counts
    the encoder's runs."""

    def __init__(self, projector: Projector, max_bytes: int = ENCODINGS_BYTES) -> None:
        self.projector = projector
        self.max_bytes = max_bytes
        self.encoded = 0
        self._kept: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0

    def embeddings(self, chunk: Chunk) -> np.ndarray:
        assert chunk.id is not None
        kept = self._kept.get(chunk.id)
        if kept is not None:
            self._kept.move_to_end(chunk.id)
            return kept
        embeddings = self.projector.encode(chunk)
        self.encoded += 1
        if embeddings.nbytes <= self.max_bytes:
            self._kept[chunk.id] = embeddings
            self._bytes += embeddings.nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._kept.popitem(last=False)[1].nbytes
        return embeddings


@dataclass(frozen=True)
class MediaChunk:
    """A prompt's media chunk, as a target decodes it (llama.MediaCells); `draft`: the
    same media as the draft model's own projector makes it (None: the draft reads the
    text alone)."""

    chunk: Chunk
    encodings: Encodings
    placeholder: int
    n_tokens: int
    n_pos: int
    draft: MediaChunk | None = None

    @classmethod
    def of(
        cls, chunk: Chunk, encodings: Encodings, mark: int, draft: MediaChunk | None = None
    ) -> MediaChunk:
        return cls(chunk, encodings, mark, chunk.n_tokens, chunk.n_pos, draft)

    def decode(
        self,
        ctx: llama_cpp.llama_context_p,
        pos: int,
        seq: int,
        n_batch: int,
        on_rows: Callable[[int], None] | None = None,
    ) -> int:
        embeddings = self.encodings.embeddings(self.chunk)
        on_batch = None if on_rows is None else lambda batch: on_rows(len(batch.embeddings))
        projector = self.encodings.projector
        return projector.decode(ctx, self.chunk, embeddings, pos, seq, n_batch, on_batch)


class MediaPrompt:
    """A prompt as a generation takes it: `tokens` (each media chunk's cells as its
    placeholder) and `media` (each placeholder's chunk; none for text alone). Made of
    libmtmd's chunks (of_chunks), it owns them: close it once its generation is done."""

    def __init__(
        self,
        tokens: list[int],
        media: dict[int, MediaChunk] | None = None,
        chunks: tuple[Prompt, ...] = (),
    ) -> None:
        self.tokens = tokens
        self.media = media or {}
        self._chunks = chunks

    @classmethod
    def of_chunks(
        cls,
        prompt: Prompt,
        encodings: Encodings,
        draft: Prompt | None = None,
        draft_encodings: Encodings | None = None,
    ) -> MediaPrompt:
        """The prompt libmtmd tokenized; with `draft`, the same prompt as the draft model's
        projector tokenized it (each media's MediaChunk.draft, where it made the same
        cells: else the draft reads the text alone)."""
        if draft is not None and not same_cells(prompt, draft):
            draft.close()
            draft = None
        drafts = draft.chunks if draft is not None else [None] * len(prompt.chunks)
        tokens: list[int] = []
        media: dict[int, MediaChunk] = {}
        for chunk, draft_chunk in zip(prompt.chunks, drafts, strict=True):
            if chunk.kind == "text":
                tokens += chunk.tokens
                continue
            if chunk.id is None:
                raise RuntimeError(f"libmtmd gave {chunk.kind} without an id")
            mark = placeholder(chunk.id)
            own = None
            if draft_chunk is not None and draft_encodings is not None:
                own = MediaChunk.of(draft_chunk, draft_encodings, mark)
            media[mark] = MediaChunk.of(chunk, encodings, mark, own)
            tokens += [mark] * chunk.n_tokens
        return cls(tokens, media, (prompt,) if draft is None else (prompt, draft))

    def close(self) -> None:
        for chunks in self._chunks:
            chunks.close()

    def __enter__(self) -> MediaPrompt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def same_cells(prompt: Prompt, other: Prompt) -> bool:
    """Whether two projectors made the same cells of a prompt: the same text tokens, and
    each media as many cells (a draft's own may take other positions)."""
    return len(prompt.chunks) == len(other.chunks) and all(
        (a.kind, a.tokens, a.id, a.n_tokens) == (b.kind, b.tokens, b.id, b.n_tokens)
        for a, b in zip(prompt.chunks, other.chunks, strict=True)
    )


def media_starts(tokens: list[int], media: Mapping[int, MediaCells]) -> list[int]:
    """Where each media's cells start among a prompt's tokens, in order (two of the same
    image in a row are two)."""
    starts, i = [], 0
    while i < len(tokens):
        if tokens[i] < 0:
            starts.append(i)
            i += media[tokens[i]].n_tokens
        else:
            i += 1
    return starts


class PromptMedia:
    """Where a prompt's media lie, for the drafters that see them: `cells`, the prompt as
    the target holds it (each media's cells as its placeholder), and `media`, each
    placeholder's. The drafters are handed the text alone each round; as media are only
    in the prompt, the rest of what the target holds is the text after the prompt's."""

    def __init__(self, cells: list[int], media: Mapping[int, MediaCells]) -> None:
        self.cells = cells
        self.media = media
        starts = media_starts(cells, media)
        self.n_text = len(cells) - sum(media[cells[i]].n_tokens for i in starts)
        # The prompt by position: each media's cells as n_pos placeholders.
        self._by_position: list[int] = []
        end = 0
        for start in starts:
            self._by_position += cells[end:start]
            media_cells = media[cells[start]]
            self._by_position += [cells[start]] * media_cells.n_pos
            end = start + media_cells.n_tokens
        self._by_position += cells[end:]

    @property
    def extra_cells(self) -> int:
        """The cells the target holds beyond the text: every media's."""
        return len(self.cells) - self.n_text

    @property
    def extra_positions(self) -> int:
        """The positions the target's media take beyond the text's."""
        return len(self._by_position) - self.n_text

    def cells_of(self, text: list[int]) -> list[int]:
        """What the target holds, given the text (the prompt's and what followed)."""
        return self.cells + text[self.n_text :]

    def positions_of(self, text: list[int]) -> list[int]:
        """The text by the target's positions: each position's token, each media's
        placeholder at the positions it spans (n_pos of them; under M-RoPE fewer than
        its cells)."""
        return self._by_position + text[self.n_text :]

    def draft_media(self) -> dict[int, MediaCells] | None:
        """Each placeholder's media as the draft model's projector makes it; None where
        some have none (the draft then reads the text alone)."""
        drafts = {
            mark: chunk.draft for mark, chunk in self.media.items() if isinstance(chunk, MediaChunk)
        }
        if len(drafts) < len(self.media) or not all(drafts.values()):
            return None
        return cast(dict[int, MediaCells], drafts)
