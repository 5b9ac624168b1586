"""Policy: who drafts, how much, and how wide, from the options and the measured costs.

A Decoder is one slot's policy in objects: its drafter (a draft model, in the target's
vocabulary or translated; a lookup; both), its draft-length policy (fixed, or -k auto
priced with what that drafter costs) and its tree policy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.draft import Drafter
from specdec_cli.decoding.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.decoding.heads import HEAD_KINDS, HeadDrafter, drafter_for
from specdec_cli.decoding.lookupthenmodel import LookupThenModel
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.ngram import NgramDrafter, TextMemory
from specdec_cli.decoding.settings import parse_k, parse_tree
from specdec_cli.decoding.translate import TranslatedDrafter
from specdec_cli.decoding.treeshape import AutoTree, FixedTree, TreePolicy
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context

if TYPE_CHECKING:
    from specdec_cli.decoding.loading import LoadedModels

LOOKUP_MIN_MATCH = 3  # with a draft model too; measured, see benchmarks/README.md
VERBATIM_PRIOR = 0.99  # -k auto's first estimate for verbatim repeats (see NgramDrafter)
# ...and for the lookup's other guesses: after a match of 2-4 tokens the target took them
# two times in three on Spec-Bench's prompts (SmolLM2-135M-Instruct), nearly always where
# a base model repeats itself (Gemma 3 270M): tests/data/lookup.
LOOKUP_PRIOR = 0.7
# ...and for a draft of another vocabulary, whose guesses reach the target through its
# text (benchmarks/README.md, "Any draft for any target").
TRANSLATED_PRIOR = 0.5
# Such a draft's rounds cost more than its calls: both models' re-tokenization, and
# catch-up calls of several tokens. Measured, they ran a few percent slower than priced,
# so its drafting must promise this much over no draft to go on (AutoLength's margin).
TRANSLATED_MARGIN = 0.05


def drafter_name(kind: str) -> str:
    """The drafter of a decoder's kind, without the lookup beside it ("mtp+ngram": "mtp")."""
    return kind.partition("+")[0]


class Policy:
    """Decoders for the loaded models, as the options and a request ask."""

    def __init__(self, models: LoadedModels) -> None:
        self.models = models
        d = models.options.drafting
        # Shared by every slot's lookup (see TextMemory): one server's recent texts.
        self.memory = (
            TextMemory(d.ngram_memory, d.ngram_min, d.ngram_max) if d.ngram_memory else None
        )

    def decoder(self, kind: str | None, k: str, tree: str | None = None, slot: int = 0) -> Decoder:
        """A decoder for `slot`, drafting with `kind` ("model", "ngram", "model+ngram", the
        head's "mtp" and "mtp+ngram", or None for target-only), draft length k (a number
        or "auto") and `tree` ("off", "auto" or a number of tokens; None: the options').
        All decoders share the loaded models; a slot's decoders share its part of their
        contexts."""
        d, sampling = self.models.options.drafting, self.models.options.sampling
        tree = d.tree if tree is None else tree
        target, draft_ctx = self.models.slots[slot], self.models.draft_slots[slot]
        if kind is None:
            return Decoder(target, None, sampling)
        if kind == "ngram":
            drafter: Drafter = self._lookup(d.ngram_min)
        else:
            model, _, lookup_beside = kind.partition("+")
            drafter = self._head(slot) if model in HEAD_KINDS else self._model(draft_ctx)
            if lookup_beside:
                # Next to a model, only longer matches are worth more than its guess.
                lookup = self._lookup(max(d.ngram_min, LOOKUP_MIN_MATCH))
                drafter = LookupThenModel(lookup, drafter)
        # With -k auto, a lookup beside the model has a length policy of its own: it learns
        # that copied text is accepted far longer than the model's guesses.
        auto = parse_k(k) is None
        own = kind.endswith("+ngram") and auto
        lengths = {"ngram": self.draft_length("ngram", k)} if own else {}
        if auto and "ngram" in kind:
            # A verbatim repeat is accepted far longer still: it starts out trusted.
            lengths[NgramDrafter.VERBATIM_SOURCE] = self._length("ngram", k, None, VERBATIM_PRIOR)
        length = self.draft_length(kind, k)
        policy = self.tree_policy(tree, kind)
        return Decoder(
            target, drafter, sampling, length, k, policy, tree if policy else "off", lengths
        )

    def _lookup(self, n_min: int) -> NgramDrafter:
        """An n-gram lookup of n-grams from n_min long, looking in the server's recent
        texts too."""
        d, sampling = self.models.options.drafting, self.models.options.sampling
        return NgramDrafter(n_min, max(d.ngram_max, n_min), sampling.draft_invariant, self.memory)

    def _model(self, ctx: Context | None) -> ModelDrafter | TranslatedDrafter:
        if ctx is None:
            raise UserError("no draft model is loaded; pass one with -d")
        return self.model_drafter(ctx)

    def _head(self, slot: int) -> HeadDrafter:
        """The slot's share of the drafting head."""
        if not self.models.head_slots:
            raise UserError(f"{self.models.model.path.name} drafts with no head here")
        head, states = self.models.head_slots[slot]
        return drafter_for(head)(head, states, self.models.options.sampling)

    def model_drafter(self, ctx: Context) -> ModelDrafter | TranslatedDrafter:
        """The draft model's drafter: in the target's vocabulary (reading the media through
        its own projector, where it has one), or translated to it."""
        sampling = self.models.options.sampling
        if self.models.translation is None:
            drafter = ModelDrafter(ctx, sampling, self.models.model.n_vocab)
            drafter.sees_media = self.models.draft_encodings is not None
            return drafter
        return TranslatedDrafter(ModelDrafter(ctx, sampling), self.models.translation)

    def draft_length(self, kind: str, k: str, costs: Costs | None = None) -> DraftLength:
        """-k as the policy a drafter of this kind drafts by, priced with `costs` (None:
        the measured ones; a replay passes a modelled machine's)."""
        if kind == "ngram":
            return self._length(kind, k, costs, LOOKUP_PRIOR)
        if self.models.translation is not None:
            return self._length(kind, k, costs, TRANSLATED_PRIOR, TRANSLATED_MARGIN)
        return self._length(kind, k, costs, head=drafter_name(kind) in HEAD_KINDS)

    def _length(
        self,
        kind: str,
        k: str,
        costs: Costs | None,
        prior: float = AutoLength.PRIOR,
        margin: float = 0.0,
        head: bool = False,
    ) -> DraftLength:
        """-k as a policy for a drafter of this kind: a fixed length, or auto's, priced
        with what this drafter costs and starting from `prior` acceptance (`margin`: see
        AutoLength; a `head`'s acceptance by depth is its own: its bayes_weight)."""
        d = self.models.options.drafting
        n = parse_k(k)
        if n is not None:
            return FixedLength(n, d.p_min)
        settled, first = self._costs_for(kind, costs)
        return AutoLength(
            settled,
            d.draft_min,
            min(d.draft_max, self._blocks_of(kind) or d.draft_max),  # a block a token
            d.p_min,
            uses_confidence=d.p_min > 0.0,
            prior=prior,
            margin=margin,
            first=first,
            bayes_weight=head,
        )

    def _blocks_of(self, kind: str) -> int:
        """The chained MTP blocks a drafter of this kind drafts with, a token each (0:
        it drafts otherwise)."""
        head = self.models.head
        if head is None or head.n_heads == 1 or drafter_name(kind) != "mtp":
            return 0
        return head.n_heads

    def _calls_a_round(self, kind: str) -> int:
        """The draft calls a round of this kind pays whatever its length (0: a call a
        token): a DFlash block's one, and chained MTP blocks' one each (each catches up
        every round, drafting or not)."""
        return 1 if drafter_name(kind) == "dflash" else self._blocks_of(kind)

    def fits_tree(self, tree: str) -> bool:
        """Whether a tree setting is no wider than this engine was made for. "auto"
        always fits: where no tree can be drafted, it drafts chains."""
        nodes = parse_tree(tree)
        return nodes is None or tree == "auto" or nodes <= self.models.tree_nodes

    def tree_policy(self, tree: str, kind: str, costs: Costs | None = None) -> TreePolicy | None:
        """--tree as the policy a drafter of this kind grows trees by (None: chains),
        priced as draft_length prices it."""
        nodes = parse_tree(tree)
        if nodes is None or not self.models.tree_nodes:
            return None
        if not self.fits_tree(tree):
            raise UserError(
                f"--tree {tree} is wider than this engine was made for ({self.models.tree_nodes})"
            )
        if tree == "auto":
            settled, first = self._costs_for(kind, costs)
            return AutoTree(settled, min(nodes, self.models.tree_nodes), first)
        return FixedTree(nodes)

    def _costs_for(self, kind: str, costs: Costs | None = None) -> tuple[Costs, Costs]:
        """The costs (None: the measured ones) as a drafter of this kind pays them, for
        generations whose text no draft changes and for rejection-sampled ones (the
        median of the measurements and the first: see AutoLength)."""
        if costs is not None:
            paid = self._paid_by(kind, costs)
            return paid, paid
        models = self.models
        return self._paid_by(kind, models.costs()), self._paid_by(kind, models.first_costs())

    def _paid_by(self, kind: str, costs: Costs) -> Costs:
        """`costs` as a drafter of this kind pays them: a lookup costs next to nothing;
        a translated draft model takes as many draft calls a target token as its tokens
        are shorter than the target's; a DFlash block and chained MTP blocks as many
        calls a round whatever its length (_calls_a_round)."""
        if kind == "ngram":
            return replace(costs, draft_over_target=0.0)
        if per_round := self._calls_a_round(kind):
            return replace(costs, calls_per_token=0.0, calls_per_round=per_round)
        if self.models.translation is not None:
            return replace(costs, calls_per_token=self.models.translation.calls_per_token)
        return costs
