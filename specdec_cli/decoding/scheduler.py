"""Slots: several generations at once, each in a slot of the shared target (and draft)
context, all advanced by the one decode loop (decode.step), one round per call.

The scheduler owns the slots: it places a new generation in the free slot whose cache
shares the longest start with its prompt (or loads it from the prompt cache), runs one step
for every busy slot, hands each round's pieces to whoever asked for them, and frees a
slot the moment its generation ends, is cancelled, or fails. It knows nothing of HTTP:
the server gives it tasks and hears back through their callbacks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec_cli.decoding.decode import step
from specdec_cli.decoding.generation import Generation
from specdec_cli.decoding.pieces import Piece, PieceStream
from specdec_cli.decoding.promptcache import PromptCache
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.llama import Context, common_prefix


@dataclass
class Task:
    """A generation in a slot, and where what it makes goes. `emit` hears every piece;
    `done` the end (its figures, and the error if it failed); `cancelled` is asked
    before every step."""

    generation: Generation
    pieces: PieceStream
    emit: Callable[[Piece], None]
    done: Callable[[Stats, Exception | None], None]
    cancelled: Callable[[], bool]
    request_id: str = ""


@dataclass
class Slot:
    index: int
    target: Context
    task: Task | None = None
    started: float = 0.0  # when its task began (time.time)


@dataclass
class Counters:
    """What the decode calls held, for /metrics (llama-server's names)."""

    decodes: int = 0  # decode calls made by the loop
    busy_slot_decodes: int = 0  # summed over those calls: the slots each one advanced
    decoded_tokens: int = 0  # summed: the tokens each one held


class BatchSpeculation:
    """Whether drafting pays at all for a batch of n busy slots, as measured.

    fit_to_batch prices drafts with the measured cost of verification, but a drafting
    slot costs more than that: its drafter's Python, its draft calls' fixed costs, a
    compute graph rebuilt whenever the batch changes size (a batch without drafts keeps
    its size), the server's threads beside the decode. Where verification is steep (a
    CPU) that can decide, and speculation must never make a loaded server slower. So
    for each number of busy slots, the tokens per second of both modes, drafts (fitted)
    and none (where drafts may be left out: -k auto, greedy or coupled), are running averages
    over blocks of BLOCK steps, and the better mode runs.

    Finding out costs what the worse mode loses, so it is asked sparingly:
    - no drafts are the first block at a new size (the mode that cannot lose to
      speculation off), and drafting gets its trial after that, unless it lost with
      fewer busy slots: a larger batch is only nearer compute-bound;
    - the worse mode gets a block again when that costs at most EXPLORE_BUDGET of the
      time since its last: after EXPLORE_EVERY blocks if it lost little, up to
      EXPLORE_MOST if it lost much (a change in the text or the load is seen by then).
      The budget is time, not blocks: a drafting step takes several no-draft steps'
      time, so a drafting block that loses costs that many times more;
    - a drafting block that drafted nothing (fit_to_batch cut every draft) counts as
      the worse mode, whatever its clock said: its steps were the same batches as
      without drafts, plus the policies' Python.
    A block's first step pays for the change of mode, and is not counted. One slot
    alone always drafts: its length policy already follows the clock."""

    BLOCK = 8
    EXPLORE_EVERY = 8  # blocks, at the least
    EXPLORE_MOST = 64  # blocks, at the most
    EXPLORE_BUDGET = 0.01  # of the time, lost to the worse mode's blocks
    DECAY = 0.9  # per step measured

    def __init__(self) -> None:
        self._by_size: dict[int, _Modes] = {}  # busy slots -> what was measured there

    def choose(self, n: int) -> bool:
        if n <= 1:
            return True
        modes = self._by_size.setdefault(n, _Modes())
        if modes.left <= 0:
            if modes.drafting:
                modes.idle = not modes.drafted
            modes.drafted = 0
            modes.drafting = self._next_mode(n, modes)
            modes.left = self.BLOCK
            modes.since_worse = 0 if modes.drafting == modes.worse else modes.since_worse + 1
        modes.left -= 1
        return modes.drafting

    def _next_mode(self, n: int, modes: _Modes) -> bool:
        if not modes.steps[False]:
            return False
        if not modes.steps[True] and not self._drafting_lost_below(n):
            return True
        return modes.worse if modes.since_worse >= self._explore_every(modes) else not modes.worse

    def _drafting_lost_below(self, n: int) -> bool:
        return any(m < n and modes.drafting_lost for m, modes in self._by_size.items())

    def _explore_every(self, modes: _Modes) -> int:
        """The better mode's blocks between two of the worse mode's: a worse block loses
        `loss` of its time, and takes `longer` times a better block's."""
        if not modes.steps[True]:
            return self.EXPLORE_MOST  # untried here: drafting lost with fewer slots
        worse, better = modes.worse, not modes.worse
        if modes.rate[better] <= 0 or modes.seconds[better] <= 0:
            return self.EXPLORE_EVERY
        loss = 1.0 - modes.rate[worse] / modes.rate[better]
        longer = modes.seconds[worse] / modes.seconds[better]
        wanted = math.ceil(loss * longer / self.EXPLORE_BUDGET)
        return min(self.EXPLORE_MOST, max(self.EXPLORE_EVERY, wanted))

    def record(self, n: int, drafting: bool, tokens: int, seconds: float, drafted: int) -> None:
        """A step of n busy slots in this mode: the tokens it made, its time, and the
        draft tokens it verified."""
        modes = self._by_size.get(n)
        if n <= 1 or seconds <= 0 or modes is None or modes.drafting != drafting:
            return
        modes.drafted += drafted
        if modes.left == self.BLOCK - 1:  # the block's first step: a change of mode
            return
        count = modes.steps[drafting]
        step = max(1.0 - self.DECAY, 1.0 / (count + 1))  # a plain mean at first
        modes.rate[drafting] += step * (tokens / seconds - modes.rate[drafting])
        modes.seconds[drafting] += step * (seconds - modes.seconds[drafting])
        modes.steps[drafting] = count + 1


@dataclass
class _Modes:
    """BatchSpeculation's figures for one number of busy slots. Mode True: drafting."""

    rate: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    seconds: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # a step
    steps: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    drafting: bool = True  # the current block's mode
    left: int = 0  # steps left in the current block
    since_worse: int = 0  # blocks since the worse mode's last
    drafted: int = 0  # draft tokens verified in the current block
    idle: bool = False  # the last drafting block drafted nothing

    @property
    def drafting_lost(self) -> bool:
        return bool(self.steps[True]) and self.rate[True] < self.rate[False]

    @property
    def worse(self) -> bool:
        """The mode measured slower (drafting, until it is measured, and while it drafts
        nothing)."""
        return self.drafting_lost or not self.steps[True] or self.idle


@dataclass
class Scheduler:
    """The slots of one target context, and the loop that advances them together.
    `chunk`: the most prompt tokens read in one decode call while other slots generate
    (their next tokens wait for it)."""

    targets: list[Context]
    chunk: int
    cache: PromptCache | None = None  # None: no prompt cache in host memory
    slots: list[Slot] = field(init=False)
    counters: Counters = field(default_factory=Counters)
    speculation: BatchSpeculation = field(default_factory=lambda: BatchSpeculation())

    def __post_init__(self) -> None:
        self.slots = [Slot(i, target) for i, target in enumerate(self.targets)]

    @property
    def busy(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.task]

    def free_slot(self, prompt: list[int]) -> Slot | None:
        """The free slot whose cache holds the longest start of `prompt`; among equals,
        the one with least cached (another prompt's cache is kept for its next turn),
        then the lowest numbered. None when every slot is busy."""
        free = [slot for slot in self.slots if slot.task is None]
        if not free:
            return None

        def fit(slot: Slot) -> tuple[int, int, int]:
            cached = slot.target.tokens
            return common_prefix(cached, prompt), -len(cached), -slot.index

        return max(free, key=fit)

    def claim(self, prompt: list[int]) -> Slot | None:
        """A free slot for `prompt` (see free_slot), holding as much of its start as
        this slot or the prompt cache has: what the slot held goes to the cache first,
        if the prompt will not keep all of it."""
        slot = self.free_slot(prompt)
        cache = self.cache
        if slot is None or cache is None or slot.target.recurrent:
            return slot
        own = common_prefix(slot.target.tokens, prompt)
        cached, saved = cache.best(prompt)
        if saved is not None and not (cached > own and cache.pays(saved.runs, cached - own)):
            saved = None  # its copy would not save its cost in reading
        if own < len(slot.target.tokens) or saved is not None:
            cache.save(slot.target)
        if saved is not None:
            try:
                cache.load(slot.target, saved)
            except RuntimeError:  # no room for it in the cells: the prompt is read instead
                slot.target.rewind(0)
        return slot

    def start(self, slot: Slot, task: Task) -> None:
        slot.task, slot.started = task, time.time()

    def step(self) -> None:
        """Cancelled tasks end; every other busy slot advances by one round (or one
        chunk of its prompt), all in one target decode call."""
        for slot in self.busy:
            assert slot.task is not None
            if slot.task.cancelled():
                self._cancel(slot)
        busy = self.busy
        if not busy:
            return
        generations = [slot.task.generation for slot in busy if slot.task]
        players = sum(not g.reading for g in generations)
        speculate = self.speculation.choose(players)
        cache = self.cache
        unread = sum(g.unread for g in generations) if cache else 0
        start = time.perf_counter()
        try:
            n_tokens = step(generations, self.chunk if players else None, speculate)
        except Exception as error:  # every slot of the call fails; the server goes on
            for slot in busy:
                self._end(slot, error)
            return
        seconds = time.perf_counter() - start
        read = unread - sum(g.unread for g in generations) if unread else 0
        if read and cache is not None:  # what reading a prompt token costs (see PromptCache)
            cache.read(read, seconds)
        if players == len(generations):  # a step that read prompts is no round's measure
            made = sum(len(g.round.tokens) for g in generations if g.round)
            drafted = sum(len(g.draft.tokens) for g in generations)
            self.speculation.record(players, speculate, made, seconds, drafted)
        self.counters.decodes += 1
        self.counters.busy_slot_decodes += len(busy)
        self.counters.decoded_tokens += n_tokens
        for slot in busy:
            assert slot.task is not None
            error = slot.task.generation.error  # its grammar's, its own (see decode.step)
            if error is not None:
                self._end(slot, error)
            else:
                self._deliver(slot)

    def _deliver(self, slot: Slot) -> None:
        """The slot's new pieces to its task; its end, if this round was its last."""
        task = slot.task
        assert task is not None
        generation = task.generation
        if generation.round is None:  # it read a chunk of its prompt
            return
        for piece in task.pieces.round(generation.round):
            task.emit(piece)
        if task.pieces.stopped:
            generation.stats.stop_reason = "stop"
            self._end(slot)
        elif generation.finished:
            task.emit(task.pieces.finish())
            self._end(slot)

    def _end(self, slot: Slot, error: Exception | None = None) -> None:
        task = slot.task
        assert task is not None
        slot.task = None
        task.generation.close()
        task.done(task.generation.stats, error)

    def _cancel(self, slot: Slot) -> None:
        assert slot.task is not None
        slot.task.generation.stats.stop_reason = "cancelled"
        self._end(slot)

    def stop_all(self) -> None:
        """End every task now (the server is stopping)."""
        for slot in self.busy:
            self._cancel(slot)

    def describe(self) -> list[dict[str, object]]:
        """Each slot as /slots shows it."""
        return [_describe(slot) for slot in self.slots]


def _describe(slot: Slot) -> dict[str, object]:
    described: dict[str, object] = {"id": slot.index, "n_ctx": slot.target.n_ctx}
    task = slot.task
    if task is None:
        idle = {"state": "idle", "is_processing": False, "n_cached": len(slot.target.tokens)}
        return described | idle
    g, stats = task.generation, task.generation.stats
    return described | {
        "state": "reading" if g.reading else "generating",
        "is_processing": True,
        "id_task": task.request_id,
        "started": slot.started,
        "n_prompt_tokens": stats.prompt_tokens,
        "n_cached": stats.prompt_reused,
        "n_decoded": stats.tokens,
        "n_predict": g.n_predict,
        "speculative": {
            "k": stats.k,
            "tree": stats.tree,
            "draft_n": stats.drafted,
            "draft_n_accepted": stats.accepted,
            "target_passes": stats.target_passes,
        },
    }
