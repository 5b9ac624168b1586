"""Slots: several generations in one decode loop, each exactly as it would be alone.

Every step verifies every busy slot's round (and reads a chunk of any prompt being
read) in one target decode call; each slot has its own sequences in the shared
contexts. On models whose logits do not depend on batch shape (F32), a generation's
text must not depend on what else runs beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from test_decode import COUPLED, PROMPT, SAMPLING, open_engine

from specdec_cli.decoding import scheduler as scheduler_module
from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.decode import Decoder, fit_to_batch, step
from specdec_cli.decoding.draft import TreeShape, propose
from specdec_cli.decoding.draftlength import AutoLength, FixedLength
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.generation import Generation, Plan
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.pieces import PieceStream
from specdec_cli.decoding.promptcache import PromptCache
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.scheduler import BatchSpeculation, Scheduler, Task
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.decoding.treeshape import AutoTree
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context

LONG_PROMPT = PROMPT + " and then" * 30  # read in several chunks below


@dataclass
class Job:
    decoder: Decoder
    prompt: list[int]
    n_predict: int = 40
    sampling: SamplingParams = GREEDY
    seed: int = 0
    start_at: int = 0  # the step it joins at


def run_together(jobs: list[Job], budget: int | None = None) -> list[list[int]]:
    """Every job's tokens, the jobs run side by side by the one loop (decode.step)."""
    outs: list[list[int]] = [[] for _ in jobs]
    running: dict[int, Generation] = {}
    steps = 0
    while steps == 0 or running or any(j.start_at >= steps for j in jobs):
        for i, job in enumerate(jobs):
            if job.start_at == steps:
                rng = np.random.default_rng(job.seed)
                running[i] = job.decoder.start(
                    job.prompt, job.n_predict, rng, Stats(), job.sampling
                )
        step(list(running.values()), budget)
        steps += 1
        for i, generation in list(running.items()):
            if generation.round:
                outs[i] += generation.round.tokens
            if generation.finished:
                generation.close()
                del running[i]
    return outs


def alone(target: Path, job: Job, draft: Path | None = None) -> list[int]:
    """The job's tokens with the target alone, in an engine of one slot."""
    with open_engine(target, None, sampling=job.sampling) as engine:
        stats, rng = Stats(), np.random.default_rng(job.seed)
        rounds = engine.decoder.generate(job.prompt, job.n_predict, rng, stats, job.sampling)
        return [t for r in rounds for t in r.tokens]


def parallel_engine(
    target: Path,
    draft: Path | None,
    parallel: int,
    k: int | str = 4,
    sampling: SamplingParams = GREEDY,
    tree: str = "auto",
    ngram_memory: int = 0,
) -> Engine:
    """An engine of `parallel` slots of 256 tokens each. Flash attention off: -fa auto's
    first runs each measure it (test_flash_attn tests that, in slots too), and the
    measurements' decode calls would count among the ones these tests count."""
    drafting = DraftOptions(k=str(k), tree=tree, ngram_memory=ngram_memory)
    options = EngineOptions(
        target, draft, n_ctx=256 * parallel, threads=1, parallel=parallel, flash_attn="off"
    )
    return Engine(replace(options, sampling=sampling, drafting=drafting))


@pytest.mark.parametrize("sampling", [GREEDY, COUPLED], ids=["greedy", "coupled"])
def test_slots_equal_each_generation_alone(
    target_model: Path, draft_model: Path, moderate_costs: None, sampling: SamplingParams
) -> None:
    """Four slots, four ways of drafting (model with lookup and a tree, a model chain at
    k=3, n-gram lookup, none), prompts that share a start, one read in chunks while the
    others generate, and one joining late: each text is the target's alone, greedy or
    coupled (whose -k auto drafts are fitted to the batch as greedy ones are)."""
    with parallel_engine(target_model, draft_model, 4, k="auto", tree="auto") as engine:
        short, long = engine.tokenize(PROMPT), engine.tokenize(LONG_PROMPT)
        other = engine.tokenize(PROMPT + " the little dog")
        jobs = [
            Job(engine.decoders[0], short),
            Job(engine.make_decoder("model", "3", "off", slot=1), other),
            Job(engine.make_decoder("ngram", "auto", "auto", slot=2), long, start_at=3),
            Job(engine.make_decoder(None, "auto", slot=3), short, n_predict=25, start_at=7),
        ]
        jobs = [replace(job, sampling=sampling, seed=i) for i, job in enumerate(jobs)]
        together = run_together(jobs, budget=16)
    for job, tokens in zip(jobs, together, strict=True):
        assert tokens == alone(target_model, job)


def test_a_seeded_sampled_generation_is_the_same_beside_others(
    target_model: Path, draft_model: Path, moderate_costs: None
) -> None:
    """Its draft lengths are its own policy's (never fitted to the batch, and untimed),
    so its random numbers go where they go alone; a greedy neighbour changes nothing,
    whether its prompt is cached or it starts in a call beside the neighbour's (where a
    greedy request would read its prompt's end as an undrafted first round)."""
    with parallel_engine(target_model, draft_model, 2, k="auto", sampling=SAMPLING) as engine:
        prompt = engine.tokenize(PROMPT)
        sampled = Job(engine.decoders[0], prompt, 48, SAMPLING, seed=7)
        first = run_together([sampled])[0]
        neighbour = Job(engine.decoders[1], engine.tokenize(LONG_PROMPT), 48)
        beside = run_together([replace(sampled), neighbour])[0]
        engine.slots[0].rewind(0)  # nothing cached: the prompt is read again
        joined = run_together([neighbour, replace(sampled, start_at=3)])[1]
        other_seed = run_together([replace(sampled, seed=8)])[0]
    assert beside == first
    assert joined == first
    assert other_seed != first  # the control: the seed does decide the text


def test_recurrent_slots_keep_their_own_state(mamba_pair: tuple[Path, Path]) -> None:
    """A recurrent model's state is one per sequence: each slot's rejected drafts are
    undone in its own state alone."""
    target, draft = mamba_pair
    with parallel_engine(target, draft, 2, k=3) as engine:
        jobs = [
            Job(engine.decoders[0], engine.tokenize(PROMPT)),
            Job(engine.decoders[1], engine.tokenize(PROMPT + " a cat"), start_at=2),
        ]
        together = run_together(jobs)
    for job, tokens in zip(jobs, together, strict=True):
        assert tokens == alone(target, job)


def plan(policy: AutoLength | FixedLength, k: int, fits: bool = True) -> Plan:
    return Plan(policy, None, k, 16, [1], fits)


def auto(costs: Costs, prior: float = 0.9) -> AutoLength:
    return AutoLength(costs, 0, 8, uses_confidence=False, prior=prior)


def test_fit_to_batch_shrinks_drafts_where_verification_is_compute_bound() -> None:
    flat = Costs(0.01, 0.01, {n: 1.0 + 0.02 * (n - 1) for n in range(1, 66)})
    steep = Costs(0.01, 0.01, {n: float(n) for n in range(1, 66)})
    kept = [plan(auto(flat), 4) for _ in range(4)]
    fit_to_batch(kept)
    assert [p.k for p in kept] == [4, 4, 4, 4]  # nearly free to verify: drafts stay
    shrunk = [plan(auto(steep), 4) for _ in range(4)]
    fit_to_batch(shrunk)
    assert [p.k for p in shrunk] == [0, 0, 0, 0]  # every token costs a pass: no drafts
    # -k N, and sampled generations (fits False), keep their length whatever it costs.
    fixed = [plan(FixedLength(4), 4, fits=False), plan(auto(steep), 4, fits=False)]
    fit_to_batch(fixed)
    assert [p.k for p in fixed] == [4, 4]


def test_fit_to_batch_counts_the_other_slots_tokens() -> None:
    """Verification flat up to 8 tokens, then each token a whole pass. Alone, a 4-token
    draft rides free; beside 7 slots that fill the flat part, it would cost 4 passes."""
    knee = Costs(0.01, 0.01, {n: max(1.0, n - 7.0) for n in range(1, 66)})
    single = [plan(auto(knee), 4)]
    fit_to_batch(single)
    assert single[0].k == 4
    others = [plan(FixedLength(0), 0, fits=False) for _ in range(7)]
    crowded = [plan(auto(knee), 4), *others]
    fit_to_batch(crowded)
    assert crowded[0].k == 0


def test_fit_to_batch_prices_every_total_on_a_stepped_curve() -> None:
    """A curve with a step, as measured on the benchmark pair: 4 tokens cost 1.28
    passes, the 5th adds 0.47, each further one 0.24. Four slots at 80 % acceptance
    rate best drafting nothing (4 / 1.28 tokens a pass); one token each (6.8 / 2.46) beats
    every total between, where shortening a token at a time would stop."""
    curve = {1: 1.0, 2: 1.01, 3: 1.2, 4: 1.28, **{n: 1.75 + 0.24 * (n - 5) for n in range(5, 66)}}
    stepped = Costs(0.01, 0.05, curve)
    plans = [plan(auto(stepped, 0.8), 3) for _ in range(4)]
    fit_to_batch(plans)
    assert [p.k for p in plans] == [0, 0, 0, 0]


def test_fit_to_batch_keeps_the_drafts_that_pay_most() -> None:
    """Each verified token costs 0.3 of a pass: a slot whose drafts are nearly always
    taken keeps its 4, one that is rarely right drafts none."""
    linear = Costs(0.01, 0.05, {n: 1.0 + 0.3 * (n - 1) for n in range(1, 66)})
    plans = [plan(auto(linear, prior), 4) for prior in (0.95, 0.3)]
    fit_to_batch(plans)
    assert [p.k for p in plans] == [4, 0]


def test_fit_to_batch_leaves_a_prompts_cost_out() -> None:
    """Each verified token costs a quarter pass. Four slots drafting at 90 % keep two
    tokens each; beside a 40-token prompt read in the same call they keep none: the
    prompt is paid whatever is drafted, and past it a token costs a quarter pass where
    the slots' own four tokens ride for one pass together. Counted in the call's rate,
    the prompt's cost made every draft look worth it."""
    linear = Costs(0.01, 0.05, {n: 1.0 + 0.25 * (n - 1) for n in range(1, 66)})
    for extra, kept in ((0, [2, 2, 2, 2]), (40, [0, 0, 0, 0])):
        plans = [plan(auto(linear), 4) for _ in range(4)]
        fit_to_batch(plans, extra)
        assert [p.k for p in plans] == kept
    # A slot that starts in the call: its prompt's end is paid as a reader's is.
    starting = replace(plan(FixedLength(0), 0, fits=False), unseen=[1] * 41, prompt=40)
    plans = [plan(auto(linear), 4) for _ in range(3)]
    fit_to_batch([*plans, starting])
    assert [p.k for p in plans] == [0, 0, 0]


def test_fit_to_batch_counts_one_draft_call_a_depth_for_all_slots() -> None:
    """The slots draft together: four drafts of 4 tokens cost 4 draft calls, not 16.
    With a draft call at 0.3 of a target pass and verification nearly free, drafting
    pays; priced as 16 calls, it would be shortened."""
    costly_draft = Costs(0.01, 0.3, {n: 1.0 + 0.02 * (n - 1) for n in range(1, 66)})
    plans = [plan(auto(costly_draft), 4) for _ in range(4)]
    fit_to_batch(plans)
    assert [p.k for p in plans] == [4, 4, 4, 4]


def test_slots_draft_in_one_call_a_depth(
    target_model: Path, draft_model: Path, moderate_costs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two slots drafting with the draft model (a chain, and a tree) share its decode
    calls, as their verifications share the target's; each text is still its own."""
    draft_calls: list[int] = []
    flush = Context.flush

    def counted(ctx: Context) -> int:
        n = flush(ctx)
        if n and ctx.model.path == draft_model:
            draft_calls.append(n)
        return n

    monkeypatch.setattr(Context, "flush", counted)
    with parallel_engine(target_model, draft_model, 2, k=3) as engine:
        jobs = [
            Job(engine.make_decoder("model", "3", "off", slot=0), engine.tokenize(PROMPT)),
            Job(engine.make_decoder("model", "3", "4", slot=1), engine.tokenize(LONG_PROMPT)),
        ]
        together = run_together(jobs)
        taken_part = sum(ctx.decode_calls for ctx in engine.draft_slots if ctx)
    # Each slot counts the calls it took part in; shared calls are counted by both.
    assert len(draft_calls) < 0.75 * taken_part
    for job, tokens in zip(jobs, together, strict=True):
        assert tokens == alone(target_model, job)


def test_a_prompt_that_ends_beside_other_slots_starts_in_that_call(
    target_model: Path, draft_model: Path, moderate_costs: None
) -> None:
    """A slot whose prompt's end fits in the step reads it as the start of its first
    round: its first token comes in the call that reads it, undrafted (its drafter reads
    the prompt after that call), the prompt is not counted as verified, and the text,
    drafted from the next round on, is still the target's alone. A prompt longer than
    the step's budget reads a chunk first (the control)."""
    with parallel_engine(target_model, draft_model, 3, k=3) as engine:
        prompts = [engine.tokenize(p) for p in (PROMPT, PROMPT + " the little dog", LONG_PROMPT)]
        decoders = [engine.make_decoder("model", "3", "4", slot=slot) for slot in range(3)]
        rng = np.random.default_rng(0)
        first = decoders[0].start(prompts[0], 40, rng, Stats())
        step([first])  # reads its prompt
        step([first], budget=16)  # its first round: it generates from now on
        joining, reading = (decoders[i].start(prompts[i], 40, rng, Stats()) for i in (1, 2))
        step([first, joining, reading], budget=16)
        assert joining.round is not None and reading.round is None
        assert len(joining.round.tokens) == 1 and joining.stats.target_passes == 1
        assert joining.stats.batch_sizes == {1: 1} and joining.stats.prompt_seconds > 0
        tokens = list(joining.round.tokens)
        while not joining.finished:
            step([joining])
            tokens += joining.round.tokens if joining.round else []
        assert joining.stats.drafted > 0
        assert max(joining.stats.batch_sizes) <= 4 + 1  # a tree of 4 and its root's token
    assert tokens == alone(target_model, Job(decoders[1], prompts[1]))


def test_a_draft_reads_its_own_row_after_other_slots_drafted(
    target_model: Path, draft_model: Path
) -> None:
    """A round whose tokens the draft's cache already holds (a translated text cut
    mid-character does not grow) evaluates its last token again: the rows of its last
    decode call are another slot's by now."""
    with parallel_engine(target_model, draft_model, 2) as engine:
        mine, other = (ModelDrafter(ctx, GREEDY) for ctx in engine.draft_slots if ctx)
        tokens, others = engine.tokenize(PROMPT), engine.tokenize(LONG_PROMPT)
        mine.begin(tokens)
        other.begin(others)
        rng = np.random.default_rng(0)
        first = propose(mine, tokens, 3, rng)
        propose(other, others, 3, rng)
        again = propose(mine, tokens, 3, rng)
    assert again.tokens == first.tokens


def test_a_slots_tree_is_shaped_beside_the_others(
    target_model: Path, draft_model: Path, moderate_costs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round's tree policy hears what the other slots put in the same target call:
    the other's chain (its unseen token and 3 drafts) while both run, nothing alone."""
    besides: list[int] = []
    shape = AutoTree.shape

    def recorded(self: AutoTree, k: int, limit: int, beside: int = 0) -> TreeShape | None:
        besides.append(beside)
        return shape(self, k, limit, beside)

    monkeypatch.setattr(AutoTree, "shape", recorded)
    with parallel_engine(target_model, draft_model, 2) as engine:
        prompts = [engine.tokenize(PROMPT), engine.tokenize(PROMPT + " the little dog")]
        jobs = [
            Job(engine.make_decoder("model", "3", "auto", slot=slot), prompt, n)
            for slot, (prompt, n) in enumerate(zip(prompts, (40, 12), strict=True))
        ]
        run_together(jobs)
    assert 4 in besides and besides[-1] == 0


def sent_again(target: Path, memory: int) -> tuple[list[int], list[int], Stats]:
    """A greedy prompt in one slot, then another, then the first again in the other
    slot, n-gram drafting: the first text, the repeat's text, and the repeat's figures."""
    with parallel_engine(target, None, 2, k=8, ngram_memory=memory) as engine:
        prompt = engine.tokenize(PROMPT)
        lookups = [engine.make_decoder("ngram", "8", "off", slot=slot) for slot in (0, 1)]
        first = run_together([Job(lookups[0], prompt, 48)])[0]
        # The first slot's text is handed over when its lookup begins again.
        run_together([Job(lookups[0], engine.tokenize(LONG_PROMPT), 4)])
        stats = Stats()
        generation = lookups[1].start(prompt, 48, np.random.default_rng(0), stats)
        again: list[int] = []
        while not generation.finished:
            step([generation])
            again += generation.round.tokens if generation.round else []
    return first, again, stats


def test_a_prompt_sent_again_finds_the_earlier_text_in_another_slot(target_model: Path) -> None:
    """With a memory of recent texts (as `serve` has), a greedy request whose prompt an
    earlier request in another slot sent has that request's text drafted; its text is
    still the target's alone. Without the memory, its own text offers far less."""
    first, again, stats = sent_again(target_model, 4096)
    assert again == first
    _, alone_again, without = sent_again(target_model, 0)
    assert alone_again == first
    assert stats.accepted >= 30 and stats.accepted >= 2 * without.accepted


def make_task(engine: Engine, slot: int, prompt: list[int], log: list[str]) -> Task:
    decoder = engine.decoders[slot]
    generation = decoder.start(prompt, 8, np.random.default_rng(0), Stats())
    return Task(
        generation,
        PieceStream(engine.model),
        lambda piece: None,
        lambda stats, error: log.append(f"{slot}:{stats.stop_reason}:{error is not None}"),
        lambda: False,
    )


def test_scheduler_places_by_shared_prefix_and_frees_slots(target_model: Path) -> None:
    with parallel_engine(target_model, None, 3) as engine:
        scheduler = Scheduler(engine.slots, chunk=64)
        log: list[str] = []
        prompt = engine.tokenize(LONG_PROMPT)
        slot = scheduler.free_slot(prompt)
        assert slot is not None and slot.index == 0  # all empty: the first
        scheduler.start(slot, make_task(engine, 0, prompt, log))
        while scheduler.busy:
            scheduler.step()
        assert log == ["0:length:False"]
        # Slot 0 now holds the prompt: a request that shares it goes there, others first-free.
        assert scheduler.free_slot([*prompt[:-2], 99]).index == 0  # type: ignore[union-attr]
        assert scheduler.free_slot([99, 98]).index == 1  # type: ignore[union-attr]
        described = scheduler.describe()
        assert [d["state"] for d in described] == ["idle"] * 3
        assert described[0]["n_cached"] >= len(prompt)


def test_a_failed_decode_ends_every_slot_of_it_and_the_loop_goes_on(
    target_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with parallel_engine(target_model, None, 2) as engine:
        scheduler = Scheduler(engine.slots, chunk=64)
        log: list[str] = []
        prompt = engine.tokenize(PROMPT)
        for i in range(2):
            scheduler.start(scheduler.slots[i], make_task(engine, i, prompt, log))

        def broken(*args: object, **kwargs: object) -> int:
            raise RuntimeError("llama_decode failed")

        monkeypatch.setattr(scheduler_module, "step", broken)
        scheduler.step()
        assert sorted(log) == ["0::True", "1::True"] and not scheduler.busy
        monkeypatch.undo()
        scheduler.start(scheduler.slots[1], make_task(engine, 1, prompt, log))
        while scheduler.busy:
            scheduler.step()
        assert log[-1] == "1:length:False"


def test_batch_speculation_follows_what_is_measured() -> None:
    """Drafting measured slower at 4 busy slots: it stops there but for a block every
    EXPLORE_EVERY blocks; at 2 slots, measured faster, it goes on; alone, always. A
    block's first step (a change of mode, a rebuilt graph) does not count."""
    guard = BatchSpeculation()
    modes: dict[int, list[bool]] = {2: [], 4: []}
    for _ in range(640):
        for n, faster in ((2, True), (4, False)):
            drafting = guard.choose(n)
            modes[n].append(drafting)
            tokens = 12 if drafting == faster else 8
            guard.record(n, drafting, tokens, 0.01, 4 if drafting else 0)
    block, every = BatchSpeculation.BLOCK, BatchSpeculation.EXPLORE_EVERY
    late4, late2 = modes[4][4 * block :], modes[2][4 * block :]
    assert 0 < sum(late4) <= len(late4) / every + block
    assert sum(late2) >= len(late2) * (1 - 1 / every) - block
    assert all(len(set(late4[i : i + block])) == 1 for i in range(0, len(late4), block))
    assert guard.choose(1)


def run_guard(
    guard: BatchSpeculation,
    n: int,
    steps: int,
    loss: float,
    longer: float = 1.0,
    drafted: int = 4,
) -> tuple[list[bool], float]:
    """`steps` choices at n busy slots, drafting measured `loss` slower than none, in
    steps `longer` times as long that verify `drafted` draft tokens: the modes chosen,
    and the share of the time spent drafting."""
    modes, seconds = [], {True: 0.0, False: 0.0}
    for _ in range(steps):
        drafting = guard.choose(n)
        modes.append(drafting)
        tokens, took = (100 * longer * (1.0 - loss), 0.01 * longer) if drafting else (100, 0.01)
        guard.record(n, drafting, round(tokens), took, drafted if drafting else 0)
        seconds[drafting] += took
    return modes, seconds[True] / (seconds[True] + seconds[False])


def test_batch_speculation_finds_out_sparingly() -> None:
    """A new size starts without drafts; the worse mode's blocks come back the rarer
    the more it loses; and drafting that lost with 2 slots is not tried with 4 until
    EXPLORE_MOST blocks have passed."""
    block, most = BatchSpeculation.BLOCK, BatchSpeculation.EXPLORE_MOST
    explored = {}
    for loss in (0.04, 0.3):
        guard = BatchSpeculation()
        modes, _ = run_guard(guard, 2, 200 * block, loss)
        assert not any(modes[:block]) and all(modes[block : 2 * block])
        explored[loss] = sum(modes[2 * block :]) / len(modes[2 * block :])
    assert explored[0.3] < explored[0.04] <= 1.1 / BatchSpeculation.EXPLORE_EVERY
    assert explored[0.3] * 0.3 <= 1.1 * BatchSpeculation.EXPLORE_BUDGET  # the time it costs
    # Drafting lost with 2 slots (the last guard): with 4, no trial block, only exploring.
    four, _ = run_guard(guard, 4, (most + 2) * block, 0.3)
    assert not any(four[: most * block]) and any(four)


def test_batch_speculation_leaves_drafting_that_drafts_nothing() -> None:
    """Where fit_to_batch cuts every draft, drafting blocks are the same batches plus
    the policies' Python: measured 2 % faster by chance, they are still the worse mode,
    run once in EXPLORE_EVERY blocks (to see whether the text has turned easy)."""
    block, every = BatchSpeculation.BLOCK, BatchSpeculation.EXPLORE_EVERY
    modes, _ = run_guard(BatchSpeculation(), 4, 200 * block, -0.02, drafted=0)
    late = modes[2 * block :]
    assert sum(late) <= len(late) / every + block
    drafting, _ = run_guard(BatchSpeculation(), 4, 200 * block, -0.02)
    assert sum(drafting[2 * block :]) >= len(late) * (1 - 1 / every) - block  # the control


def test_batch_speculation_budgets_time_not_blocks() -> None:
    """A drafting step takes several no-draft steps' time: where drafting loses, its
    blocks come back as much rarer, so that they cost EXPLORE_BUDGET of the time."""
    block = BatchSpeculation.BLOCK
    for longer in (1.0, 3.0):
        _, drafting_share = run_guard(BatchSpeculation(), 2, 400 * block, 0.1, longer)
        assert drafting_share * 0.1 <= 1.1 * BatchSpeculation.EXPLORE_BUDGET


@pytest.mark.parametrize("sampling", [GREEDY, COUPLED], ids=["greedy", "coupled"])
def test_a_step_without_speculation_drops_only_the_drafts_it_may(
    target_model: Path, draft_model: Path, moderate_costs: None, sampling: SamplingParams
) -> None:
    """speculate=False: greedy or coupled -k auto slots draft nothing, a -k 3 slot
    still does, and every text is still the target's alone."""
    with parallel_engine(target_model, draft_model, 2, k="auto", tree="off") as engine:
        prompt = engine.tokenize(PROMPT)
        rng = np.random.default_rng
        auto = engine.decoders[0].start(prompt, 24, rng(0), Stats(), sampling)
        fixed_decoder = engine.make_decoder("model", "3", "off", slot=1)
        # Longer: the auto slot must never run alone (a slot alone drafts as it likes).
        fixed = fixed_decoder.start(prompt, 120, rng(0), Stats(), sampling)
        outs: list[list[int]] = [[], []]
        while not (auto.finished and fixed.finished):
            running = [g for g in (auto, fixed) if not g.finished]
            step(running, speculate=False)
            for i, g in enumerate((auto, fixed)):
                if g in running and g.round:
                    outs[i] += g.round.tokens
        assert auto.stats.drafted == 0 and fixed.stats.drafted > 0
    reference = alone(target_model, Job(engine.decoders[0], prompt, 120, sampling))
    assert outs == [reference[:24], reference]


def test_a_verbatim_repeat_drafts_in_a_step_without_speculation(target_model: Path) -> None:
    """A text that repeats itself verbatim (a block of the prompt given twice) drafts
    even in steps without speculation: such drafts are taken nearly whole. Its text is
    still the target's alone."""
    with parallel_engine(target_model, None, 2, k="auto", tree="off") as engine:
        block = list(range(300, 330))  # 30 tokens that occur nowhere else
        prompt = engine.tokenize(PROMPT) + block + block
        lookup = engine.make_decoder("ngram", "auto", "off", slot=0)
        other = engine.make_decoder(None, "auto", slot=1)
        beside = other.start(engine.tokenize(PROMPT), 40, np.random.default_rng(0), Stats())
        # The same request again: its prompt is in the slot's cache, so its first round
        # is a round of its own, which the repeat drafts (a prompt read in the call
        # starts with an undrafted round: see decode._joining).
        for _ in lookup.generate(prompt, 1, np.random.default_rng(0), Stats()):
            pass
        repeating = lookup.start(prompt, 8, np.random.default_rng(0), Stats())
        assert not repeating.reading
        out: list[int] = []
        while not repeating.finished:
            step([repeating, beside], speculate=False)
            out += repeating.round.tokens if repeating.round else []
        assert repeating.stats.drafted > 0
    assert out == alone(target_model, Job(lookup, prompt, 8))


def drop_second_slot(engine: Engine) -> None:
    """One slot of a context made for two: still a split context. The decoders are made
    before, one a slot, as the engine makes them at first use."""
    assert len(engine.decoders) == 2
    engine.slots.pop()


def run_in(scheduler: Scheduler, engine: Engine, prompt: list[int]) -> tuple[list[int], Stats]:
    """One greedy generation through `scheduler.claim`: its tokens and figures."""
    slot = scheduler.claim(prompt)
    assert slot is not None
    stats, out = Stats(), []
    generation = engine.decoders[slot.index].start(prompt, 12, np.random.default_rng(0), stats)
    task = Task(generation, PieceStream(engine.model), lambda piece: None, lambda s, e: None, bool)
    scheduler.start(slot, task)
    while scheduler.busy:
        scheduler.step()
        if generation.round:
            out += generation.round.tokens
    return out, stats


@pytest.mark.parametrize("cached", [True, False])
def test_the_prompt_cache_brings_a_displaced_prompt_back(target_model: Path, cached: bool) -> None:
    """One slot: A, then B (A's cells displaced), then A again. With the cache, A's cells
    come back from host memory (all but its last token reused); without, A is read again.
    Either way the text is A's alone."""
    with parallel_engine(target_model, None, 2) as engine:
        drop_second_slot(engine)
        cache = PromptCache(2**30) if cached else None
        scheduler = Scheduler(engine.slots, chunk=64, cache=cache)
        a, b = engine.tokenize(LONG_PROMPT), engine.tokenize("Zebras run")
        first, _ = run_in(scheduler, engine, a)
        run_in(scheduler, engine, b)
        again, stats = run_in(scheduler, engine, a)
    assert again == first == alone(target_model, Job(engine.decoders[0], a, 12))
    if cached:
        assert stats.prompt_reused == len(a) - 1 and cache is not None and len(cache) == 2
    else:
        assert stats.prompt_reused <= 1  # BOS at most


def test_the_prompt_cache_keeps_to_its_budget(target_model: Path) -> None:
    with parallel_engine(target_model, None, 2) as engine:
        slot = engine.slots[0]
        slot.prefill(engine.tokenize(LONG_PROMPT))
        size = slot.save_state().nbytes
        cache = PromptCache(int(size * 1.5))
        cache.save(slot)
        other = engine.tokenize("Zebras" + " and then" * 30)
        slot.prefill(other)
        cache.save(slot)  # over budget together: the older one goes
        assert len(cache) == 1
        assert cache.best(other)[0] == len(other)
        assert cache.best(engine.tokenize(LONG_PROMPT))[0] <= 1  # BOS at most


@pytest.mark.parametrize("slow", ["copies", "reads"])
def test_the_prompt_cache_copies_only_while_a_copy_is_cheaper_than_a_read(
    target_model: Path, monkeypatch: pytest.MonkeyPatch, slow: str
) -> None:
    """On a GPU a state copies a run of cells at a time, each run a transfer: where a
    copy is timed dearer than reading its tokens again, the cache must leave states out
    (A is read again, and B is not saved). Where reads are the dearer (this CPU's real
    models), it copies."""
    messages: list[str] = []
    with parallel_engine(target_model, None, 2) as engine:
        drop_second_slot(engine)
        cache = PromptCache(2**30, messages.append)
        scheduler = Scheduler(engine.slots, chunk=64, cache=cache)
        a, b = engine.tokenize(LONG_PROMPT), engine.tokenize("Zebras run")
        first, _ = run_in(scheduler, engine, a)
        if slow == "copies":
            # Far dearer than reading the prompt again, however slow the reads run
            # (0.05 s was within reach once, in a full run with flash attention off).
            slowed, pause = Context.save_state, 0.2
        else:
            slowed, pause = Context.flush, 0.01

        def slower(*args: object) -> object:
            time.sleep(pause)
            return slowed(*args)

        monkeypatch.setattr(Context, slowed.__name__, slower)
        run_in(scheduler, engine, b)  # A's cells displaced: saved, and the copy timed
        again, stats = run_in(scheduler, engine, a)
    assert again == first
    if slow == "copies":
        assert cache.skipped == 2 and stats.prompt_reused <= 1 and len(cache) == 1
        assert len(messages) == 1 and "cost more to copy than to read" in messages[0]
    else:
        assert cache.skipped == 0 and stats.prompt_reused == len(a) - 1 and len(cache) == 2
        assert not messages


def test_a_sequence_beside_other_slots_holds_a_run_of_cells_a_call(target_model: Path) -> None:
    """llama.cpp copies a state a run of adjacent cells at a time; each decode call
    shared with other slots starts a run, calls alone extend one."""
    with parallel_engine(target_model, None, 2) as engine:
        a, b = engine.slots
        a.prefill(engine.tokenize(LONG_PROMPT))  # read alone, in chunks
        for token in range(5):
            a.decode([token], len(a.tokens))
        assert a.runs == 1
        for token in range(6):
            a.stage([token])
            b.stage([token])
            a.flush()
        assert a.runs == b.runs + 1 == 7
        a.rewind(len(a.tokens) - 1)
        a.decode([9], len(a.tokens))  # after a rewind, no longer beside its last run
        assert a.runs == 8 and a.save_state().runs == 8
        a.rewind(0)
        assert a.runs == 0


def test_the_prompt_cache_prices_a_copy_by_its_runs() -> None:
    cache = PromptCache(2**30)
    # Until a copy is timed, only states of few runs are copied (to time one).
    assert cache.pays(PromptCache.FIRST_RUNS, 1)
    assert not cache.pays(PromptCache.FIRST_RUNS + 1, 10**6)
    cache.run_seconds, cache.read_seconds = 1e-3, 1e-4  # a run copied, a token read
    assert cache.pays(1, 100, copies=2) and cache.pays(100, 1000)
    assert not cache.pays(64, 100) and not cache.pays(6, 100, copies=2)
    assert cache.skipped == 2


def test_a_prompt_cache_that_cannot_load_reads_the_prompt_instead(
    target_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp may refuse a saved state (no free cells): the request must still run,
    reading its prompt, and not take the decode loop down with it."""
    with parallel_engine(target_model, None, 2) as engine:
        drop_second_slot(engine)
        scheduler = Scheduler(engine.slots, chunk=64, cache=PromptCache(2**30))
        a, b = engine.tokenize(LONG_PROMPT), engine.tokenize("Zebras run")
        first, _ = run_in(scheduler, engine, a)
        run_in(scheduler, engine, b)

        def refused(self: object, saved: object) -> None:
            raise RuntimeError("llama.cpp could not load a sequence")

        monkeypatch.setattr(Context, "load_state", refused)
        again, stats = run_in(scheduler, engine, a)
    assert again == first and stats.prompt_reused <= 1


def test_more_slots_than_a_batch_has_rows_are_refused(target_model: Path) -> None:
    """-np 8 -b 4: one line before anything loads (splitting the target into slots ended
    in a traceback)."""
    options = EngineOptions(target_model, None, n_ctx=256 * 8, n_batch=4, threads=1, parallel=8)
    with pytest.raises(UserError, match="-np 8 is more slots than -b 4 has rows"):
        Engine(options)
