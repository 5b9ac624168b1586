"""The engine: models loaded once (loading), decoders made as asked (policy), and
generations from text to pieces of text. `run`, `bench` and `serve` go through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.generation import check_prompt
from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.loading import LoadedModels
from specdec_cli.decoding.logprobs import LogprobOptions
from specdec_cli.decoding.multimodal import MediaPrompt
from specdec_cli.decoding.pieces import Piece, PieceStream
from specdec_cli.decoding.policy import Policy
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import EngineOptions, drafter_kind
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import MediaCells
from specdec_cli.llamacpp.media import Media
from specdec_cli.llamacpp.mtmd import MARKER
from specdec_cli.models.chat import (
    ChatFormat,
    ChatOptions,
    Message,
    chat_tokens,
    conversation,
    own_chat_tokens,
    render,
    with_markers,
    with_media_markers,
)

NO_PROJECTOR = "this model takes no images or audio: add --mmproj (the model's mmproj-*.gguf file)"


class Engine(LoadedModels):
    """The loaded models, with a decoder per slot for the options' drafting."""

    def __init__(self, options: EngineOptions, notify: Callable[[str], None] | None = None) -> None:
        """`notify` hears of slow one-time work (measuring costs), for the user."""
        super().__init__(options, notify)
        self.policy = Policy(self)
        if options.grammar is not None:
            try:
                options.grammar.check(self.model)
            except UserError:
                self.close()
                raise

    @cached_property
    def decoders(self) -> list[Decoder]:
        """Each slot's decoder for the options' drafting. Made at first use, since a first
        -k auto run measures costs here: `run` checks its prompt before that wait."""
        o = self.options
        kind = drafter_kind(self.draft_ctx is not None, o.ngram, self.head_kind)
        return [self.make_decoder(kind, o.drafting.k, slot=slot) for slot in range(o.parallel)]

    @property
    def decoder(self) -> Decoder:
        """`run`'s: the first slot's."""
        return self.decoders[0]

    def make_decoder(
        self, kind: str | None, k: str, tree: str | None = None, slot: int = 0
    ) -> Decoder:
        """See Policy.decoder; its generations follow the options' grammar unless they
        bring their own."""
        decoder = self.policy.decoder(kind, k, tree, slot)
        decoder.grammar = self.options.grammar
        return decoder

    def fits_tree(self, tree: str) -> bool:
        return self.policy.fits_tree(tree)

    def tokenize(self, prompt: str | None, chat: ChatOptions | None = None) -> list[int]:
        """The prompt's tokens; with `chat`, wrapped in the target's chat format (the
        prompt may then be None: the conversation is in chat.history)."""
        if chat is not None:
            return self.tokenize_messages(conversation(prompt, chat), chat.format)
        assert prompt is not None
        tokens = self.model.tokenize(prompt)
        if self.translation is not None:  # a translated draft tokenizes the prompt its own way
            self.translation.remember(tokens, self.translation.draft.tokenize(prompt))
        return tokens

    def prompt(
        self, text: str | None, chat: ChatOptions | None = None, media: Sequence[Media] = ()
    ) -> MediaPrompt:
        """The prompt as a generation takes it: its tokens (see tokenize), and with `media`
        its media too, each where the text holds a marker (<__media__>), else all before
        the text (of the last user message, in a chat), as llama.cpp's mtmd-cli places
        them. The caller closes it."""
        if not media:
            return MediaPrompt(self.tokenize(text, chat))
        if chat is not None:
            messages = with_media_markers(conversation(text, chat), len(media), MARKER)
            return self.media_prompt(self.chat_text(messages, chat.format), media)
        assert text is not None
        return self.media_prompt(with_markers(text, len(media), MARKER), media)

    def check_prompt(self, prompt: list[int]) -> None:
        """Raise UserError for a prompt no slot can generate from (see generation.check_prompt)."""
        check_prompt(prompt, self.slots[0].n_ctx)

    def tokenize_messages(
        self,
        messages: list[Message],
        format: ChatFormat | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A conversation's tokens in the target's chat format (`format`: its own template
        unless it names one; `tools` described in it), and for a translated draft in the
        draft's own."""
        tokens = chat_tokens(self.model, render(self.model, messages, format, tools))
        if self.translation is not None:
            draft = self.translation.draft
            self.translation.remember(tokens, own_chat_tokens(draft, messages))
        return tokens

    def chat_text(
        self,
        messages: list[Message],
        format: ChatFormat | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """A conversation in the target's chat format, as text for media_prompt: without
        the BOS a template may write, which tokenizing adds (as chat_tokens drops the
        doubled one)."""
        text = render(self.model, messages, format, tools)
        if self.model.add_bos:
            text = text.removeprefix(self.model.token_text(self.model.bos))
        return text

    def media_prompt(self, text: str, media: Sequence[Media], drafts: bool = True) -> MediaPrompt:
        """`text` (a plain prompt, or chat_text's) with a media marker for each of `media`,
        tokenized with them (see multimodal.py), and by the draft model's own projector
        where it has one that takes them. `drafts`: the generation drafts as the engine
        was loaded to (else it runs the target alone). The caller closes it."""
        if self.encodings is None:
            raise UserError(NO_PROJECTOR)
        prompt = self.encodings.projector.tokenize(text, media)
        own = self.draft_encodings
        if not drafts or own is None or not all(map(own.projector.takes, media)):
            return MediaPrompt.of_chunks(prompt, self.encodings)
        try:
            draft = own.projector.tokenize(text, media)
        except BaseException:
            prompt.close()
            raise
        return MediaPrompt.of_chunks(prompt, self.encodings, draft, own)

    def pieces(
        self,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        stop: tuple[str, ...] = (),
        decoder: Decoder | None = None,
        sampling: SamplingParams | None = None,
        logprobs: LogprobOptions | None = None,
        grammar: Grammar | None = None,
        media: Mapping[int, MediaCells] | None = None,
    ) -> Iterator[Piece]:
        """Yield one Piece per generated token, saying who proposed it, and a last one
        (token None) for text held back until the end. `sampling`: this generation's
        (None: the options'); `logprobs`: what the pieces carry of the tokens'
        log-probabilities (None: nothing); `grammar`: what the output must follow;
        `media`: the prompt's (see media_prompt)."""
        stream = PieceStream(self.model, stop)
        stats.flash_attn = self.flash_attn
        rounds = (decoder or self.decoder).generate(
            prompt, n_predict, rng, stats, sampling, logprobs, grammar, media
        )
        try:
            for new in rounds:
                yield from stream.round(new)
                if stream.stopped:
                    stats.stop_reason = "stop"
                    return
            yield stream.finish()
        finally:
            rounds.close()
