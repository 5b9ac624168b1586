"""A drafting head (MTP, chained MTP, EAGLE-3, DFlash, a Gemma 4 assistant): one more
drafter behind the Drafter interface, a class for each head context (llamacpp/heads.py).

An MTP or EAGLE-3 head drafts as a draft model does, a depth a call, a chain or a tree
grown by the same code (drafters._Growth), and chooses each token as a draft model
does (greedy, coupled or sampled, with its own distribution as q: see
ModelDrafter.children), so the verifier's exact rules hold unchanged. What differs is
what it reads: beside each token, a hidden state (see llamacpp/heads.py). Positions the
target decoded read the target's; its own drafts read the head's, each tree node the
one its parent's row gave (the row whose logits it was chosen from).

Its memory therefore holds a prefix of the accepted tokens fed with the target's states
(positions below the round's last accepted token), and never its own drafts' rows: those
read the head's states, and are dropped at the next round. Each round's first call
catches up on the tokens the target accepted since, together with the first draft step:
llama.cpp's driver spends a call more (common/speculative.cpp feeds every verified row
first, then drafts).

Beside images and audio a head reads the text by the target's positions
(PromptMedia.positions_of; under M-RoPE an image spans fewer positions than it has cells),
and at a media's positions the target's states there, which its decode of the media
recorded (Context.decode_media): the row after an image reads the state the target's
text there read. llama.cpp's driver skips media batches altogether: its MTP and EAGLE-3
heads then read, after an image, the state from before it, and a non-M-RoPE head's
positions no longer follow on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec_cli.decoding.draft import Draft, DraftRequest, DraftSteps
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.multimodal import PromptMedia
from specdec_cli.decoding.sampling import Noise, SamplingParams
from specdec_cli.llamacpp.heads import (
    AssistantHead,
    ChainedMtpHead,
    DFlashHead,
    Eagle3Head,
    HeadContext,
    MtpHead,
)
from specdec_cli.llamacpp.hiddenstates import HiddenStates
from specdec_cli.llamacpp.llama import common_prefix


class HeadDrafter(ModelDrafter):
    """The target's MTP block drafting, chains, or trees where the target can verify
    them."""

    name = "mtp"

    def __init__(self, ctx: HeadContext, states: HiddenStates, sampling: SamplingParams) -> None:
        super().__init__(ctx, sampling)  # type: ignore[arg-type]
        self.head = ctx
        self.states = states

    def begin(
        self,
        prompt: list[int],
        sampling: SamplingParams | None = None,
        noise: Noise | None = None,
        media: PromptMedia | None = None,
    ) -> None:
        """Nothing to read now: the first round catches up on the prompt, with the
        target's states, which its decode calls recorded (keeping what the head holds
        of an earlier generation's text, as far as the prompt repeats it)."""
        if sampling is not None:
            self.sampling = sampling
        self.noise = noise
        self.media = media

    def _sequence(self, text: list[int]) -> list[int]:
        """The text by the target's positions (see the module's docstring)."""
        return text if self.media is None else self.media.positions_of(text)

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """Up to k tokens deep; a chain, or the tree `shape` allows."""
        tokens = self._sequence(request.tokens)
        head, last = self.head, len(tokens) - 1
        # What the head reads, by its positions: the text, or for EAGLE-3 the text from
        # its second token (its row at p holds the token at p + 1).
        read = tokens[head.shift :]
        if not read:
            return Draft(source=self.name)
        # Rows up to the last token, which the target has not decoded yet (it comes first
        # in the verification), but whose state before it the last verification gave.
        n_keep = head.rewind(min(common_prefix(head.tokens, read), head.fed, len(read) - 1))
        states = head.states_for(self.states.after(n_keep + head.shift - 1, last))
        early = max(0, len(read) - n_keep - head.n_batch)  # what a call cannot hold (a prompt)
        if early:
            head.catch_up(read[n_keep : n_keep + early], states[:early])
        head.stage(read[n_keep + early :], hidden=states[early:])
        head.fed = len(read)
        self.states.forget_before(last)
        yield
        # Its logits are in the target's vocabulary (EAGLE-3's mapped by d2t).
        draft = yield from self._grow(
            self._cells(request.tokens),
            request.k,
            request.rng,
            request.keep_drafting,
            request.shape,
            len(read),
        )
        draft.calls += 1  # the catch-up call, which drafted the first depth
        head.drop_branches()
        return draft

    def stage_nodes(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seqs: Sequence[int],
        parent_rows: Sequence[int],
    ) -> None:
        """Each node beside the head's own state at the row its logits came from."""
        self.head.stage_branches(tokens, positions, seqs, self.head.hidden_rows(parent_rows))


class Eagle3Drafter(HeadDrafter):
    """An EAGLE-3 file drafting, chains or trees, as the target's MTP block does (its
    context reads other states, a position later: see Eagle3Head)."""

    name = "eagle3"


class BlockDrafter(HeadDrafter):
    """A DFlash drafter: a whole draft from one decode of [last token, mask x k].

    Its memory holds, at each position the target has decoded, what it made of the
    target's layer inputs there (DFlashHead.inject); never a block, which goes as soon
    as its logits are read. Each row's token is chosen from that row's logits alone, as
    a draft model chooses (greedy, coupled or sampled): the rows do not read each other's
    choices, so a sampled token is drawn from the q that the verifier is told, given the
    tokens before it, and rejection sampling stays exact. Its rows are independent, all
    in one call: it drafts chains.
    """

    name = "dflash"

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """Up to k tokens (the block's size less one at most), a chain."""
        tokens, rng, keep_drafting = request.tokens, request.rng, request.keep_drafting
        tokens = self._sequence(tokens)
        head, decoded = self.head, len(tokens) - 1  # the last token is not decoded yet
        k = min(request.k, head.block_size - 1)
        if decoded < 1 or k < 1:
            return Draft(source=self.name)
        n_keep = head.rewind(min(common_prefix(head.tokens, tokens), head.fed, decoded))
        # The target's layer inputs at positions n_keep .. decoded - 1.
        head.inject(tokens[n_keep:decoded], self.states.after(n_keep, decoded))
        head.fed = decoded
        self.states.forget_before(decoded)
        head.stage_block(tokens[-1], k)
        yield
        draft = Draft(source=self.name, calls=1)
        place = self._cells(request.tokens) - 1  # the last token's, in what the target holds
        for row in range(1, k + 1):  # the row at position decoded + row
            if not self.take_next(draft, head.logits(row), rng, place + row, keep_drafting):
                break
        head.drop_block()
        return draft


class AssistantDrafter(HeadDrafter):
    """A Gemma 4 assistant: the target's own cache is its memory (AssistantHead.stage_at).

    Every row of a round sits at the position of the text's last token, as the assistant
    was trained (llama.cpp's driver does the same): the first reads that token beside the
    target's state before it; each next one its parent's token beside the state its
    parent's row gave. Nothing to catch up on, nothing to roll back, and a tree's nodes
    need no branches: the rows of a depth differ only in what they read.
    """

    name = "assistant"
    _last = 0  # the position of the text's last token, this round

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """Up to k tokens deep; a chain, or the tree `shape` allows."""
        tokens = request.tokens
        self._last = len(tokens) - 1 + (self.media.extra_positions if self.media else 0)
        state = self.states.after(self._last - 1, self._last)
        self.states.forget_before(self._last)
        self.head.stage_at(tokens[-1:], self._last, state)
        yield
        draft = yield from self._grow(
            self._cells(tokens), request.k, request.rng, request.keep_drafting, request.shape
        )
        draft.calls += 1  # the call that drafted the first depth
        return draft

    def stage_nodes(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seqs: Sequence[int],
        parent_rows: Sequence[int],
    ) -> None:
        """Each node at the last token's position, beside its parent's row's state."""
        self.head.stage_at(tokens, self._last, self.head.hidden_rows(parent_rows))


class ChainedHeadDrafter(HeadDrafter):
    """Several MTP blocks, one a draft step (MiMo-V2, Step-3.5, Hunyuan v3, ...): block i
    drafts the (i + 1)-th token, reading the text beside the target's states and the
    drafts before it beside the states the blocks before it gave, as llama.cpp's driver
    chains them (common/speculative.cpp, chain_heads). It drafts chains, at most a token
    a block.

    Each block attends over keys and values of its own, so each keeps a sequence of its
    own (ChainedMtpHead.stage_head), holding the text read beside the target's states, and
    its last draft rows until the next round. Step i catches block i up on the text the
    target accepted since and drafts at once, in one call: llama.cpp's driver catches
    every block up in a call of its own first (one per block), then drafts. A round that
    drafts fewer tokens than there are blocks still catches the others up, a call each:
    the target's states are kept for one round only, and no block may lag the text.
    """

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """Up to k tokens (one a block at most), a chain."""
        tokens, k, rng = self._sequence(request.tokens), request.k, request.rng
        head, last = self.head, len(tokens) - 1
        if not last:
            return Draft(source=self.name)
        n_keep = min(common_prefix(head.tokens, tokens), last)
        read, states = tokens[n_keep:], self.states.after(n_keep - 1, last)
        self.states.forget_before(last)
        head.tokens[n_keep:] = read  # what every block holds after this round, drafts aside
        for block in range(head.n_heads):
            head.forget_head(block, n_keep)  # and its draft rows of last round
        # What a call cannot hold beside the drafts (a prompt): every block's, now. The
        # last block's call holds what is left of `read` and a draft from each block but
        # itself; each call holds the text's last token at least.
        early = max(0, len(read) + head.n_heads - 1 - head.n_batch)
        if early:
            for block in range(head.n_heads):
                head.catch_up_head(block, read[:early], n_keep, states[:early])
            n_keep, read, states = n_keep + early, read[early:], states[early:]
        draft = Draft(source=self.name)
        own: list[np.ndarray] = []  # each drafting block's state at its last row
        for block in range(head.n_heads):
            drafting = len(own) == block < k
            rows, hidden = (read + draft.tokens, [states, *own]) if drafting else (read, [states])
            head.stage_head(block, rows, n_keep, np.concatenate(hidden))
            yield
            draft.calls += 1
            position = self._cells(request.tokens) + block
            taken = drafting and self.take_next(
                draft, head.logits(), rng, position, request.keep_drafting
            )
            if taken:
                own.append(head.hidden().copy())
        return draft


# Each head context's drafter.
DRAFTER_OF: dict[type[HeadContext], type[HeadDrafter]] = {
    MtpHead: HeadDrafter,
    Eagle3Head: Eagle3Drafter,
    ChainedMtpHead: ChainedHeadDrafter,
    DFlashHead: BlockDrafter,
    AssistantHead: AssistantDrafter,
}
# Their names: the drafter kinds that are heads (Policy.decoder).
HEAD_KINDS = frozenset(drafter.name for drafter in DRAFTER_OF.values())


def drafter_for(head: HeadContext) -> type[HeadDrafter]:
    """The drafter of this head context."""
    return DRAFTER_OF[type(head)]
