"""A drafting head (MTP, EAGLE-3): one more drafter behind the Drafter interface.

It drafts as a draft model does, one token a call, and chooses each token as a draft
model does (greedy, coupled or sampled, with its own distribution as q: see
ModelDrafter.children), so the verifier's exact rules hold unchanged. What differs is
what it reads: beside each token, a hidden state (see llamacpp/heads.py). Positions the
target decoded read the target's; its own drafts read the head's.

Its memory therefore holds a prefix of the accepted tokens fed with the target's states
(positions below the round's last accepted token), and never its own drafts' rows: those
read the head's states, and are dropped at the next round. Each round's first call
catches up on the tokens the target accepted since, together with the first draft step:
llama.cpp's driver spends a call more (common/speculative.cpp feeds every verified row
first, then drafts).
"""

from __future__ import annotations

import numpy as np

from specdec_cli.decoding.drafters import Draft, DraftSteps, KeepDrafting, ModelDrafter, TreeShape
from specdec_cli.decoding.sampling import Noise, SamplingParams
from specdec_cli.llamacpp.heads import HeadContext, HiddenStates
from specdec_cli.llamacpp.llama import common_prefix

HEAD_KINDS = ("mtp", "eagle3")  # HeadContext.kind: the drafters' names


class HeadDrafter(ModelDrafter):
    """A drafting head (the target's MTP block, or an EAGLE-3 file), drafting chains."""

    name = "mtp"  # or, per instance, "eagle3"

    def __init__(self, ctx: HeadContext, states: HiddenStates, sampling: SamplingParams) -> None:
        super().__init__(ctx, sampling)  # type: ignore[arg-type]
        self.head = ctx
        self.states = states
        self.name = ctx.kind

    def begin(
        self, prompt: list[int], sampling: SamplingParams | None = None, noise: Noise | None = None
    ) -> None:
        """Nothing to read now: the first round catches up on the prompt, with the
        target's states, which its decode calls recorded (keeping what the head holds
        of an earlier generation's text, as far as the prompt repeats it)."""
        if sampling is not None:
            self.sampling = sampling
        self.noise = noise

    def drafting(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
        shape: TreeShape | None = None,
        source: str | None = None,
    ) -> DraftSteps:
        """Up to k tokens, a chain (a head's `shape` is always one)."""
        head, last = self.head, len(tokens) - 1
        # What the head reads, by its positions: the text, or for EAGLE-3 the text from
        # its second token (its row at p holds the token at p + 1).
        read = tokens[head.shift :]
        if not read:
            return Draft(source=self.name)
        # Rows up to the last token, which the target has not decoded yet (it comes first
        # in the verification), but whose state before it the last verification gave.
        n_keep = head.rewind(min(common_prefix(head.tokens, read), head.fed, len(read) - 1))
        states = head.states_for(self.states.before(n_keep + head.shift, len(tokens)))
        head.stage(read[n_keep:], hidden=states)
        head.fed = len(read)
        self.states.forget_before(last)
        yield
        draft = Draft(source=self.name, calls=1)
        need_confidence = keep_drafting is not None
        for depth in range(k):
            logits = head.logits()  # the target's vocabulary (EAGLE-3's mapped by d2t)
            ids, probs, dists = self.children(logits, rng, 1, need_confidence, last + 1 + depth)
            if keep_drafting and not keep_drafting(depth, probs[0]):
                break
            draft.tokens.append(ids[0])
            if dists[0] is not None:
                draft.dists.append(dists[0])
            if need_confidence:
                draft.confidences.append(probs[0])
            if depth + 1 == k:
                break
            head.stage([ids[0]], hidden=head.hidden())
            draft.calls += 1
            yield
        return draft
