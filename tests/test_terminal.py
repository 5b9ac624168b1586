"""specdec as a person at a terminal sees it: stderr on a pseudo-terminal (live stats,
progress), stdout redirected or not, and Ctrl-C (SIGINT) at chosen moments."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from test_cli_run import GREEDY, specdec

from specdec_cli.commands.display import stats_line
from specdec_cli.decoding.stats import FlashAttnChoice, Stats


class Terminal:
    """A pseudo-terminal of `columns` columns; `transcript` is all that was written to it."""

    def __init__(self, columns: int = 100) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # the last writer closed its end
                return
            if not data:
                return
            self._chunks.append(data)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def close(self) -> str:
        """Close our end of the terminal; return the transcript."""
        os.close(self.slave)
        self._reader.join(timeout=10)
        os.close(self.master)
        return self.text()


def spawn(args: list[str], terminal: Terminal, stdout: object, **kwargs) -> subprocess.Popen:
    """specdec (or python -c, with args starting "-c") with stderr on `terminal`."""
    command = args if args[0] == "-c" else ["-m", "specdec_cli", *args]
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "", "LINES": ""}
    env = {k: v for k, v in env.items() if v}
    return subprocess.Popen(
        [sys.executable, *command],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=terminal.slave,
        env=env,
        **kwargs,
    )


def run_on_terminal(args: list[str], stdout_path: Path, columns: int = 100) -> tuple[int, str]:
    """Run with stdout into a file and stderr on a terminal: (exit code, what the terminal got)."""
    terminal = Terminal(columns)
    with stdout_path.open("wb") as out:
        process = spawn(args, terminal, out)
        code = process.wait(timeout=120)
    return code, terminal.close()


def test_redirected_text_stays_in_the_file(target_model: Path, tmp_path: Path) -> None:
    """`specdec run ... > out.txt` at a terminal: the text in the file, the stats on screen."""
    args = ["run", "-m", str(target_model), "-p", "Once upon a time", "-n", "24", *GREEDY]
    piped = specdec(*args, "-q")
    out = tmp_path / "out.txt"
    code, screen = run_on_terminal(args, out)
    assert code == 0, screen
    assert piped.stdout.strip() and out.read_text() == piped.stdout
    assert piped.stdout.strip() not in screen
    assert "tok/s" in screen and "24 tokens" in screen


# --- Ctrl-C -------------------------------------------------------------------------------

# Each stand-in prints MARK on stderr when it has started, then takes far longer than the
# test waits: only Ctrl-C can end the run in time.
MARK = "STALLING"
SLOW_LOADS = {
    # As llama.cpp loading a model: C code that calls back into Python (its log callback).
    "callback from C": """
import ctypes, time
libc = ctypes.CDLL(None)
@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
def compare(a, b):
    time.sleep(0.01)
    return 0
def stall(*args):
    mark()
    items = (ctypes.c_int * 20000)()
    libc.qsort(items, len(items), ctypes.sizeof(ctypes.c_int), compare)
""",
    # A long call into C that never comes back to Python (repacking a big model).
    "stuck in C": """
import ctypes, signal
libc = ctypes.CDLL(None)
def stall(*args):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # this thread never sees it
    mark()
    libc.sleep(300)
""",
}
PRELUDE = f"""
import sys
def mark():
    sys.stderr.write("{MARK}\\n")
    sys.stderr.flush()
"""
LOAD_IN = (
    "import specdec_cli.llamacpp.llama as llama; llama.llama_cpp.llama_model_load_from_file = stall"
)
IMPORT_IN = """
import time
class SlowImport:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp":
            mark()
            time.sleep(300)
sys.meta_path.insert(0, SlowImport())
"""


def interrupt_when_stalled(stand_in: str, args: list[str], tmp_path: Path) -> tuple[int, str]:
    """Run specdec with `stand_in` stalling it; Ctrl-C once it says it stalls."""
    code = f"{PRELUDE}\n{stand_in}\nsys.argv = ['specdec', *{args!r}]\n"
    code += "from specdec_cli.__main__ import main\nmain()\n"
    terminal = Terminal()
    with (tmp_path / "out.txt").open("wb") as out:
        process = spawn(["-c", code], terminal, out)
        try:
            for _ in range(600):
                if MARK in terminal.text() or process.poll() is not None:
                    break
                threading.Event().wait(0.1)
            assert MARK in terminal.text(), terminal.text()
            process.send_signal(signal.SIGINT)
            returncode = process.wait(timeout=20)
        finally:
            process.kill()
    return returncode, terminal.close()


@pytest.mark.parametrize("load", SLOW_LOADS)
def test_ctrl_c_while_loading_exits_130(target_model: Path, tmp_path: Path, load: str) -> None:
    args = ["run", "-m", str(target_model), "-p", "Once", "-n", "8", *GREEDY]
    code, screen = interrupt_when_stalled(SLOW_LOADS[load] + LOAD_IN, args, tmp_path)
    assert code == 130, screen
    assert "Traceback" not in screen and "Exception ignored" not in screen, screen


def test_ctrl_c_while_importing_exits_130(target_model: Path, tmp_path: Path) -> None:
    args = ["run", "-m", str(target_model), "-p", "Once"]
    code, screen = interrupt_when_stalled(IMPORT_IN, args, tmp_path)
    assert code == 130, screen
    assert "Traceback" not in screen and "KeyboardInterrupt" not in screen, screen


# --- what the terminal shows ----------------------------------------------------------------


def test_stats_line_fits_the_terminal() -> None:
    """The closing line at 100 columns: whole parts left out, none cut in the middle."""
    stats = Stats(
        k="auto", tokens=123456, drafted=999999, accepted=888888, target_passes=54321,
        seconds=12.5, stop_reason="length", seed=4294967295, last_k=0,
        flash_attn=FlashAttnChoice("auto", "off"),
    )  # fmt: skip
    stats.draft_lengths.update({0: 5, 12: 40})
    full = stats_line(stats, 1000, final=True).plain
    assert "(last 0, mean 10.67)" in full and "seed 4294967295" in full
    line = stats_line(stats, 100, final=True).plain
    assert len(line) < 100 and "tok/s" in line
    assert set(line.split("  ")) <= set(full.split("  "))  # whole parts only


def test_bench_progress_says_it_is_measuring_costs(target_model: Path, tmp_path: Path) -> None:
    args = ["bench", "-m", str(target_model), "-d", "ngram", "-k", "1", "-n", "4", "--repeat", "1"]
    code, screen = run_on_terminal([*args, "-t", "1"], tmp_path / "out.txt")
    assert code == 0, screen
    assert "measuring costs" in screen


def test_color_shows_who_chose_each_token_on_a_terminal_only(
    target_model: Path, draft_model: Path, tmp_path: Path
) -> None:
    args = ["run", "-m", str(target_model), "-d", str(draft_model), "-k", "3", "--color"]
    args += ["-p", "Once upon a time", "-n", "30", *GREEDY]
    terminal = Terminal()
    process = spawn(args, terminal, terminal.slave)  # stdout on the terminal too
    assert process.wait(timeout=120) == 0
    screen = terminal.close()
    drafted, own = "\x1b[32m", "\x1b[33m"  # green, yellow
    assert drafted in screen and own in screen
    code, screen = run_on_terminal(args, tmp_path / "out.txt")  # stdout to a file
    assert code == 0
    assert "\x1b" not in (tmp_path / "out.txt").read_text()
    assert "--color colours text on a terminal only" in screen


def test_ctrl_c_while_generating_prints_the_stats(target_model: Path, tmp_path: Path) -> None:
    """A real SIGINT after 5 tokens: the text so far, the stats, exit 130."""
    stand_in = """
import time
from specdec_cli.decoding.engine import Engine
real_pieces = Engine.pieces
def slow_after_five(self, *args, **kwargs):
    for i, piece in enumerate(real_pieces(self, *args, **kwargs)):
        yield piece
        if i == 4:
            mark()
            time.sleep(300)
Engine.pieces = slow_after_five
"""
    args = ["run", "-m", str(target_model), "-p", "Once", "-n", "50", *GREEDY]
    code, screen = interrupt_when_stalled(stand_in, args, tmp_path)
    assert code == 130, screen
    assert "5 tokens" in screen and "stop: interrupted" in screen
    assert "Traceback" not in screen


def test_the_command_loads_llama_cpp_before_numpy() -> None:
    """On a CUDA build, numpy loaded first made the first model load crash."""
    code = (
        "import sys\n"
        "from specdec_cli.__main__ import main\n"
        "sys.argv = ['specdec', '--version']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "loaded = list(sys.modules)\n"
        "print(loaded.index('llama_cpp.llama_cpp') < loaded.index('numpy'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
