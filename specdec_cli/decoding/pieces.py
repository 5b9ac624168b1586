"""Rounds of tokens as pieces of text: who proposed each token, and the text it lets out
(whole UTF-8 characters only, a possible stop string held back until it is ruled out)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec_cli.decoding.generation import Round
from specdec_cli.decoding.logprobs import TokenLogprob
from specdec_cli.decoding.textstream import TextStream
from specdec_cli.llamacpp.model import Model

TARGET = "target"  # a Piece's `by` when the target chose the token itself


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it lets out (held-back text of the tokens
    before it included; "" while a character or a possible stop string is incomplete)."""

    text: str
    token: int | None  # None: the end of generation, releasing what was held back
    by: str  # TARGET, or the drafter whose guess the target accepted ("model", "ngram")
    # The log-probabilities it lets out, when asked for: of the tokens whose text begins
    # in the text let out so far, in order (its own, and held-back tokens' with their
    # text). A token whose text would begin at a stop string never gets its out: as in
    # OpenAI's and llama-server's replies, the stop string's tokens have none.
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def drafted(self) -> bool:
        return self.by != TARGET


class PieceStream:
    """One generation's rounds in, its pieces out, up to the first stop string."""

    def __init__(
        self, model: Model, stop: tuple[str, ...] = (), shown: frozenset[int] = frozenset()
    ) -> None:
        """`shown`: control tokens whose text the reply keeps (a tool call's marker, such
        as Llama 3's <|python_tag|>, for the parser); other control tokens show nothing,
        as in llama.cpp."""
        self.model = model
        self.text = TextStream(stop)
        self.shown = shown
        self._held: deque[tuple[int, TokenLogprob]] = deque()  # (where its text begins, it)

    @property
    def stopped(self) -> bool:
        """A stop string was met: the generation is over, and its text ends before it."""
        return self.text.stopped

    def round(self, new: Round) -> list[Piece]:
        """A round's pieces, one per token, up to the one that completes a stop string."""
        pieces = []
        for i, token in enumerate(new.tokens):
            shown = token in self.shown
            piece = self.model.token_text(token).encode() if shown else self.model.piece(token)
            if new.logprobs is not None:
                self._held.append((self.text.received, new.logprobs[i]))
            text = self.text.push(piece)
            by = new.source if i < new.n_drafted else TARGET
            pieces.append(Piece(text, token, by, self._let_out()))
            if self.text.stopped:
                break
        return pieces

    def finish(self) -> Piece:
        """The last piece: the text held back until the end (token None)."""
        return Piece(self.text.flush(), None, TARGET, self._let_out())

    def _let_out(self) -> tuple[TokenLogprob, ...]:
        """The held log-probabilities of tokens whose text begins in the text let out,
        or at its end with nothing held after it (a token of no text of its own)."""
        out, end = [], self.text.length
        while self._held and (
            self._held[0][0] < end or self._held[0][0] == end == self.text.received
        ):
            out.append(self._held.popleft()[1])
        return tuple(out)
