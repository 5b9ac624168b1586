"""`specdec bench`: target-only and speculative variants, measured side by side.

Variants run interleaved (for each repeat, for each prompt and each of its turns,
every variant in turn) so that machine noise hits them alike. Each variant's figures
come from the same Stats the decode loop keeps in `run`, and the cost model turns the
measured acceptance and costs into the speedup a perfect implementation would reach.
A question's later turns follow each variant's own answers (see workload.py); its
turns' figures add up to the question's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from specdec_cli import __version__
from specdec_cli.commands.workload import Workload
from specdec_cli.decoding import costmodel
from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.settings import parse_k, parse_tree
from specdec_cli.decoding.stats import FlashAttnChoice, Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import backend, machine
from specdec_cli.llamacpp.model import Model
from specdec_cli.models.chat import ChatFormat, Message, chat_tokens, render

BUILTIN_PROMPTS = {
    "story": "Once upon a time, in a small village by the sea, there lived a girl who",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "list": "Things to pack for a camping trip:\n1. A tent\n2. A sleeping bag\n3.",
    "factual": "The sun is a star. It is very big and very hot. The moon",
    "copy": (
        "Rewrite the list, changing red to blue.\n"
        "- a red ball on the floor\n- a red car in the street\n- a red hat on the dog\n"
        "Rewritten:\n- a blue ball on the floor\n-"
    ),
}

WARMUP_TOKENS = 16
# Room for each earlier answer of a conversation beyond its -n tokens: its text,
# tokenized again inside the next turn's prompt, may take a few more.
ANSWER_SLACK = 16
# Past these, the figures say more about the machine's load than about speculation.
EFFICIENCY_LIMIT = 1.1  # speedup / ideal: the ideal is a bound, up to noise
DRIFT_LIMIT = 0.1  # the target alone's tokens/s, between its slowest and fastest repeat


@dataclass(frozen=True)
class BenchOptions:
    """`specdec bench`'s defaults: greedy, so that every variant makes the same text."""

    ks: str = "1,2,4,8"
    trees: str = "off"
    n_predict: int = 128
    repeat: int = 3
    temp: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Variant:
    drafter: str | None  # "model", "ngram", "model+ngram", or None for the target alone
    k: str = "0"
    tree: str = "off"

    @property
    def uses_model(self) -> bool:
        """Whether a draft model or a head (alone or behind the lookup) does the drafting."""
        return self.drafter not in (None, "ngram")

    def named_for(self, engine: Engine) -> Variant:
        """As the engine drafts it: a -d file that is a head ("eagle3", "dflash",
        "assistant") drafts as that head, where the command line could only say "model"."""
        head = engine.head_kind
        if head is None or engine.draft_ctx is not None or self.drafter is None:
            return self
        return replace(self, drafter=self.drafter.replace("model", head))

    @property
    def name(self) -> str:
        if self.drafter is None:
            return "target only"
        tree = f" tree={self.tree}" if self.tree != "off" else ""
        return f"{self.drafter} k={self.k}{tree}"


@dataclass
class VariantResult:
    variant: Variant
    # One Stats per (repeat, prompt), in that order; a question's turns added up.
    runs: list[Stats] = field(default_factory=list)

    def by_repeat(self, n_prompts: int, among: Sequence[int] | None = None) -> list[list[Stats]]:
        """Each repeat's runs: of every prompt, or of the prompts `among` (their indices)."""
        chunks = [self.runs[i : i + n_prompts] for i in range(0, len(self.runs), n_prompts)]
        return chunks if among is None else [[c[j] for j in among] for c in chunks]

    def repeat_speeds(self, n_prompts: int, among: Sequence[int] | None = None) -> list[float]:
        """Tokens/s of each repeat over the whole prompt set (or over the prompts `among`):
        their tokens over their seconds."""
        return [_speed(c) for c in self.by_repeat(n_prompts, among)]

    def total(self, runs: Iterable[Stats] | None = None) -> Stats:
        """All runs (or `runs`) added up, for acceptance, passes and the time split."""
        out = Stats(k=self.variant.k)
        for s in self.runs if runs is None else runs:
            out.add(s)
        return out


def _speed(runs: list[Stats]) -> float:
    seconds = sum(s.seconds for s in runs)
    return sum(s.tokens for s in runs) / seconds if seconds > 0 else 0.0


@dataclass
class BenchReport:
    workload: Workload
    results: list[VariantResult]
    costs: Costs
    n_predict: int
    repeat: int
    flash_attn: FlashAttnChoice
    setup: dict[str, object] = field(default_factory=dict)  # what reproduces it (see run_bench)

    @property
    def baseline(self) -> VariantResult:
        return self.results[0]

    @property
    def n_prompts(self) -> int:
        return len(self.workload.questions)

    def median_speed(self, result: VariantResult, among: Sequence[int] | None = None) -> float:
        """Median over repeats of tokens/s, over every prompt or the prompts `among`."""
        return statistics.median(result.repeat_speeds(self.n_prompts, among))

    def speedup(self, result: VariantResult, among: Sequence[int] | None = None) -> float:
        """Ratio of medians, both measured in this run (over the prompts `among`)."""
        base = self.median_speed(self.baseline, among)
        return self.median_speed(result, among) / base if base else 0.0

    def paired_speedups(
        self, result: VariantResult, among: Sequence[int] | None = None
    ) -> list[float]:
        """Each repeat's speed over the target alone's in the same repeat (over the prompts
        `among`): the variants ran each turn back to back, so what the machine's speed
        does from repeat to repeat cancels out of each ratio, where a ratio of medians
        keeps it."""
        base = self.baseline.repeat_speeds(self.n_prompts, among)
        mine = result.repeat_speeds(self.n_prompts, among)
        return [m / b for m, b in zip(mine, base, strict=True) if b > 0] or [0.0]

    def paired_figures(
        self, result: VariantResult, among: Sequence[int] | None = None
    ) -> dict[str, float]:
        """The paired speedups' median, and their lowest and highest: how far apart the
        repeats put the variant (see paired_speedups)."""
        ratios = self.paired_speedups(result, among)
        return {
            "paired_speedup": round(statistics.median(ratios), 4),
            "paired_speedup_min": round(min(ratios), 4),
            "paired_speedup_max": round(max(ratios), 4),
        }

    def draft_cost(self, variant: Variant) -> float:
        """c for the cost model: a lookup costs next to nothing."""
        return self.costs.draft_over_target if variant.uses_model else 0.0

    def ideal_speedup(self, result: VariantResult) -> float:
        t = result.total()
        c = self.draft_cost(result.variant)
        return costmodel.ideal_speedup(t.tokens, t.draft_calls, t.batch_sizes, c, self.costs.verify)

    def best(self) -> VariantResult:
        return max(self.results[1:], key=self.median_speed, default=self.baseline)

    def speed_by_prompt(self, result: VariantResult) -> dict[str, float]:
        """Median tokens/s per prompt over the repeats."""
        n = self.n_prompts
        return {
            question.name: statistics.median(s.tokens_per_second for s in result.runs[i::n])
            for i, question in enumerate(self.workload.questions)
        }

    def by_category(self, result: VariantResult) -> dict[str, dict[str, float]]:
        """Each category's figures, as the whole run's: tokens over seconds summed over the
        category's questions in each repeat, the median over repeats, its ratio to the
        target alone's, and the paired ratios (see paired_figures); acceptance, tokens a
        pass and mean k over all its runs."""
        figures = {}
        for category, among in self.workload.categories.items():
            t = result.total(s for runs in result.by_repeat(self.n_prompts, among) for s in runs)
            figures[category] = {
                "speedup": round(self.speedup(result, among), 4),
                **self.paired_figures(result, among),
                "tokens_per_second": round(self.median_speed(result, among), 2),
                "tokens_per_pass": round(t.tokens_per_pass, 4),
                "acceptance_rate": round(t.acceptance_rate, 4),
                "k_mean": round(t.mean_k, 3),
            }
        return figures

    def verdict(self) -> str:
        """One plain sentence: what pays, or why nothing does."""
        best = self.best()
        if best is self.baseline:
            return "no speculative variant was run"
        gain = self.speedup(best)
        if gain >= 1.0:
            return f"best: {best.variant.name}, {gain:.2f}x the target alone"
        t = best.total()
        alpha = t.acceptance_rate
        c = self.draft_cost(best.variant)
        reason = []
        if alpha < 0.5:
            reason.append(f"the draft's tokens are accepted only {alpha:.0%} of the time")
        if c > 0.1:
            reason.append(
                f"one draft token costs {c:.2f} of a target token (aim for under 0.1: "
                "a draft 10-20x smaller)"
            )
        _, bound = costmodel.best_expected_k(alpha, c, self.costs.verify)
        if bound < 1.0:
            reason.append(f"with these figures even a perfect implementation reaches {bound:.2f}x")
        if not reason:
            reason.append(
                f"our own overhead is {t.other_seconds / t.seconds:.0%} of the time; "
                "rerun with more tokens (-n) to amortize it"
            )
        return f"speculation does not pay here ({gain:.2f}x at best): " + "; ".join(reason)

    def warnings(self) -> list[str]:
        """Why the figures cannot be trusted, if they cannot: the machine's speed changed."""
        out = []
        speeds = self.baseline.repeat_speeds(self.n_prompts)
        drift = max(speeds) / min(speeds) - 1.0 if min(speeds) > 0 else 0.0
        if drift > DRIFT_LIMIT:
            out.append(
                f"the target alone ran at {min(speeds):.1f}-{max(speeds):.1f} tok/s across "
                f"repeats ({drift:.0%} apart): the machine's speed changed while measuring"
            )
        for result in self.results[1:]:
            ideal = self.ideal_speedup(result)
            if ideal and self.speedup(result) / ideal > EFFICIENCY_LIMIT:
                out.append(
                    f"{result.variant.name} beat the ideal speedup "
                    f"({self.speedup(result) / ideal:.0%} efficiency): its costs were measured "
                    "on a machine of another speed"
                )
        if out:
            out.append("these figures are not trustworthy; rerun on an idle machine")
        return out

    def to_dict(self) -> dict[str, object]:
        base = self.baseline
        return {
            "settings": {
                "n_predict": self.n_predict,
                "repeat": self.repeat,
                "prompts_from": self.workload.source,
                "per_category": self.workload.per_category,
                "prompts": self.workload.described(),
                "flash_attn": self.flash_attn.to_dict(),
                **self.setup,
            },
            "baseline": self.variant_dict(base),
            "runs": [self.variant_dict(r) for r in self.results[1:]],
            "best": self.best().variant.name,
            "verdict": self.verdict(),
            "warnings": self.warnings(),
            "cost": self.costs.to_dict(),
        }

    def variant_dict(self, result: VariantResult) -> dict[str, object]:
        speeds = result.repeat_speeds(self.n_prompts)
        t = result.total()
        seconds = t.seconds or 1.0
        out: dict[str, object] = {
            "name": result.variant.name,
            "drafter": result.variant.drafter,
            "k": result.variant.k,
            "tree": result.variant.tree,
            "tokens_per_second": round(statistics.median(speeds), 2),
            "tokens_per_second_min": round(min(speeds), 2),
            "tokens_per_second_max": round(max(speeds), 2),
            "tokens_per_second_by_prompt": {
                name: round(v, 2) for name, v in self.speed_by_prompt(result).items()
            },
            "speedup": round(self.speedup(result), 4),
            **self.paired_figures(result),
            "acceptance_rate": round(t.acceptance_rate, 4),
            "tokens_per_pass": round(t.tokens_per_pass, 4),
            "k_mean": round(t.mean_k, 3),
            "accepted_depth_mean": round(t.accepted_depth, 3),
            "accepted_beside_chain": t.accepted_beside,
            "k_histogram": {str(k): n for k, n in sorted(t.draft_lengths.items())},
            "time_share": {
                "draft": round(t.draft_seconds / seconds, 4),
                "verify": round(t.verify_seconds / seconds, 4),
                "rollback": round(t.rollback_seconds / seconds, 4),
                "other": round(t.other_seconds / seconds, 4),
            },
            # Over all runs: our wall clock, and llama.cpp's own clock of its decode calls
            # in those runs. The difference is our overhead.
            "tokens_per_second_all_runs": round(t.tokens_per_second, 2),
            "llama_cpp_tokens_per_second": round(t.timed_tokens / t.llama_seconds, 2)
            if t.llama_seconds
            else 0.0,
            "overhead_share": round(1.0 - t.llama_seconds / seconds, 4),
            "categories": self.by_category(result),
        }
        if result.variant.drafter is not None:
            ideal = self.ideal_speedup(result)
            out["theoretical_speedup"] = round(ideal, 4)
            out["efficiency"] = round(self.speedup(result) / ideal, 4) if ideal else 0.0
        return out


def variants(
    drafters: Sequence[str], ks: Sequence[str], trees: Sequence[str] = ("off",)
) -> list[Variant]:
    """The baseline first, then every drafter at every k, with every tree setting."""
    for k in ks:
        parse_k(k)
    for tree in trees:
        parse_tree(tree)
    return [Variant(None), *(Variant(d, k, t) for d in drafters for k in ks for t in trees)]


def widest_tree(trees: Sequence[str]) -> str:
    """The --tree an engine must be made for to run all of `trees`: the widest, "auto"
    where it is as wide (it also falls back to chains for recurrent models)."""
    return max(trees, key=lambda tree: (parse_tree(tree) or 0, tree == "auto"), default="off")


def longest_k(ks: Sequence[str]) -> str:
    """The -k an engine must be made for to run all of `ks`: the longest ("auto" where
    one is auto: up to --draft-max). A recurrent target's snapshots then cover every
    variant's rounds, as they cover `run`'s: made for less, the engine copied the whole
    recurrent state before each longer draft, outside the decode calls (over RPC, tens
    of milliseconds a round)."""
    lengths = [parse_k(k) for k in ks]
    return "auto" if None in lengths else str(max((n for n in lengths if n), default=1))


def environment() -> dict[str, object]:
    """The software and machine a benchmark ran on."""
    from llama_cpp import __version__ as binding

    return {
        "specdec": __version__,
        "llama_cpp_python": binding,
        "backends": list(backend.backend_names()),
        "cpu": machine.cpu_name(),
    }


def fit_context(
    model: Model, workload: Workload, n_predict: int, ks: list[str], draft_max: int
) -> int:
    """Just enough context for the benchmark: a larger KV cache slows every decode down.
    `model`: the target's vocabulary (loaded alone is enough)."""
    check_chat_template(model, workload)
    longest_k = max([draft_max, *(int(k) for k in ks if k.isdigit())])
    longest_prompt = max(
        prompt_room(model, workload, q.turns, n_predict) for q in workload.questions
    )
    return -(-(longest_prompt + n_predict + longest_k + 2) // 256) * 256


def prompt_room(model: Model, workload: Workload, turns: tuple[str, ...], n_predict: int) -> int:
    """The tokens a question's last turn starts from: its conversation, each earlier
    answer counted as -n tokens and ANSWER_SLACK more."""
    if workload.chat is None:
        return len(model.tokenize(turns[0]))
    messages = [m for turn in turns[:-1] for m in (Message("user", turn), Message("assistant", ""))]
    messages.append(Message("user", turns[-1]))
    text = render(model, messages, workload.chat)
    return len(chat_tokens(model, text)) + (len(turns) - 1) * (n_predict + ANSWER_SLACK)


def check_chat_template(model: Model, workload: Workload) -> None:
    """Questions are chat turns: refuse a model that has no chat format (the one
    `run --chat` would refuse), saying what to do instead."""
    chat = workload.chat
    if chat is not None and chat.template is None and model.chat_template() is None:
        raise UserError(
            f"{model.path.name} has no chat template, and the questions of {workload.source} "
            "are chat turns; name its format with --chat-template (e.g. chatml) or "
            "--chat-template-file, or give plain prompts (a --prompts file, one a line)"
        )


def run_bench(
    engine: Engine,
    variant_list: list[Variant],
    workload: Workload,
    options: BenchOptions,
    advance: Callable[[str, int], None] = lambda name, steps: None,
) -> BenchReport:
    """Measure every variant on every prompt (every turn of every question), `repeat`
    times, interleaved. `advance` hears what is being done and how many of the
    generations it finished."""
    n_predict, repeat, seed = options.n_predict, options.repeat, options.seed
    variant_list = [v.named_for(engine) for v in variant_list]
    check_chat_template(engine.model, workload)
    first_prompt = _turn_prompt(engine, workload.chat, [], workload.questions[0].turns[0])
    max_batch = 1 + max((_max_k(engine, v) for v in variant_list), default=0)

    def measure(reps: int) -> Costs:
        advance("measuring costs", 0)
        # At a typical position of the runs (mid-output); -k auto decoders start from it.
        return engine.measure_costs(range(1, max_batch + 1), reps, 16 + n_predict // 2)

    # Costs are measured again after every repeat and the medians kept, so that they
    # describe the same machine, in the same moods, as the runs.
    measured = [measure(reps=5)]
    decoders = [engine.make_decoder(v.drafter, v.k, v.tree) for v in variant_list]
    advance("warming up", 0)
    for decoder in decoders:  # warm-up, not counted
        _generate(decoder, first_prompt, WARMUP_TOKENS, seed)
    results = [VariantResult(v) for v in variant_list]
    order = list(range(len(variant_list)))
    rotation = 0
    for r in range(repeat):
        for question in workload.questions:
            asked = [Stats() for _ in variant_list]
            histories: list[list[Message]] = [[] for _ in variant_list]
            for turn in question.turns:
                # Rotate who goes first, so no variant always runs right after another.
                shift = rotation % len(order)
                rotation += 1
                for i in order[shift:] + order[:shift]:
                    prompt = _turn_prompt(engine, workload.chat, histories[i], turn)
                    stats, answer = _generate(decoders[i], prompt, n_predict, seed + r)
                    asked[i].add(stats)
                    histories[i] += [Message("user", turn), _answer(engine.model, answer)]
                    advance(variant_list[i].name, 1)
            for result, stats in zip(results, asked, strict=True):
                result.runs.append(stats)
        measured.append(measure(reps=5))
    costs = costmodel.median_costs(measured)
    sampling = {"sampling": asdict(engine.options.sampling), "seed": seed}
    grammar = engine.options.grammar
    if grammar is not None:  # --grammar, --json-schema: what every run's output followed
        sampling["grammar"] = {"kind": grammar.kind, "text": grammar.text}
    setup = {**engine.describe(), **sampling, **environment()}
    return BenchReport(workload, results, costs, n_predict, repeat, engine.flash_attn, setup)


def _turn_prompt(
    engine: Engine, chat: ChatFormat | None, history: list[Message], turn: str
) -> list[int]:
    """A turn's tokens: a plain prompt as written; a question's turn as the user's next
    message after the conversation so far, in the target's chat format."""
    if chat is None:
        return engine.tokenize(turn)
    return engine.tokenize_messages([*history, Message("user", turn)], chat)


def _answer(model: Model, tokens: list[int]) -> Message:
    """The model's answer as the next turn's prompt holds it: its text, control tokens
    left out and the ends stripped, as Spec-Bench keeps an answer."""
    text = b"".join(model.piece(t) for t in tokens).decode(errors="replace")
    return Message("assistant", text.strip())


def _max_k(engine: Engine, variant: Variant) -> int:
    if variant.drafter is None:
        return 0
    k = parse_k(variant.k)
    chain = k if k is not None else engine.options.drafting.draft_max
    return max(chain, min(parse_tree(variant.tree) or 0, engine.tree_nodes))


def _generate(
    decoder: Decoder, prompt: list[int], n_predict: int, seed: int
) -> tuple[Stats, list[int]]:
    """A generation's figures and its tokens."""
    stats, tokens = Stats(), []
    for new in decoder.generate(prompt, n_predict, np.random.default_rng(seed), stats):
        tokens += new.tokens
    return stats, tokens
