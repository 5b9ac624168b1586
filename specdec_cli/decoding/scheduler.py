"""Slots: several generations at once, each in a slot of the shared target (and draft)
context, all advanced by the one decode loop (decode.step), one round per call.

The scheduler owns the slots: it places a new generation in the free slot whose cache
shares the longest start with its prompt (llama-server's prompt cache), runs one step
for every busy slot, hands each round's pieces to whoever asked for them, and frees a
slot the moment its generation ends, is cancelled, or fails. It knows nothing of HTTP:
the server gives it tasks and hears back through their callbacks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec_cli.decoding.decode import Generation, step
from specdec_cli.decoding.pieces import Piece, PieceStream
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.llama import Context, SavedState


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
    and none (where drafts may be left out: greedy -k auto), are running averages
    over blocks of BLOCK steps; the better mode runs, the other gets a block every
    EXPLORE_EVERY blocks, so that a change (in the text, in the load) is seen. A
    block's first step pays for the change of mode, and is not counted. One slot alone
    always drafts: its length policy already follows the clock."""

    BLOCK = 8
    EXPLORE_EVERY = 8  # blocks
    DECAY = 0.9  # per step measured

    def __init__(self) -> None:
        self._rates: dict[int, dict[bool, tuple[float, int]]] = {}  # n -> mode -> (rate, steps)
        self._mode: dict[int, bool] = {}  # n -> the current block's mode (True: drafting)
        self._left: dict[int, int] = {}  # n -> steps left in the current block
        self._blocks: dict[int, int] = {}  # n -> blocks run

    def choose(self, n: int) -> bool:
        if n <= 1:
            return True
        if self._left.get(n, 0) <= 0:
            self._mode[n] = self._next_mode(n)
            self._left[n] = self.BLOCK
            self._blocks[n] = self._blocks.get(n, 0) + 1
        self._left[n] -= 1
        return self._mode[n]

    def _next_mode(self, n: int) -> bool:
        rates = self._rates.setdefault(n, {True: (0.0, 0), False: (0.0, 0)})
        untried = [mode for mode in (True, False) if rates[mode][1] == 0]
        if untried:
            return untried[0]
        better = rates[True][0] >= rates[False][0]
        explore = self._blocks.get(n, 0) % self.EXPLORE_EVERY == 0
        return (not better) if explore else better

    def record(self, n: int, drafting: bool, tokens: int, seconds: float) -> None:
        if n <= 1 or seconds <= 0 or self._mode.get(n) != drafting:
            return
        if self._left[n] == self.BLOCK - 1:  # the block's first step: a change of mode
            return
        rate, count = self._rates[n][drafting]
        step = max(1.0 - self.DECAY, 1.0 / (count + 1))  # a plain mean at first
        self._rates[n][drafting] = (rate + step * (tokens / seconds - rate), count + 1)


class PromptCache:
    """Slots' caches kept in host memory, as llama-server's prompt cache: what a slot
    held before another prompt took it is saved here, and a later prompt that starts
    the same way is loaded back into a slot instead of read again (the earlier turns of
    a chat, a system prompt, a prompt sent again). Least recently used first out, past
    `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._saved: OrderedDict[tuple[int, ...], SavedState] = OrderedDict()
        self._bytes = 0

    def best(self, prompt: list[int]) -> tuple[int, SavedState | None]:
        """The saved state that holds the longest start of `prompt`, and its length."""
        best: tuple[int, SavedState | None] = (0, None)
        for tokens, saved in self._saved.items():
            n = _common_prefix(tokens, prompt)
            if n > best[0]:
                best = (n, saved)
        if best[1] is not None:
            self._saved.move_to_end(best[1].tokens)
        return best

    def save(self, target: Context) -> None:
        """Keep what `target` holds (unless it is held already, or is too large)."""
        tokens = tuple(target.tokens)
        if not tokens or tokens in self._saved:
            return
        # A saved prefix of it is no longer needed: this holds all that one did.
        for held in [t for t in self._saved if tokens[: len(t)] == t]:
            self._bytes -= self._saved.pop(held).nbytes
        try:
            saved = target.save_state()
        except RuntimeError:  # a cache is a help, never a reason to fail a request
            return
        if saved.nbytes > self.max_bytes:
            return
        self._saved[tokens] = saved
        self._bytes += saved.nbytes
        while self._bytes > self.max_bytes:
            self._bytes -= self._saved.popitem(last=False)[1].nbytes

    def __len__(self) -> int:
        return len(self._saved)


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
            return _common_prefix(cached, prompt), -len(cached), -slot.index

        return max(free, key=fit)

    def claim(self, prompt: list[int]) -> Slot | None:
        """A free slot for `prompt` (see free_slot), holding as much of its start as
        this slot or the prompt cache has: what the slot held goes to the cache first,
        if the prompt will not keep all of it."""
        slot = self.free_slot(prompt)
        if slot is None or self.cache is None or slot.target.recurrent:
            return slot
        own = _common_prefix(slot.target.tokens, prompt)
        cached, saved = self.cache.best(prompt)
        if own < len(slot.target.tokens) or (saved is not None and cached > own):
            self.cache.save(slot.target)
        if saved is not None and cached > own:
            try:
                slot.target.load_state(saved)
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
                slot.task.generation.stats.stop_reason = "cancelled"
                self._end(slot)
        busy = self.busy
        if not busy:
            return
        generations = [slot.task.generation for slot in busy if slot.task]
        players = sum(not g.reading for g in generations)
        speculate = self.speculation.choose(players)
        start = time.perf_counter()
        try:
            n_tokens = step(generations, self.chunk if players else None, speculate)
        except Exception as error:  # every slot of the call fails; the server goes on
            for slot in busy:
                self._end(slot, error)
            return
        if players == len(generations):  # a step that read prompts is no round's measure
            made = sum(len(g.round.tokens) for g in generations if g.round)
            self.speculation.record(players, speculate, made, time.perf_counter() - start)
        self.counters.decodes += 1
        self.counters.busy_slot_decodes += len(busy)
        self.counters.decoded_tokens += n_tokens
        for slot in busy:
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

    def stop_all(self) -> None:
        """End every task now (the server is stopping)."""
        for slot in self.busy:
            assert slot.task is not None
            slot.task.generation.stats.stop_reason = "cancelled"
            self._end(slot)

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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
