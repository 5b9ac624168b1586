"""The prompt cache: slots' caches kept in host memory after other prompts displaced
them, loaded back for a prompt that starts the same way (llama-server's `--cache-ram`),
where a copy is priced below reading the tokens again."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from specdec_cli.llamacpp.llama import Context, common_prefix
from specdec_cli.llamacpp.sequencestate import SavedState


class PromptCache:
    """Slots' caches kept in host memory, as llama-server's prompt cache: what a slot
    held before another prompt took it is saved here, and a later prompt that starts
    the same way is loaded back into a slot instead of read again (the earlier turns of
    a chat, a system prompt, a prompt sent again). Least recently used first out, past
    `max_bytes`.

    A copy is not always cheaper than reading the tokens again. llama.cpp copies a
    state a run of adjacent cells at a time, and beside other slots a sequence gets a
    run each decode call (Context.runs): on a GPU, where each run is a transfer of its
    own (with flash attention off, one per row of a run), such a state can take longer
    to copy than to read (benchmarks/README.md). So the cache times its copies by the
    run, the scheduler the prompt tokens it reads, and a state is saved, or loaded, only
    where its runs are priced below reading its tokens again. Until a copy is timed,
    only states of at most FIRST_RUNS runs are copied, so that the first one timed is
    never a long one."""

    DECAY = 0.5  # weight of the older measurements in each rate
    FIRST_RUNS = 32

    def __init__(self, max_bytes: int, notify: Callable[[str], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self._saved: OrderedDict[tuple[int, ...], SavedState] = OrderedDict()
        self._bytes = 0
        self._notify = notify
        self.run_seconds: float | None = None  # a run of cells saved or loaded
        self.read_seconds: float | None = None  # a prompt token read
        self.skipped = 0  # copies left out as dearer than reading

    def best(self, prompt: list[int]) -> tuple[int, SavedState | None]:
        """The saved state that holds the longest start of `prompt`, and its length."""
        best: tuple[int, SavedState | None] = (0, None)
        for tokens, saved in self._saved.items():
            n = common_prefix(tokens, prompt)
            if n > best[0]:
                best = (n, saved)
        if best[1] is not None:
            self._saved.move_to_end(best[1].tokens)
        return best

    def pays(self, runs: int, n_tokens: int, copies: int = 1) -> bool:
        """Whether `copies` copies of a state of `runs` runs cost less than reading
        `n_tokens` tokens again (a state left out as dearer is counted, the first said)."""
        if self.run_seconds is None:
            return runs <= self.FIRST_RUNS
        if self.read_seconds is None or copies * runs * self.run_seconds <= (
            n_tokens * self.read_seconds
        ):
            return True
        if not self.skipped and self._notify is not None:
            self._notify(
                "the prompt cache leaves out states that cost more to copy than to read "
                f"again: {self.run_seconds * 1e3:.3f} ms a run of cells copied, "
                f"{self.read_seconds * 1e3:.3f} ms a prompt token read"
            )
        self.skipped += 1
        return False

    def save(self, target: Context) -> None:
        """Keep what `target` holds (unless it is held already, is too large, or costs
        more to save and load than to read again)."""
        tokens = tuple(target.tokens)
        if not tokens or tokens in self._saved or not self.pays(target.runs, len(tokens), 2):
            return
        # A saved prefix of it is no longer needed: this holds all that one did.
        for held in [t for t in self._saved if tokens[: len(t)] == t]:
            self._bytes -= self._saved.pop(held).nbytes
        start = time.perf_counter()
        try:
            saved = target.save_state()
        except RuntimeError:  # a cache is a help, never a reason to fail a request
            return
        self._copied(saved.runs, time.perf_counter() - start)
        if saved.nbytes > self.max_bytes:
            return
        self._saved[tokens] = saved
        self._bytes += saved.nbytes
        while self._bytes > self.max_bytes:
            self._bytes -= self._saved.popitem(last=False)[1].nbytes

    def load(self, target: Context, saved: SavedState) -> None:
        """Make `target` hold `saved` (RuntimeError: llama.cpp found no room for it)."""
        start = time.perf_counter()
        target.load_state(saved)
        self._copied(saved.runs, time.perf_counter() - start)

    def read(self, n_tokens: int, seconds: float) -> None:
        """A decode call that read `n_tokens` prompt tokens took `seconds` (all of it is
        counted: beside other slots the reading is the dearer for it, never cheaper)."""
        self.read_seconds = self._blend(self.read_seconds, seconds / n_tokens)

    def _copied(self, runs: int, seconds: float) -> None:
        self.run_seconds = self._blend(self.run_seconds, seconds / max(1, runs))

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else self.DECAY * old + (1 - self.DECAY) * new

    def __len__(self) -> int:
        return len(self._saved)
