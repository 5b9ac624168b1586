"""What one generation did and how long it took, and the figures derived from it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class FlashAttnChoice:
    """-fa as asked and as used: "auto" becomes what measured faster (see Engine), and
    says when it switched from what earlier runs used (their greedy texts may differ)."""

    asked: str
    used: str
    switched_from: str | None = None

    def __str__(self) -> str:
        if self.asked != "auto":
            return self.used
        if self.switched_from:
            return f"auto -> {self.used} (measured; switched from {self.switched_from})"
        return f"auto -> {self.used} (measured)"

    def to_dict(self) -> dict[str, str | None]:
        return {"asked": self.asked, "used": self.used, "switched_from": self.switched_from}


@dataclass
class Stats:
    """Counters filled in by the decode loop.

    Times are split by where they were spent: inside the draft's llama.cpp decode calls,
    inside the target's, and everything else (our own Python work, sampling included).
    """

    k: str = "0"
    tree: str = "off"  # --tree: "off" (chains), "auto" or a number of tokens
    prompt_tokens: int = 0
    prompt_reused: int = 0  # of them, already in the target's memory from the last generation
    tokens: int = 0
    # Of them, what the call that read the prompt's end gave (its first token): its time
    # is the prompt's, so the rates below leave it out, as llama.cpp's eval time does.
    with_prompt: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_beside: int = 0  # of them, on a tree's branches (a chain would have missed)
    target_passes: int = 0
    # End-of-generation tokens the passes chose: not output, but a pass's token all the same
    # (without them the target alone would make fewer than one token a pass).
    stop_tokens: int = 0
    draft_lengths: Counter[int] = field(default_factory=Counter)
    batch_sizes: Counter[int] = field(default_factory=Counter)
    proposed_by: Counter[str] = field(default_factory=Counter)
    accepted_by: Counter[str] = field(default_factory=Counter)
    # Draft tokens accepted at each place in their draft (0: the first): vLLM's per-position
    # acceptance, which shows where drafts go wrong.
    accepted_at: Counter[int] = field(default_factory=Counter)
    prompt_seconds: float = 0.0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0  # undoing rejected drafts (Context.rollback_seconds)
    draft_calls: int = 0
    llama_seconds: float = 0.0  # llama.cpp's own clock of the same decode calls
    stop_reason: str = ""
    last_k: int = 0
    flash_attn: FlashAttnChoice | None = None
    seed: int | None = None  # the seed sampling used (None when greedy): it reproduces the run

    def record_round(
        self,
        source: str,
        n_drafted: int,
        n_batch: int,
        n_accepted: int,
        n_new: int,
        n_beside: int = 0,
        stopped: bool = False,
    ) -> None:
        """`n_batch`: the tokens the target verified, n_drafted + 1, or a few more when a
        recurrent model's rewind left accepted tokens to evaluate again. `n_beside`: the
        accepted tokens off a tree's primary path. `stopped`: the round's tokens ended
        with an end-of-generation token (not among the n_new)."""
        self.target_passes += 1
        self.tokens += n_new
        self.stop_tokens += stopped
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.accepted_beside += n_beside
        self.draft_lengths[n_drafted] += 1
        self.last_k = n_drafted
        self.batch_sizes[n_batch] += 1
        if n_drafted:
            self.proposed_by[source] += n_drafted
            self.accepted_by[source] += n_accepted
            self.accepted_at.update(range(n_accepted))

    def add(self, other: Stats) -> None:
        """Count `other`'s generation into this one (counters and times; not labels)."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, Counter):
                mine.update(getattr(other, f.name))
            elif isinstance(mine, int | float) and f.name not in ("last_k", "seed"):
                setattr(self, f.name, mine + getattr(other, f.name))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_depth(self) -> float:
        """Draft tokens accepted per round that drafted: the depth a tree's accepted
        path reached, a chain's accepted prefix."""
        rounds = self.target_passes - self.draft_lengths[0]
        return self.accepted / rounds if rounds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens each target pass chose, an end-of-generation one included."""
        chosen = self.tokens + self.stop_tokens
        return chosen / self.target_passes if self.target_passes else 0.0

    @property
    def timed_tokens(self) -> int:
        """The tokens made in `seconds`."""
        return self.tokens - self.with_prompt

    @property
    def tokens_per_second(self) -> float:
        return self.timed_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def other_seconds(self) -> float:
        spent = self.draft_seconds + self.verify_seconds + self.rollback_seconds
        return max(0.0, self.seconds - spent)

    @property
    def mean_k(self) -> float:
        rounds = sum(self.draft_lengths.values())
        return sum(k * n for k, n in self.draft_lengths.items()) / rounds if rounds else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "prompt_reused": self.prompt_reused,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_passes": self.target_passes,
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "seconds": round(self.seconds, 4),
            "prompt_seconds": round(self.prompt_seconds, 4),
            "time_split": {
                "draft": round(self.draft_seconds, 4),
                "verify": round(self.verify_seconds, 4),
                "rollback": round(self.rollback_seconds, 4),
                "other": round(self.other_seconds, 4),
                "llama_cpp_clock": round(self.llama_seconds, 4),
            },
            "k": self.k,
            "tree": self.tree,
            # Per round: tokens drafted (a tree's nodes), and how deep the accepted path went.
            "k_mean": round(self.mean_k, 3),
            "accepted_depth_mean": round(self.accepted_depth, 3),
            "accepted_beside_chain": self.accepted_beside,
            "k_histogram": {str(k): n for k, n in sorted(self.draft_lengths.items())},
            "drafters": {
                name: {"proposed": n, "accepted": self.accepted_by[name]}
                for name, n in sorted(self.proposed_by.items())
            },
            "stop_reason": self.stop_reason,
            "flash_attn": self.flash_attn.to_dict() if self.flash_attn else None,
        }

    def summary(self) -> str:
        """One plain line, for logs and pipes."""
        line = f"{self.tokens} tokens in {self.seconds:.2f}s ({self.tokens_per_second:.1f} tok/s)"
        if self.drafted:
            line += (
                f", accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.1%})"
                f" from {'+'.join(sorted(n for n, k in self.proposed_by.items() if k))}"
                f", {self.tokens_per_pass:.2f} tokens/pass, k={self.k} (mean {self.mean_k:.2f})"
            )
            if self.tree != "off":
                line += f", tree={self.tree} (accepted depth {self.accepted_depth:.2f})"
        line += f", stop: {self.stop_reason or 'running'}"
        line += f", seed {self.seed}" if self.seed is not None else ""
        return line + (f", -fa {self.flash_attn}" if self.flash_attn else "")
