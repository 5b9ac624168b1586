"""Drafts across vocabularies: any small model drafts for any target.

A draft whose tokenizer differs from the target's proposes in its own tokens, and they
reach the target as text. Two ways, both exact: the target verifies whatever it is
offered by the usual rules, so a poor translation costs acceptance, never the output.

- Greedy: string-level exact match (SLEM, Timor et al., ICML 2025). The draft's tokens
  become bytes and the bytes the target's tokens, tokenized together with the last few
  tokens the target accepted (the anchor), so that the join tokenizes as it would in the
  whole text.
- Sampling: token-level intersection (TLI, same paper; what Hugging Face and vLLM use).
  The draft draws only among the tokens whose text both vocabularies have, its
  distribution renormalised there, so each draft token is one target token and the
  rejection rule sees the q it was drawn from.

Either way, the accepted text is tokenized again for the draft after each round, and
its memory keeps what agrees with that (`ModelDrafter`'s sync) and evaluates the rest.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np

from specdec_cli.decoding.draft import (
    Draft,
    DraftRequest,
    DraftSteps,
    merge_into_tree,
)
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.multimodal import PromptMedia
from specdec_cli.decoding.sampling import GREEDY, Dist, Noise, SamplingParams
from specdec_cli.llamacpp import costcache
from specdec_cli.llamacpp.model import Model

# Plain English, to compare how many tokens each vocabulary spends on the same text.
SAMPLE_TEXT = (
    "Once upon a time, in a small town by the sea, there lived an old fisherman. Every "
    "evening he told the children about the storms he had seen, the fish he had caught "
    "and the friends he had lost, and they listened until the lamps were lit."
)
# Accepted tokens tokenized again with the new text: enough that the join tokenizes as
# in the whole text (a word, a run of spaces), few enough to cost nothing.
ANCHOR = 4
# The most draft tokens of the accepted text tokenized afresh, where the new text
# merges into them ("Hel" + "lo": "Hello"); the draft's memory drops them.
MOST_MERGED = 8


def token_text(model: Model, token: int) -> bytes | None:
    """A token's text, for matching across vocabularies; None for a control token
    (BOS, end of turn, template markers), which never stands for text."""
    if llama_cpp.llama_vocab_is_control(model.vocab, token) or model.is_eog(token):
        return None
    return model.piece(token) or None


def is_byte_token(model: Model, token: int) -> bool:
    attr = llama_cpp.llama_vocab_get_attr(model.vocab, token)
    return bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_BYTE)


class SharedVocab:
    """The tokens whose text both vocabularies have: each draft token's target token
    (-1 where the target has no token of that text).

    Texts are llama.cpp's token pieces, so SentencePiece's "▁" and byte-level BPE's "Ġ"
    are both a space, and a byte token (<0x41>) its byte. Where a vocabulary has two
    tokens of one text (a byte token and a plain one), the plain one is used: it is the
    one its tokenizer produces, and one draft token per target token keeps q's mapping
    one to one."""

    def __init__(self, to_target: np.ndarray) -> None:
        self.to_target = to_target
        self.banned = np.flatnonzero(to_target < 0)  # draft tokens TLI never draws

    @property
    def n_shared(self) -> int:
        return len(self.to_target) - len(self.banned)

    @classmethod
    def build(cls, target: Model, draft: Model) -> SharedVocab:
        by_text = _plain_first(target)
        to_target = np.full(draft.n_vocab, -1, dtype=np.int64)
        for text, token in _plain_first(draft).items():
            to_target[token] = by_text.get(text, -1)
        return cls(to_target)

    @classmethod
    def load(cls, target: Model, draft: Model) -> SharedVocab:
        """Built once per pair of files and kept in the cache beside the measured costs."""
        key = costcache.cache_key([target.path, draft.path], {"measure": "shared_vocab"})
        path = costcache.cache_dir() / f"shared-vocab-{key}.npy"
        try:
            to_target = np.load(path)
            if to_target.shape == (draft.n_vocab,):
                return cls(to_target)
        except (OSError, ValueError):
            pass
        shared = cls.build(target, draft)
        _save(path, shared.to_target)
        return shared

    def map_tokens(self, tokens: Sequence[int]) -> list[int]:
        return [int(self.to_target[t]) for t in tokens]

    def map_dist(self, q: Dist) -> Dist:
        """A draft distribution over shared tokens, as one over the target's ids."""
        ids = self.to_target[q.ids]
        keep = (ids >= 0) & (q.probs > 0.0)  # a dense q lists the banned tokens at 0
        ids, probs = ids[keep], q.probs[keep]
        order = np.argsort(ids)
        return Dist(ids[order], probs[order])


def _plain_first(model: Model) -> dict[bytes, int]:
    """Each text of the vocabulary and its token, a plain token before a byte token."""
    by_text: dict[bytes, int] = {}
    for token in range(model.n_vocab):
        text = token_text(model, token)
        if text is None:
            continue
        if text not in by_text or is_byte_token(model, by_text[text]):
            by_text[text] = token
    return by_text


def _save(path: Path, array: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, array)
    except OSError:
        pass  # a read-only cache only costs building it again next time


def bytes_per_token(model: Model) -> float:
    """How many bytes of plain English one of the model's tokens spells, on average."""
    return len(SAMPLE_TEXT.encode()) / len(model.tokenize(SAMPLE_TEXT, False, False))


def whole_text(data: bytes, complete: bool = False) -> tuple[str, int]:
    """The text of `data`, and how many of its bytes that is: a character cut short at
    the end waits for its other bytes (unless `complete`: no more will come), and bytes
    that are no UTF-8 at all become U+FFFD."""
    try:
        return data.decode(), len(data)
    except UnicodeDecodeError as err:
        if not complete and err.reason == "unexpected end of data":
            return data[: err.start].decode(errors="replace"), err.start
        return data.decode(errors="replace"), len(data)


def first_valid_text(data: bytes) -> str:
    """The longest start of `data` that is whole UTF-8 characters."""
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        return data[: err.start].decode()


def tokens_after(
    model: Model, context: Sequence[int], text: str, back: int = 0
) -> tuple[int, list[int]] | None:
    """`text` as the model tokenizes it after `context` (its tokens of what came
    before): (n, tokens), where context[:n] stays and `tokens` spell the rest of the
    context's text, then `text`.

    The anchor (the last ANCHOR context tokens) is tokenized again with the text, so
    that the join tokenizes as in the whole text. Where the text merges into the
    anchor's last tokens, the join moves up to `back` tokens earlier; None where it
    cannot, or where the tokenizer does not spell the text back as given.
    """
    start = _anchor_start(model, context)
    pieces = [model.piece(t) for t in context[start:]]
    prefix = b"".join(pieces)
    try:
        joined = prefix.decode() + text
    except UnicodeDecodeError:
        return None
    data = joined.encode()
    tokens = model.tokenize(joined, add_special=False, parse_special=False)
    spelled = [model.piece(t) for t in tokens]
    # Some tokenizers put a space first (SentencePiece's prefix): `shift` bytes.
    shift = sum(map(len, spelled)) - len(data)
    if shift < 0 or b"".join(spelled)[shift:] != data:
        return None
    ends = {0: 0} if shift == 0 else {}  # offset in data -> tokens that end there
    end = -shift
    for j, piece in enumerate(spelled):
        end += len(piece)
        if end >= 0:
            ends[end] = j + 1
    edge = len(prefix)
    for kept in range(len(pieces), max(0, len(pieces) - back) - 1, -1):
        if kept < len(pieces):
            edge -= len(pieces[kept])
        j = ends.get(edge)
        if j is not None:
            return start + kept, tokens[j:]
    return None


def _anchor_start(model: Model, context: Sequence[int]) -> int:
    """Where the anchor starts: ANCHOR tokens back, moved to a character's first byte."""
    start = max(0, len(context) - ANCHOR)
    while start > 0 and _continues_a_character(model.piece(context[start])):
        start -= 1
    return start


def _continues_a_character(piece: bytes) -> bool:
    return bool(piece) and 0x80 <= piece[0] < 0xC0


class TranslatedDrafter:
    """A draft model with its own vocabulary, drafting for the target in the target's
    tokens (see the module's docstring): a chain, or the tree a shape allows. Greedy,
    each of the draft's paths is translated and the translations merged into one tree;
    sampling, every token is a shared one."""

    name = ModelDrafter.name

    def __init__(self, model: ModelDrafter, translation: Translation) -> None:
        self.model, self.ctx = model, model.ctx
        self.translation = translation
        self.sampling = model.sampling
        # What the draft's memory should hold: its own prompt, then the accepted text
        # tokenized by its tokenizer; `done` target tokens of that text are in it, but
        # for `pending` bytes (a character cut short waits for the rest).
        self._sequence: list[int] = []
        self._base = 0  # its prompt's tokens, which no text after them changes
        self._prompt_length = 0
        self._done = 0
        self._pending = b""
        # Running averages of bytes per token, to draft enough draft tokens for k
        # target tokens (a 512-token draft vocabulary writes shorter tokens than 262k).
        self._target_bytes, self._draft_bytes = translation.target_bytes, translation.draft_bytes

    def begin(
        self,
        prompt: list[int],
        sampling: SamplingParams | None = None,
        noise: Noise | None = None,
        media: PromptMedia | None = None,
    ) -> None:
        """`noise` is not used: it is keyed by the target's positions and tokens. A text
        the same whatever the drafts takes any guess the target agrees with, and the
        draft's likeliest text, matched across the vocabularies, is the best one."""
        if sampling is not None:
            self.sampling = sampling
        invariant = self.sampling.draft_invariant
        self.model.banned = None if invariant else self.translation.shared.banned
        self._sequence = self.translation.draft_tokens(prompt)
        self._base, self._prompt_length = len(self._sequence), len(prompt)
        self._done, self._pending = 0, b""
        self.model.begin(self._sequence, GREEDY if invariant else self.sampling)

    def sources(self, tokens: list[int]) -> list[str]:
        return [self.name]

    def drafting(self, request: DraftRequest) -> DraftSteps:
        sequence = self._follow(request.tokens)
        room = self.ctx.n_ctx - len(sequence) - 1  # the draft's tokens are more, or fewer
        if room < 1 or not sequence:
            return Draft(source=self.name)
        if self.sampling.draft_invariant:
            matched = yield from self._string_match(request, sequence, room)
            return matched
        ours = replace(request, tokens=sequence, k=min(request.k, room), source=None)
        draft = yield from self.model.drafting(ours)
        # Every token drawn is a shared one: the same text, one target token each.
        shared = self.translation.shared
        draft.tokens = shared.map_tokens(draft.tokens)
        draft.dists = [shared.map_dist(q) for q in draft.dists]
        return draft

    def _string_match(self, request: DraftRequest, sequence: list[int], room: int) -> DraftSteps:
        """SLEM: enough draft tokens for k + 1 target ones, their text tokenized by the
        target after its last tokens; the last is dropped (the draft's text may end
        inside a target token: "sa" of "sat"), and at most k kept.

        With a tree shape, the draft grows a tree of its own tokens (as many more nodes
        as its tokens are shorter) and each of its paths, root to leaf, is translated
        so: where two paths' texts part, so do their translations (a trie, the primary
        path first), up to the shape's nodes."""
        tokens, k, shape = request.tokens, request.k, request.shape
        per_token = self._target_bytes / self._draft_bytes  # draft tokens a target token
        depth = max(1, min(math.ceil((k + 1) * per_token), 4 * k, room))
        n_max, ours_shape = k, None
        if shape is not None and not shape.is_chain:
            # Batch costs are the target's, in its tokens: the tree is cut to the shape's
            # nodes after translation, not by the draft.
            n_max, nodes = shape.nodes, min(room, math.ceil(shape.nodes * per_token))
            ours_shape = replace(shape, nodes=nodes, verify=(), draft_call=0.0)
        asked = replace(request, tokens=sequence, k=depth, shape=ours_shape, source=None)
        ours = yield from self.model.drafting(asked)
        texts = [self._text(path) for path in leaf_paths(ours)]
        primary, n_spelled = texts[0]
        if n_spelled:
            self._draft_bytes += 0.1 * (len(primary) / n_spelled - self._draft_bytes)
        target = self.translation.target
        translations = []
        for text, _ in texts:
            translated = tokens_after(target, tokens, first_valid_text(text))
            translations.append(translated[1][:-1][:k] if translated else [])
        draft = Draft(calls=ours.calls, source=self.name)
        merge_into_tree(draft, translations, n_max)
        # An alternative deep in the draft's tree lies past the k target tokens a path
        # keeps, or in the dropped last one: then its path spells the primary's tokens.
        draft.alternatives_lost = ours.parents is not None and draft.parents is None
        return draft

    def _text(self, path: list[int]) -> tuple[bytes, int]:
        """A path of draft tokens as text, and how many tokens spell it: the draft's own
        end of text and control tokens end its text (they stand for none)."""
        texts = []
        for token in path:
            piece = self.translation.draft_text(token)
            if piece is None:
                break
            texts.append(piece)
        return b"".join(texts), len(texts)

    def _follow(self, tokens: list[int]) -> list[int]:
        """The draft's own tokens for the prompt and the text the target accepted,
        brought up to date in place (the sequence is as long as the text)."""
        new = tokens[self._prompt_length + self._done :]
        if new:
            piece = self.translation.target.piece
            added = b"".join(piece(t) for t in new)
            self._target_bytes += 0.1 * (len(added) / len(new) - self._target_bytes)
            self._pending += added
            self._done += len(new)
        text, used = whole_text(self._pending)
        if text:
            draft = self.translation.draft
            back = min(MOST_MERGED, len(self._sequence) - self._base)
            joined = tokens_after(draft, self._sequence, text, back)
            if joined is None:  # text its tokenizer does not spell back (an unknown character)
                joined = len(self._sequence), draft.tokenize(text, False, False)
            kept, fresh = joined
            del self._sequence[kept:]
            self._sequence += fresh
            self._pending = self._pending[used:]
        return self._sequence


def leaf_paths(draft: Draft) -> list[list[int]]:
    """A draft's tokens root to leaf, one list per leaf: its primary path first."""
    if draft.parents is None:
        return [draft.tokens]
    parents = draft.parents
    inner = set(parents)
    leaves = [i for i in range(len(parents)) if i not in inner]
    primary = draft.primary_nodes()
    leaves.sort(key=lambda leaf: leaf != primary[-1])  # (a tree has a primary path)
    paths = []
    for leaf in leaves:
        path, node = [], leaf
        while node >= 0:
            path.append(draft.tokens[node])
            node = parents[node]
        paths.append(path[::-1])
    return paths


class Translation:
    """What translating one draft model's drafts for one target takes, worked out once
    per pair of models: the token texts they share, how many bytes a token of each
    spells, and each prompt as the draft tokenizes it, in its own chat format.

    The engine remembers both models' tokens of a prompt when it tokenizes one; a
    prompt it did not tokenize (token ids from the API) reaches the draft as its text,
    control tokens left out."""

    # Prompts remembered, the oldest forgotten first: more than a server's queue holds
    # (a prompt is tokenized when its request arrives, and drafted from when it runs).
    REMEMBERED = 64

    def __init__(self, target: Model, draft: Model) -> None:
        self.target, self.draft = target, draft
        self.shared = SharedVocab.load(target, draft)
        self.target_bytes, self.draft_bytes = bytes_per_token(target), bytes_per_token(draft)
        self._draft_texts: dict[int, bytes | None] = {}
        self._known: dict[tuple[int, ...], list[int]] = {}
        self._lock = threading.Lock()  # the server tokenizes in helper threads

    @property
    def calls_per_token(self) -> float:
        """Draft tokens (draft calls) that spell the text of one target token."""
        return self.target_bytes / self.draft_bytes

    def draft_text(self, token: int) -> bytes | None:
        """token_text of a draft token, looked up once (a drafted token is asked every
        round it is drafted)."""
        if token not in self._draft_texts:
            self._draft_texts[token] = token_text(self.draft, token)
        return self._draft_texts[token]

    def remember(self, target_tokens: list[int], draft_tokens: list[int]) -> None:
        with self._lock:
            if len(self._known) >= self.REMEMBERED:
                del self._known[next(iter(self._known))]
            self._known[tuple(target_tokens)] = draft_tokens

    def draft_tokens(self, target_tokens: list[int]) -> list[int]:
        with self._lock:
            known = self._known.get(tuple(target_tokens))
        if known is None:
            texts = (token_text(self.target, t) or b"" for t in target_tokens)
            known = self.draft.tokenize(whole_text(b"".join(texts), complete=True)[0])
        return list(known)
