"""`specdec bench` on standard workloads: Spec-Bench's and MT-Bench's question files,
--suite spec-bench, --per-category, and the figures per category."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_bench import MODEL_K4, TARGET_ONLY, stats
from test_cli_run import assert_user_error, specdec

import specdec_cli
from specdec_cli.commands import bench as bench_module
from specdec_cli.commands.bench import (
    ANSWER_SLACK,
    BenchOptions,
    BenchReport,
    VariantResult,
    prompt_room,
    run_bench,
    variants,
)
from specdec_cli.commands.benchjob import bench_workload
from specdec_cli.commands.display import CATEGORY_COLUMNS, print_bench
from specdec_cli.commands.workload import (
    Question,
    Workload,
    choose_workload,
    read_workload,
    suite_workload,
)
from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import FlashAttnChoice, Stats
from specdec_cli.errors import UserError
from specdec_cli.models.chat import ChatFormat, Message

BUILTIN = {"story": "Once upon a time"}
SPEC_BENCH = Path(specdec_cli.__file__).parent / "data" / "spec_bench" / "question.jsonl"
# MT-Bench's question file (FastChat's llm_judge/data/mt_bench/question.jsonl) has the same
# keys as Spec-Bench's, and a reference answer on some questions.
MT_BENCH_LINE = {
    "question_id": 101,
    "category": "reasoning",
    "turns": [
        "Imagine you are participating in a race with a group of people. If you have just "
        "overtaken the second person, what's your current position?",
        'If the "second person" is changed to "last person" in the above question, what '
        "would the answer be?",
    ],
    "reference": ["You are in second place.", "Uncertain."],
}


def write_questions(path: Path, *questions: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return path


def question(qid: int, category: str, *turns: str) -> dict[str, Any]:
    return {"question_id": qid, "category": category, "turns": list(turns)}


# --- reading question files (no model) ---


def test_a_jsonl_file_holds_questions(tmp_path: Path) -> None:
    path = write_questions(
        tmp_path / "q.jsonl", question(7, "coding", "Write a sort."), MT_BENCH_LINE
    )
    workload = read_workload(path)
    assert workload.chat == ChatFormat() and workload.source == str(path)
    assert workload.questions == (
        Question("question 7", ("Write a sort.",), "coding"),
        Question("question 101", tuple(MT_BENCH_LINE["turns"]), "reasoning"),
    )
    assert workload.categories == {"coding": [0], "reasoning": [1]}
    assert workload.generations == 3  # one a turn


def test_a_question_file_is_known_by_its_content_too(tmp_path: Path) -> None:
    path = write_questions(tmp_path / "questions.txt", question(1, "qa", "Why?"), MT_BENCH_LINE)
    assert read_workload(path).questions[0] == Question("question 1", ("Why?",), "qa")


def test_a_plain_file_holds_one_prompt_a_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text('The little dog\n\n{"not": "a question"}\n')
    workload = read_workload(path)
    assert workload.chat is None and workload.categories == {}
    assert workload.described() == {"line 1": "The little dog", "line 3": '{"not": "a question"}'}


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", ["line 2", "not JSON"]),
        ('["a list"]', ["line 2", "not a JSON object"]),
        ('{"question_id": 2, "category": "qa"}', ["line 2", '"turns"']),
        ('{"question_id": 2, "category": "qa", "turns": []}', ["line 2", '"turns"']),
        ('{"question_id": 2, "category": "qa", "turns": [3]}', ["line 2", '"turns"']),
        ('{"question_id": 2, "category": "qa", "turns": ["hi", " "]}', ["line 2", "empty"]),
        ('{"question_id": 2, "turns": ["hi"]}', ["line 2", '"category"']),
        ('{"category": "qa", "turns": ["hi"]}', ["line 2", '"question_id"']),
        ('{"question_id": 1, "category": "qa", "turns": ["hi"]}', ["line 2", "line 1"]),
    ],
)
def test_a_malformed_question_is_refused_by_its_line(
    tmp_path: Path, line: str, words: list[str]
) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(question(1, "qa", "Why?")) + "\n" + line + "\n")
    with pytest.raises(UserError) as error:
        read_workload(path)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_an_empty_question_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "q.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match="no questions"):
        read_workload(tmp_path / "q.jsonl")


def test_the_spec_bench_suite_ships_with_its_licence() -> None:
    workload = suite_workload("spec-bench")
    assert workload.chat == ChatFormat() and workload.source == "spec-bench"
    assert len(workload.questions) == 480
    sizes = {category: len(indices) for category, indices in workload.categories.items()}
    mt_bench = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem")
    assert sizes == dict.fromkeys((*mt_bench, "humanities"), 10) | dict.fromkeys(
        ("translation", "summarization", "qa", "math_reasoning", "rag"), 80
    )
    assert sum(len(q.turns) == 2 for q in workload.questions) == 80  # MT-Bench's
    assert "Apache License" in (SPEC_BENCH.parent / "LICENSE").read_text()
    readme = (SPEC_BENCH.parent / "README.md").read_text()
    assert "hemingkx/Spec-Bench" in readme and "fd2c1cd7d2201ef71db4c5f4e455008f017967bf" in readme


def test_per_category_keeps_the_first_n_of_each_in_file_order(tmp_path: Path) -> None:
    path = write_questions(
        tmp_path / "q.jsonl",
        question(1, "a", "1"),
        question(2, "b", "2"),
        question(3, "a", "3"),
        question(4, "a", "4"),
        question(5, "b", "5"),
        question(6, "c", "6"),
    )
    workload = choose_workload(path, None, 2, BUILTIN)
    assert [q.name for q in workload.questions] == [f"question {i}" for i in (1, 2, 3, 5, 6)]
    assert workload.per_category == 2
    suite = choose_workload(None, "spec-bench", 2, BUILTIN)
    assert len(suite.questions) == 26
    assert [q.name for q in suite.questions][:4] == [f"question {i}" for i in (81, 82, 91, 92)]


def test_per_category_and_suite_are_checked(tmp_path: Path) -> None:
    plain = tmp_path / "p.txt"
    plain.write_text("hello\n")
    with pytest.raises(UserError, match="--per-category needs questions"):
        choose_workload(plain, None, 2, BUILTIN)
    with pytest.raises(UserError, match="--per-category needs questions"):
        choose_workload(None, None, 2, BUILTIN)
    with pytest.raises(UserError, match="keep one"):
        choose_workload(plain, "spec-bench", None, BUILTIN)
    with pytest.raises(UserError, match="the suites: spec-bench"):
        choose_workload(None, "mt-bnech", None, BUILTIN)
    assert choose_workload(None, None, None, BUILTIN).described() == BUILTIN


# --- figures per category, on hand-made Stats (no model) ---


def test_a_categorys_figures_pool_its_questions_and_take_medians_over_repeats() -> None:
    questions = (
        Question("q1", ("a",), "x"),
        Question("q2", ("b",), "y"),
        Question("q3", ("c",), "x"),
    )
    workload = Workload(questions, "test", ChatFormat())
    base = VariantResult(TARGET_ONLY)
    spec = VariantResult(MODEL_K4)
    # Three repeats of (q1, q2, q3). Category x pools q1 and q3: tokens over seconds.
    base.runs += [stats(50, 0.5), stats(10, 1.0), stats(50, 0.5)]  # x: 100 tok/s
    base.runs += [stats(40, 0.5), stats(10, 1.0), stats(50, 0.5)]  # x: 90
    base.runs += [stats(60, 0.5), stats(10, 1.0), stats(50, 0.5)]  # x: 110
    spec.runs += [stats(100, 0.25, 80, 40, passes=50), stats(20, 1.0), stats(50, 0.75)]  # 150
    spec.runs += [stats(200, 0.5, 80, 60, passes=100), stats(20, 1.0), stats(100, 0.5)]  # 300
    spec.runs += [stats(70, 0.5, 40, 20, passes=40), stats(30, 1.0), stats(50, 0.5)]  # 120
    costs = Costs(0.001, 0.05, {1: 1.0, 2: 1.05})
    report = BenchReport(workload, [base, spec], costs, 100, 3, FlashAttnChoice("auto", "on"))
    x = report.by_category(spec)["x"]
    assert x["tokens_per_second"] == pytest.approx(150)
    assert x["speedup"] == pytest.approx(150 / 100)  # a ratio of medians
    # Acceptance and tokens a pass over all of x's runs: 120 of 200 drafted (q3's runs
    # drafted none), 570 tokens in 190 + 200 passes.
    assert x["acceptance_rate"] == pytest.approx(120 / 200)
    assert x["tokens_per_pass"] == pytest.approx(570 / 390, abs=1e-4)
    y = report.by_category(spec)["y"]
    assert y["tokens_per_second"] == pytest.approx(20) and y["speedup"] == pytest.approx(2.0)
    assert report.by_category(base)["x"]["speedup"] == 1.0
    assert list(report.variant_dict(spec)["categories"]) == ["x", "y"]


def test_plain_prompts_have_no_categories() -> None:
    workload = Workload((Question("line 1", ("hi",)),), "test")
    base = VariantResult(TARGET_ONLY, [stats(10, 1.0)])
    costs = Costs(0.001, 0.05, {1: 1.0})
    report = BenchReport(workload, [base], costs, 10, 1, FlashAttnChoice("auto", "on"))
    assert report.variant_dict(base)["categories"] == {}


# --- conversations through the engine ---


def test_a_later_turn_follows_each_variants_own_answer(
    target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turn 2's prompt is [turn 1, the answer to it made in the same run, turn 2]: for the
    target alone and the speculative variant alike (greedy: the same answer), the target's
    own greedy answer, made apart, its ends stripped."""
    chatml = ChatFormat("chatml")
    turns = ("Tell me about the little dog.", "Now say it again.")
    workload = Workload((Question("question 1", turns, "writing"),), "test", chatml)
    asked: list[list[Message]] = []
    tokenize_messages = Engine.tokenize_messages

    def recorded(self: Engine, messages: list[Message], *args: Any) -> list[int]:
        asked.append(list(messages))
        return tokenize_messages(self, messages, *args)

    greedy = SamplingParams(temp=0.0)
    options = EngineOptions(
        target_model, draft_model, n_ctx=256, threads=1, flash_attn="off", sampling=greedy
    )
    n = 12
    with Engine(options) as engine:
        alone = engine.make_decoder(None, "0")

        def answer(messages: list[Message]) -> tuple[str, int]:
            prompt = tokenize_messages(engine, messages, chatml)
            stats = Stats()
            pieces = engine.pieces(prompt, n, np.random.default_rng(0), stats, decoder=alone)
            return "".join(p.text for p in pieces), stats.tokens

        first, n_first = answer([Message("user", turns[0])])
        second_prompt = [Message("user", turns[0]), Message("assistant", first.strip())]
        second_prompt.append(Message("user", turns[1]))
        _, n_second = answer(second_prompt)
        # The context is sized for turn 2 before any answer is known: -n tokens of answer
        # and ANSWER_SLACK more.
        second_tokens = len(tokenize_messages(engine, second_prompt, chatml))
        room = prompt_room(engine.model, workload, turns, n)
        assert second_tokens <= room <= second_tokens + (n - n_first) + ANSWER_SLACK
        monkeypatch.setattr(Engine, "tokenize_messages", recorded)
        report = run_bench(
            engine, variants(["model"], ["2"]), workload, BenchOptions(n_predict=n, repeat=1)
        )
    assert first.strip()  # something to carry over
    later = [messages for messages in asked if len(messages) > 1]
    assert later == [second_prompt, second_prompt]  # one a variant
    # Each question's figures hold both of its turns.
    assert [r.runs[0].tokens for r in report.results] == [n_first + n_second] * 2
    assert report.results[1].runs[0].drafted > 0


def test_sampled_variants_each_carry_their_own_answer(
    target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling, the variants answer turn 1 differently: each one's turn 2 follows its own
    answer, not another variant's."""
    chatml = ChatFormat("chatml")
    turns = ("Tell me about the little dog.", "Now say it again.")
    workload = Workload((Question("question 1", turns, "writing"),), "test", chatml)
    calls: dict[int, list[tuple[list[int], list[int]]]] = {}  # by decoder: (prompt, output)
    generate = bench_module._generate

    def recorded(decoder: Any, prompt: list[int], *args: Any) -> tuple[Stats, list[int]]:
        stats, tokens = generate(decoder, prompt, *args)
        calls.setdefault(id(decoder), []).append((prompt, tokens))
        return stats, tokens

    monkeypatch.setattr(bench_module, "_generate", recorded)
    sampled = SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0)
    options = EngineOptions(
        target_model, draft_model, n_ctx=256, threads=1, flash_attn="off", sampling=sampled
    )
    with Engine(options) as engine:
        run_bench(
            engine, variants(["model"], ["2"]), workload, BenchOptions(n_predict=12, repeat=1)
        )
        expected = []
        for _warm_up, (_, first), (second_prompt, _) in calls.values():
            answer = b"".join(engine.model.piece(t) for t in first).decode().strip()
            conversation = [Message("user", turns[0]), Message("assistant", answer)]
            conversation.append(Message("user", turns[1]))
            expected.append((second_prompt, engine.tokenize_messages(conversation, chatml)))
            assert answer
    assert len(expected) == 2
    assert expected[0][0] != expected[1][0]  # the answers differed
    for second_prompt, own in expected:
        assert second_prompt == own


# --- the command ---


def bench(model: Path, out: Path, *extra: str, ks: str = "1,2") -> tuple[dict[str, Any], str]:
    args = ["bench", "-m", str(model), "-d", "ngram", "-k", ks, "-t", "1", "-n", "6"]
    result = specdec(*args, "--repeat", "1", "--json", str(out), *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text()), result.stdout


QUESTIONS = (
    question(1, "writing", "Write about a dog.", "Make it shorter."),
    question(2, "coding", "Write a loop."),
    question(3, "writing", "Write about a cat."),
    question(4, "coding", "Write a list."),
)


def test_bench_questions_by_category(target_model: Path, tmp_path: Path) -> None:
    """A model without a chat template, given one with --chat-template: the table, the
    JSON's categories and the plot."""
    path = write_questions(tmp_path / "q.jsonl", *QUESTIONS)
    png = tmp_path / "plot.png"
    data, stdout = bench(
        target_model,
        tmp_path / "out.json",
        *("--prompts", str(path), "--per-category", "1", "--chat-template", "chatml"),
        *("--plot", str(png)),
    )
    settings = data["settings"]
    assert settings["prompts_from"] == str(path) and settings["per_category"] == 1
    assert settings["prompts"] == {
        "question 1": {"category": "writing", "turns": QUESTIONS[0]["turns"]},
        "question 2": {"category": "coding", "turns": QUESTIONS[1]["turns"]},
    }
    entries = [data["baseline"], *data["runs"]]
    for entry in entries:
        categories = entry["categories"]
        assert list(categories) == ["writing", "coding"]
        for figures in categories.values():
            assert set(figures) == {
                "speedup",
                "paired_speedup",
                "paired_speedup_min",
                "paired_speedup_max",
                "tokens_per_second",
                "tokens_per_pass",
                "acceptance_rate",
                "k_mean",
            }
            assert figures["tokens_per_second"] > 0
    for name in ("writing", "coding"):
        base = data["baseline"]["categories"][name]
        assert base["speedup"] == 1.0 and base["tokens_per_pass"] == 1.0
        for run in data["runs"]:
            mine = run["categories"][name]
            ratio = mine["tokens_per_second"] / base["tokens_per_second"]
            assert mine["speedup"] == pytest.approx(ratio, rel=1e-3)
            low, high = mine["paired_speedup_min"], mine["paired_speedup_max"]
            assert low <= mine["paired_speedup"] <= high
            assert 1.0 <= mine["tokens_per_pass"] <= int(run["k"]) + 1
    # The piped table: the variants, a blank line, then a row per category and variant.
    blocks = stdout.split("\n\n")
    rows = [line.split("\t") for line in blocks[1].splitlines() if not line.startswith("#")]
    assert tuple(rows[0]) == CATEGORY_COLUMNS
    names = [entry["name"] for entry in entries]
    assert [row[:2] for row in rows[1:]] == [[c, n] for c in ("writing", "coding") for n in names]
    assert rows[1][6] == "-" and rows[2][6].endswith("%")  # acceptance: speculative rows only
    assert rows[1][4] == "-" and re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", rows[2][4])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_shows_speedup_by_category() -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from specdec_cli.commands.display import plot_figure

    questions = (Question("q1", ("a",), "x"), Question("q2", ("b",), "y"))
    base = VariantResult(TARGET_ONLY, [stats(100, 1.0), stats(100, 1.0)])
    spec = VariantResult(MODEL_K4, [stats(150, 1.0, 80, 40), stats(100, 0.5, 80, 60)])
    costs = Costs(0.001, 0.05, {1: 1.0, 5: 1.2})
    workload = Workload(questions, "test", ChatFormat())
    report = BenchReport(workload, [base, spec], costs, 100, 1, FlashAttnChoice("auto", "on"))
    fig = plot_figure(report, plt)
    by_category = next(ax for ax in fig.axes if ax.get_title() == "speedup by category")
    assert [label.get_text() for label in by_category.get_xticklabels()] == ["x", "y"]
    assert [bar.get_height() for bar in by_category.patches] == pytest.approx([1.5, 2.0])
    plt.close(fig)


def test_the_terminal_shows_the_table_by_category(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    questions = (Question("q1", ("a",), "writing"), Question("q2", ("b",), "coding"))
    base = VariantResult(TARGET_ONLY, [stats(100, 1.0), stats(100, 1.0)])
    spec = VariantResult(MODEL_K4, [stats(150, 1.0, 80, 40), stats(100, 0.5, 80, 60)])
    costs = Costs(0.001, 0.05, {1: 1.0, 5: 1.2})
    workload = Workload(questions, "test", ChatFormat())
    setup = {"sampling": asdict(SamplingParams(temp=0.0)), "seed": 0}
    flash_attn = FlashAttnChoice("auto", "on")
    report = BenchReport(workload, [base, spec], costs, 100, 1, flash_attn, setup)
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    print_bench(report)
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # rich's colours
    assert "2 questions x 1 repeats" in out
    lines = out[out.index("by category") :].splitlines()
    rows = [line.replace("│", " ").split() for line in lines if line.startswith("│")]
    assert rows == [  # the category's name on its first row only
        ["writing", "target", "only", "100.0", "1.00x", "-", "1.00", "-", "-"],
        ["model", "k=4", "150.0", "1.50x", "1.50x", "(1.50-1.50)", "1.00", "50.0%", "0.00"],
        ["coding", "target", "only", "100.0", "1.00x", "-", "1.00", "-", "-"],
        ["model", "k=4", "200.0", "2.00x", "2.00x", "(2.00-2.00)", "1.00", "75.0%", "0.00"],
    ]


def test_bench_questions_need_a_chat_template(target_model: Path, tmp_path: Path) -> None:
    path = write_questions(tmp_path / "q.jsonl", *QUESTIONS)
    args = ["bench", "-m", str(target_model), "-d", "ngram", "--prompts", str(path)]
    assert_user_error(specdec(*args), "no chat template", "--chat-template")


def test_bench_refuses_a_malformed_question_file(target_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n{oops\n")
    result = specdec("bench", "-m", str(target_model), "-d", "ngram", "--prompts", str(path))
    assert_user_error(result, "line 2", "not JSON")


def test_chat_flags_format_questions_only(tmp_path: Path) -> None:
    plain = tmp_path / "p.txt"
    plain.write_text("hello\n")
    chatml = ChatFormat("chatml")
    with pytest.raises(UserError, match="plain prompts go to the model as written"):
        bench_workload(plain, None, None, chatml)
    with pytest.raises(UserError, match="plain prompts go to the model as written"):
        bench_workload(None, None, None, ChatFormat(jinja=False))
    assert bench_workload(plain, None, None, ChatFormat()).chat is None
    questions = write_questions(tmp_path / "q.jsonl", *QUESTIONS)
    assert bench_workload(questions, None, None, chatml).chat == chatml


def test_bench_spec_bench_questions_on_a_chat_model(smollm2: Path, tmp_path: Path) -> None:
    """A real chat model's own template: two of Spec-Bench's questions, one of MT-Bench's
    two-turn questions among them."""
    lines = SPEC_BENCH.read_text(encoding="utf-8").splitlines()
    path = tmp_path / "q.jsonl"
    path.write_text(lines[0] + "\n" + next(x for x in lines if '"translation"' in x) + "\n")
    out = tmp_path / "out.json"
    data, _ = bench(smollm2, out, "--prompts", str(path), "-fa", "off", "-n", "4", ks="2")
    assert list(data["runs"][0]["categories"]) == ["writing", "translation"]
    assert data["settings"]["n_ctx"] >= 256
