"""`specdec bench`: the report's arithmetic on hand-made figures, and the command itself."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from test_cli_run import assert_user_error, specdec

import specdec_cli
from specdec_cli.commands.bench import BUILTIN_PROMPTS, BenchReport, Variant, VariantResult
from specdec_cli.commands.display import sampling_flags
from specdec_cli.commands.workload import plain_workload
from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.stats import FlashAttnChoice, Stats
from specdec_cli.llamacpp.machine import cpu_name

# --- BenchReport on hand-made Stats (no model) ---

VERIFY = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}
TARGET_ONLY = Variant(None)
MODEL_K4 = Variant("model", "4")


def stats(
    tokens: int,
    seconds: float,
    drafted: int = 0,
    accepted: int = 0,
    draft_seconds: float = 0.0,
    verify_seconds: float | None = None,
    passes: int | None = None,
    draft_calls: int = 0,
    batch_sizes: dict[int, int] | None = None,
) -> Stats:
    passes = tokens if passes is None else passes
    return Stats(
        tokens=tokens,
        seconds=seconds,
        drafted=drafted,
        accepted=accepted,
        target_passes=passes,
        draft_calls=draft_calls,
        draft_seconds=draft_seconds,
        verify_seconds=seconds - draft_seconds if verify_seconds is None else verify_seconds,
        llama_seconds=seconds,
        batch_sizes=Counter(batch_sizes or {1: passes}),
    )


def report(*results: VariantResult, c: float = 0.05, prompts: int = 1) -> BenchReport:
    workload = plain_workload({f"p{i}": f"prompt {i}" for i in range(prompts)}, "test")
    repeat = len(results[0].runs) // prompts
    costs = Costs(0.001, c, VERIFY)
    return BenchReport(workload, list(results), costs, 100, repeat, FlashAttnChoice("auto", "on"))


def baseline(speed: float = 100.0) -> VariantResult:
    return VariantResult(TARGET_ONLY, [stats(100, 100 / speed)])


def speculative(speed: float, alpha: float, **kwargs: Any) -> VariantResult:
    drafted = 100
    return VariantResult(
        MODEL_K4, [stats(100, 100 / speed, drafted, round(alpha * drafted), passes=40, **kwargs)]
    )


def test_speedup_is_a_ratio_of_medians_over_repeats() -> None:
    # Two prompts, three repeats. A repeat's speed pools its prompts: tokens / seconds.
    base = VariantResult(TARGET_ONLY)
    base.runs += [stats(50, 0.25), stats(50, 0.75)]  # 100 tokens / 1.0 s = 100 tok/s
    base.runs += [stats(50, 0.5), stats(40, 0.5)]  # 90 / 1.0 = 90
    base.runs += [stats(60, 0.5), stats(50, 0.5)]  # 110 / 1.0 = 110
    spec = VariantResult(MODEL_K4)
    spec.runs += [stats(75, 0.25), stats(75, 0.75)]  # 150 / 1.0 = 150
    spec.runs += [stats(150, 0.25), stats(150, 0.75)]  # 300 / 1.0 = 300
    spec.runs += [stats(60, 0.5), stats(60, 0.5)]  # 120 / 1.0 = 120
    r = report(base, spec, prompts=2)
    assert base.repeat_speeds(2) == pytest.approx([100, 90, 110])
    assert r.median_speed(base) == pytest.approx(100)
    assert r.median_speed(spec) == pytest.approx(150)
    assert r.speedup(spec) == pytest.approx(1.5)
    assert r.speedup(base) == pytest.approx(1.0)
    # Per prompt: medians of (200, 100, 120) and of (66.7, 80, 100).
    assert r.speed_by_prompt(base) == pytest.approx({"p0": 120, "p1": 80})


def test_paired_speedups_set_each_repeat_against_the_target_alone_in_it() -> None:
    """The target alone hit a slow moment in the third repeat: the ratio of medians
    credits the variant with it (95 over 90 tok/s), each repeat's own ratio does not."""
    base = VariantResult(TARGET_ONLY, [stats(100, 1.0), stats(90, 1.0), stats(60, 1.0)])
    spec = VariantResult(MODEL_K4, [stats(95, 1.0), stats(85, 1.0), stats(99, 1.0)])
    r = report(base, spec)
    assert r.speedup(spec) == pytest.approx(95 / 90)
    assert r.paired_speedups(spec) == pytest.approx([0.95, 85 / 90, 99 / 60])
    assert r.paired_figures(spec) == {
        "paired_speedup": 0.95,
        "paired_speedup_min": round(85 / 90, 4),
        "paired_speedup_max": round(99 / 60, 4),
    }
    assert r.paired_figures(base)["paired_speedup"] == 1.0
    assert r.variant_dict(spec)["paired_speedup"] == 0.95


def test_total_adds_the_runs_up() -> None:
    result = VariantResult(
        MODEL_K4,
        [
            stats(10, 1.0, drafted=8, accepted=6, passes=4, batch_sizes={5: 4}),
            stats(20, 2.0, drafted=4, accepted=1, passes=3, batch_sizes={5: 1, 1: 2}),
        ],
    )
    t = result.total()
    assert (t.tokens, t.drafted, t.accepted, t.target_passes) == (30, 12, 7, 7)
    assert t.seconds == pytest.approx(3.0)
    assert t.batch_sizes == Counter({5: 5, 1: 2})
    assert t.k == "4"


def test_ideal_speedup_charges_the_draft_only_for_a_model() -> None:
    # 100 tokens; 80 draft calls; 20 rounds of 5 tokens: cost 80 * 0.05 + 20 * 1.2 = 28.
    kwargs = {"draft_calls": 80, "batch_sizes": {5: 20}}
    model = VariantResult(MODEL_K4, [stats(100, 1.0, 80, 60, passes=20, **kwargs)])
    ngram = VariantResult(Variant("ngram", "4"), [stats(100, 1.0, 80, 60, passes=20, **kwargs)])
    r = report(baseline(), model, ngram)
    assert r.ideal_speedup(model) == pytest.approx(100 / 28)
    assert r.ideal_speedup(ngram) == pytest.approx(100 / 24)  # no draft cost: 20 * 1.2
    # A head's steps cost what the measurements say too (a lookup's alone are free).
    head = VariantResult(Variant("mtp+ngram", "4"), [stats(100, 1.0, 80, 60, passes=20, **kwargs)])
    assert r.ideal_speedup(head) == pytest.approx(100 / 28)


def test_verdict_high_speedup_names_the_best() -> None:
    slow = VariantResult(Variant("model", "1"), [stats(100, 100 / 150, 100, 70, passes=60)])
    fast = speculative(250, 0.8)
    r = report(baseline(100), slow, fast)
    assert r.best() is fast
    assert r.verdict() == "best: model k=4, 2.50x the target alone"


def test_verdict_low_acceptance_does_not_pay() -> None:
    # 80 tok/s against 100; 20% accepted; cheap draft (c 0.05) and a perfect
    # implementation would still gain (k=1: 1.2 / (0.05 + 1.05) = 1.09): only alpha is named.
    r = report(baseline(100), speculative(80, 0.2))
    verdict = r.verdict()
    assert verdict.startswith("speculation does not pay here (0.80x at best)")
    assert "accepted only 20% of the time" in verdict
    assert "draft token costs" not in verdict
    assert "perfect implementation" not in verdict


def test_verdict_expensive_draft_with_a_bound_below_one() -> None:
    # alpha 0.1, c 0.5: the best k is 1 with 1.1 / (0.5 + 1.05) = 0.71x.
    verdict = report(baseline(100), speculative(50, 0.1), c=0.5).verdict()
    assert "does not pay" in verdict
    assert "accepted only 10% of the time" in verdict
    assert "one draft token costs 0.50 of a target token" in verdict
    assert "even a perfect implementation reaches 0.71x" in verdict


def test_verdict_otherwise_blames_the_overhead() -> None:
    # Good acceptance, cheap draft, yet slower: 60% of the time is neither draft nor verify.
    spec = speculative(90, 0.8, draft_seconds=0.1 * 100 / 90, verify_seconds=0.3 * 100 / 90)
    verdict = report(baseline(100), spec).verdict()
    assert "does not pay" in verdict
    assert "our own overhead is 60% of the time" in verdict
    assert "accepted only" not in verdict


def test_verdict_without_a_speculative_variant() -> None:
    r = report(baseline(100))
    assert r.best() is r.baseline
    assert r.verdict() == "no speculative variant was run"


def test_variant_dict_figures() -> None:
    spec = speculative(150, 0.5, draft_seconds=0.2, verify_seconds=0.4)
    d = report(baseline(100), spec).variant_dict(spec)
    assert d["speedup"] == pytest.approx(1.5)
    assert d["acceptance_rate"] == 0.5
    assert d["tokens_per_pass"] == 2.5  # 100 tokens in 40 passes
    share = d["time_share"]
    assert share["draft"] == pytest.approx(0.2 / (100 / 150), abs=1e-4)
    assert sum(share.values()) == pytest.approx(1.0, abs=1e-3)
    assert d["efficiency"] == pytest.approx(d["speedup"] / d["theoretical_speedup"], rel=1e-3)


# --- the command ---


QUICK = ["-t", "1", "-n", "16", "--repeat", "2", "-k", "1,2"]


def bench(target: Path, drafts: list[str], out: Path, *extra: str) -> dict[str, Any]:
    """Run `specdec bench` with --json; return the JSON, with the stdout under "_stdout"."""
    d_flags = [flag for d in drafts for flag in ("-d", d)]
    result = specdec("bench", "-m", str(target), *d_flags, *QUICK, "--json", str(out), *extra)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    data["_stdout"] = result.stdout
    return data


@pytest.fixture(scope="module")
def model_bench(
    target_model: Path, draft_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "out.json"
    return bench(target_model, [str(draft_model)], out)


def check_report(data: dict[str, Any], names: list[str]) -> None:
    base = data["baseline"]
    assert base["name"] == "target only"
    assert base["speedup"] == 1.0 and base["tokens_per_pass"] == 1.0
    assert base["tokens_per_second"] > 0
    assert [r["name"] for r in data["runs"]] == names
    for run in [base, *data["runs"]]:
        assert run["tokens_per_second_min"] <= run["tokens_per_second"]
        assert run["tokens_per_second"] <= run["tokens_per_second_max"]
        assert sum(run["time_share"].values()) == pytest.approx(1.0, abs=0.01)
    for run in data["runs"]:
        assert run["speedup"] > 0
        assert 0.0 <= run["acceptance_rate"] <= 1.0
        assert 1.0 <= run["tokens_per_pass"] <= int(run["k"]) + 1
        assert run["theoretical_speedup"] > 0 and run["efficiency"] > 0
        assert run["speedup"] == pytest.approx(
            run["tokens_per_second"] / base["tokens_per_second"], rel=1e-3
        )
    verify = data["cost"]["verify_cost"]
    assert verify["1"] == 1.0
    assert sorted(verify, key=int) == ["1", "2", "3"]  # batches up to max k + 1
    assert data["best"] in names
    assert data["verdict"]


def test_bench_draft_model(model_bench: dict[str, Any]) -> None:
    # A draft model alone drafts as `run` does: with lookup first.
    check_report(model_bench, ["model+ngram k=1", "model+ngram k=2"])
    assert [r["k"] for r in model_bench["runs"]] == ["1", "2"]
    assert model_bench["cost"]["draft_over_target"] > 0
    assert model_bench["settings"]["prompts"] == BUILTIN_PROMPTS
    assert model_bench["settings"]["n_predict"] == 16 and model_bench["settings"]["repeat"] == 2
    # -fa auto (the default) was resolved by measurement, and the table says to what.
    choice = model_bench["settings"]["flash_attn"]
    assert choice["asked"] == "auto" and choice["used"] in ("on", "off")
    settings = f"# settings: -fa auto -> {choice['used']} (measured), greedy\n"
    assert settings in model_bench["_stdout"]
    # The fixture draft agrees with the target about 60% of the time.
    assert all(r["acceptance_rate"] > 0.2 for r in model_bench["runs"])


def test_bench_json_says_what_reproduces_it(
    model_bench: dict[str, Any], target_model: Path, draft_model: Path
) -> None:
    settings = model_bench["settings"]
    for role, path in (("target", target_model), ("draft", draft_model)):
        assert settings["models"][role] == {"path": str(path), "bytes": path.stat().st_size}
    assert settings["threads"] == 1 and settings["threads_draft"] == 1
    assert settings["n_ctx"] >= 16 and settings["flash_attn"]["used"] in ("on", "off")
    assert settings["sampling"] == asdict(SamplingParams(temp=0.0)) and settings["seed"] == 0
    assert settings["specdec"] == specdec_cli.__version__
    assert settings["llama_cpp_python"] == llama_cpp.__version__
    assert "CPU" in settings["backends"] and settings["cpu"] == cpu_name()
    assert isinstance(model_bench["warnings"], list)


def test_bench_piped_table_is_plain(model_bench: dict[str, Any]) -> None:
    stdout = model_bench["_stdout"]
    assert "\x1b" not in stdout
    lines = stdout.splitlines()
    rows = [line.split("\t") for line in lines if not line.startswith("#")]
    header, *variants = rows
    assert header[:4] == ["variant", "tok/s", "min-max", "speedup"]
    assert [row[0] for row in variants] == [
        "target only",
        *(
            r["name"] + (" *" if r["name"] == model_bench["best"] else "")
            for r in model_bench["runs"]
        ),
    ]
    assert all(len(row) == len(header) for row in variants)
    assert any(line.startswith("# costs:") for line in lines)
    assert lines[-1] == f"# {model_bench['verdict']}"


def test_bench_ngram(target_model: Path, tmp_path: Path) -> None:
    data = bench(target_model, ["ngram"], tmp_path / "out.json")
    check_report(data, ["ngram k=1", "ngram k=2"])
    assert data["cost"]["draft_over_target"] == 0.0


def test_bench_draft_model_and_ngram(target_model: Path, draft_model: Path, tmp_path: Path) -> None:
    data = bench(target_model, [str(draft_model), "ngram"], tmp_path / "out.json")
    names = ["model k=1", "model k=2", "ngram k=1", "ngram k=2"]
    check_report(data, [*names, "model+ngram k=1", "model+ngram k=2"])
    rows = [line for line in data["_stdout"].splitlines() if not line.startswith("#")]
    assert len(rows) == 1 + 7  # header, target only, six speculative variants


def test_bench_prompts_file(target_model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The little dog\n\nOnce upon a time\n")
    data = bench(target_model, ["ngram"], tmp_path / "out.json", "--prompts", str(prompts))
    assert data["settings"]["prompts"] == {
        "line 1": "The little dog",
        "line 3": "Once upon a time",
    }
    assert set(data["baseline"]["tokens_per_second_by_prompt"]) == {"line 1", "line 3"}


def test_bench_needs_a_drafter(target_model: Path) -> None:
    assert_user_error(specdec("bench", "-m", str(target_model)), "-d")


def test_bench_one_draft_model_at_a_time(target_model: Path, draft_model: Path) -> None:
    result = specdec(
        "bench", "-m", str(target_model), "-d", str(draft_model), "-d", str(draft_model)
    )
    assert_user_error(result, "one draft model")


def test_bench_rejects_k_zero(target_model: Path) -> None:
    assert_user_error(specdec("bench", "-m", str(target_model), "-d", "ngram", "-k", "0"), "-k")


def test_bench_plot(target_model: Path, tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    args = ["bench", "-m", str(target_model), "-d", "ngram", "-t", "1", "-n", "8"]
    result = specdec(*args, "--repeat", "1", "-k", "1,2", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert_user_error(result, "matplotlib")
        assert not png.exists()
    else:
        assert result.returncode == 0, result.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_checks_output_paths_before_measuring(target_model: Path, tmp_path: Path) -> None:
    for flag in ("--json", "--plot"):
        args = ["bench", "-m", str(target_model), "-d", "ngram", "-t", "1", "-n", "4"]
        result = specdec(*args, "--repeat", "1", "-k", "1", flag, str(tmp_path / "no" / "x"))
        assert_user_error(result, flag, "no directory")
        assert result.stdout == ""  # nothing was measured


def test_bench_output_file_options_refuse_a_flag_for_a_name(target_model: Path) -> None:
    """`bench --json -n 64`, as `run --json` is written: the file name given is a flag, said
    as such, not "unexpected extra argument (64)" once -n was taken for the file."""
    for flag in ("--json", "--plot"):
        result = specdec("bench", "-m", str(target_model), "-d", "ngram", flag, "-n", "4")
        assert_user_error(result, flag, "-n", "file")
        assert "extra argument" not in result.stderr


def test_plot_speed_axis_from_zero_and_auto_as_a_point() -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from specdec_cli.commands.display import plot_figure

    runs = [
        speculative(150.0, 0.6),
        VariantResult(Variant("model", "auto"), [stats(100, 0.6, 60, 40, passes=40)]),
    ]
    runs[1].runs[0].draft_lengths.update({2: 20, 4: 20})
    fig = plot_figure(report(baseline(), *runs), plt)
    speed_ax = fig.axes[0]
    assert speed_ax.get_ylim()[0] == 0
    auto = [line for line in speed_ax.lines if "auto" in str(line.get_label())]
    assert len(auto) == 1 and list(auto[0].get_xdata()) == [3.0]  # its mean k
    plt.close(fig)


def test_untrustworthy_figures_are_flagged() -> None:
    steady = report(baseline(), speculative(150.0, 0.6))
    assert steady.warnings() == []
    too_good = report(baseline(), speculative(400.0, 0.6))  # above the ideal speedup
    assert any("beat the ideal" in w for w in too_good.warnings())
    drifting = VariantResult(TARGET_ONLY, [stats(100, 1.0), stats(100, 0.5)])
    slowed = report(drifting, VariantResult(MODEL_K4, [stats(100, 0.8), stats(100, 0.4)]))
    assert any("speed changed" in w for w in slowed.warnings())


def test_bench_tree_variants(target_model: Path, draft_model: Path, tmp_path: Path) -> None:
    """--tree gives every k its tree variants, named by it, with what the branches won;
    --no-ngram, the draft model without lookup."""
    out = tmp_path / "out.json"
    data = bench(target_model, [str(draft_model)], out, "--tree", "off,6", "--no-ngram")
    names = [f"model k={k}{tree}" for k in ("1", "2") for tree in ("", " tree=6")]
    assert [r["name"] for r in data["runs"]] == names
    # Costs cover the widest batch: a 6-token tree and the token before it.
    assert sorted(data["cost"]["verify_cost"], key=int) == [str(n) for n in range(1, 8)]
    runs = {r["name"]: r for r in data["runs"]}
    chain, tree = runs["model k=2"], runs["model k=2 tree=6"]
    assert chain["tree"] == "off" and tree["tree"] == "6"
    assert chain["accepted_beside_chain"] == 0 < tree["accepted_beside_chain"]
    assert tree["k_mean"] > chain["k_mean"]  # nodes drafted per round


def test_the_settings_line_says_how_the_bench_sampled() -> None:
    sampled = {"sampling": asdict(SamplingParams(coupled=True)), "seed": 3}
    expected = "--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --coupled --seed 3"
    assert sampling_flags(sampled) == expected
    assert sampling_flags({"sampling": asdict(SamplingParams(temp=0.0)), "seed": 3}) == "greedy"
