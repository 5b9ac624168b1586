"""`specdec serve`'s counters since start-up, in Prometheus text (GET /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec_cli.decoding.scheduler import Counters
from specdec_cli.decoding.stats import Stats


@dataclass
class Metrics:
    """Counters since start-up, in Prometheus text (names as vLLM's where they exist)."""

    requests: int = 0
    rejected: int = 0
    cancelled: int = 0  # stopped early: the client went away, or the server is stopping
    totals: Stats = field(default_factory=Stats)
    drafts: int = 0  # rounds with a draft

    def record(self, stats: Stats) -> None:
        self.requests += 1
        self.cancelled += stats.stop_reason == "cancelled"
        self.totals.add(stats)
        self.drafts += sum(n for k, n in stats.draft_lengths.items() if k)

    def text(self, processing: int, deferred: int, counters: Counters, encoded: int) -> str:
        """`encoded`: images and audio clips the projector encoded (each once, while its
        embeddings are kept: see multimodal.Encodings)."""
        t, c = self.totals, counters
        decodes = max(c.decodes, 1)
        rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
            ("requests_total", "counter", "Generations finished", [("", self.requests)]),
            ("requests_rejected_total", "counter", "Requests refused, queue full",
             [("", self.rejected)]),
            ("requests_cancelled_total", "counter",
             "Generations stopped early (client gone, or server stopping)",
             [("", self.cancelled)]),
            ("requests_processing", "gauge", "Generations in a slot", [("", processing)]),
            ("requests_deferred", "gauge", "Generations waiting for a slot", [("", deferred)]),
            ("decode_total", "counter", "Target decode calls of the decode loop",
             [("", c.decodes)]),
            ("n_busy_slots_per_decode", "gauge", "Slots advanced per decode call, on average",
             [("", c.busy_slot_decodes / decodes)]),
            ("n_tokens_per_decode", "gauge", "Tokens per decode call, on average",
             [("", c.decoded_tokens / decodes)]),
            ("prompt_tokens_total", "counter", "Prompt tokens", [("", t.prompt_tokens)]),
            ("prompt_tokens_cached_total", "counter",
             "Prompt tokens reused from the previous generation's cache",
             [("", t.prompt_reused)]),
            ("generation_tokens_total", "counter", "Generated tokens", [("", t.tokens)]),
            ("time_per_output_token_seconds", "summary", "Generation time per output token",
             [("_sum", t.seconds), ("_count", t.tokens)]),
            ("spec_decode_num_drafts_total", "counter", "Rounds that verified a draft",
             [("", self.drafts)]),
            ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed",
             [("", t.drafted)]),
            ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted",
             [("", t.accepted)]),
            ("spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Draft tokens accepted, by place in their draft (0: first)",
             [(f'{{position="{i}"}}', n) for i, n in sorted(t.accepted_at.items())]),
            ("spec_decode_num_accepted_beside_chain_total", "counter",
             "Draft tokens accepted on a tree's side branches (a chain would have missed them)",
             [("", t.accepted_beside)]),
            ("target_passes_total", "counter", "Target passes (each verifies one draft)",
             [("", t.target_passes)]),
            ("media_encoded_total", "counter", "Images and audio clips encoded",
             [("", encoded)]),
        ]  # fmt: skip
        lines = []
        for name, kind, help_text, samples in rows:
            lines += [f"# HELP specdec:{name} {help_text}.", f"# TYPE specdec:{name} {kind}"]
            lines += [f"specdec:{name}{suffix} {value}" for suffix, value in samples]
        return "\n".join(lines) + "\n"
