"""benchmarks/vs_llama_cpp.py's verdicts, on hand-made timings."""

from __future__ import annotations

import pytest
from benchscripts import load_benchmark


@pytest.fixture(scope="module")
def vs():
    return load_benchmark("vs_llama_cpp")


def test_the_best_setting_is_judged_on_runs_it_was_not_chosen_by(vs) -> None:
    """Two llama.cpp settings as fast as specdec, each lucky in one alternation: chosen
    and judged on the same runs, the best looks 13 % faster than specdec; chosen on the
    other alternation, it is level."""
    a, b = "llama draft-simple k=2 -fa on", "llama draft-simple k=3 -fa on"
    # specdec first and after each rival, each alternation: 3 runs + 3 runs
    runs = {"specdec": [100.0] * 6, a: [130.0, 100.0], b: [100.0, 130.0]}
    by_run = vs.paired_by_run(runs)
    assert by_run[a] == pytest.approx([100 / 130, 1.0])
    assert vs.held_out_ratio(runs, [a, b], by_run) == pytest.approx(1.0)
    # A setting that is faster in every alternation is chosen in each: its ratio stands.
    runs[b] = [140.0, 140.0]
    assert vs.held_out_ratio(runs, [a, b], vs.paired_by_run(runs)) == pytest.approx(100 / 140)
