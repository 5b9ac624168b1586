"""`specdec run` as users call it: real processes, exit codes, pipes, JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec_cli.commands import cli
from specdec_cli.commands.bench import BenchOptions
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.llamacpp import costcache
from specdec_cli.llamacpp.machine import usable_cpus


def specdec(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specdec_cli", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_user_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("specdec: error:"), result.stderr
    for word in words:
        assert word in lines[-1], lines[-1]


GREEDY = ["--temp", "0", "-t", "1"]


def without_measuring_notes(stderr: str) -> list[str]:
    """stderr's lines but the notes of one-time measuring (costs, -fa auto), which come
    only on the first run with a model in the session's cache."""
    return [line for line in stderr.splitlines() if not line.startswith("specdec: measuring")]


def test_missing_model(tmp_path: Path) -> None:
    assert_user_error(specdec("run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"), "not found")


def test_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model")
    assert_user_error(specdec("run", "-m", str(fake), "-p", "hi"), "not a GGUF")


def test_missing_draft(target_model: Path, tmp_path: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-d", str(tmp_path / "d.gguf"), "-p", "hi")
    assert_user_error(result, "not found")


def test_another_vocabulary_is_translated_and_said_once(
    target_model: Path, other_vocab_model: Path
) -> None:
    args = ["run", "-m", str(target_model), "-d", str(other_vocab_model), "-p", "hi", "-n", "8"]
    result = specdec(*args, "--temp", "0")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "translated" in line]
    assert len(said) == 1 and other_vocab_model.name in said[0]


def test_padded_vocabulary_only_warns(target_model: Path, padded_vocab_model: Path) -> None:
    result = specdec(
        "run",
        "-m",
        str(target_model),
        "-d",
        str(padded_vocab_model),
        "-p",
        "hi",
        "-n",
        "8",
        *GREEDY,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" in result.stderr and "pad" in result.stderr.lower()


@pytest.mark.parametrize(
    ("flags", "word"),
    [
        (["-k", "0"], "-k"),
        (["-k", "many"], "-k"),
        (["-n", "0"], "--n-predict"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temp", "-1"], "--temp"),
        (["--ngram-min", "5", "--ngram-max", "2"], "--ngram-min"),
        (["-fa", "maybe"], "--flash-attn"),
    ],
)
def test_impossible_flag_values(target_model: Path, flags: list[str], word: str) -> None:
    assert_user_error(specdec("run", "-m", str(target_model), "-p", "hi", *flags), word)


@pytest.mark.parametrize(
    "command", [["run", "-t"], ["run", "-d", "ngram", "-td"], ["worker", "-t"]]
)
def test_more_threads_than_cpus_are_refused(target_model: Path, command: list[str]) -> None:
    """-t 1000 on two cores ran 50 times slower than -t 2, saying nothing."""
    too_many = str(usable_cpus() + 1)
    name, *flags = command
    model = ["-m", str(target_model), "-p", "hi"] if name == "run" else []
    result = specdec(name, *model, *flags, too_many)
    assert_user_error(result, f"{flags[-1]} {too_many}", "or fewer")


def test_prompt_longer_than_context(target_model: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-c", "16", "-p", "word " * 40)
    assert_user_error(result, "context", "-c")


def test_no_prompt_file(target_model: Path, tmp_path: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-f", str(tmp_path / "missing.txt"))
    assert_user_error(result, "not found")


def test_json_output(target_model: Path, draft_model: Path) -> None:
    result = specdec(
        "run",
        "-m",
        str(target_model),
        "-d",
        str(draft_model),
        "-k",
        "3",
        "-p",
        "Once upon a time",
        "-n",
        "20",
        "--json",
        *GREEDY,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    for field in (
        "text",
        "tokens",
        "drafted",
        "accepted",
        "acceptance_rate",
        "target_passes",
        "tokens_per_second",
        "seconds",
        "k",
        "stop_reason",
    ):
        assert field in record
    assert record["tokens"] == 20 and record["stop_reason"] == "length"
    assert record["k"] == "3" and record["drafted"] >= record["accepted"] > 0
    assert without_measuring_notes(result.stderr) == []  # the JSON replaces the summary line


def test_text_equals_target_only_and_summary_is_one_line(
    target_model: Path, draft_model: Path
) -> None:
    args = ["-p", "Once upon a time", "-n", "24", *GREEDY]
    alone = specdec("run", "-m", str(target_model), *args)
    spec = specdec("run", "-m", str(target_model), "-d", str(draft_model), *args)
    assert alone.returncode == spec.returncode == 0
    assert spec.stdout == alone.stdout and spec.stdout.strip()
    summary = without_measuring_notes(spec.stderr)
    assert len(summary) == 1 and "tok/s" in summary[0] and "accepted" in summary[0]
    quiet = specdec("run", "-m", str(target_model), "-d", str(draft_model), "-q", *args)
    assert quiet.stderr == "" and quiet.stdout == alone.stdout


def test_coupled_sampled_text_equals_target_only(target_model: Path, draft_model: Path) -> None:
    """--coupled: a seed's sampled text is the same with a draft as without one; the
    control, without --coupled, differs."""
    args = ["-p", "Once upon a time", "-n", "32", "--temp", "1", "--seed", "4", "-q"]
    alone, spec, uncoupled = (
        specdec("run", "-m", str(target_model), *more, *args)
        for more in (
            ["--coupled"],
            ["-d", str(draft_model), "--coupled"],
            ["-d", str(draft_model)],
        )
    )
    assert alone.returncode == spec.returncode == uncoupled.returncode == 0
    assert spec.stdout == alone.stdout and spec.stdout.strip()
    assert uncoupled.stdout != alone.stdout


def test_prompt_from_stdin(target_model: Path) -> None:
    from_flag = specdec(
        "run", "-m", str(target_model), "-p", "Once upon a time", "-n", "10", *GREEDY
    )
    piped = specdec("run", "-m", str(target_model), "-n", "10", *GREEDY, stdin="Once upon a time\n")
    dash = specdec(
        "run", "-m", str(target_model), "-p", "-", "-n", "10", *GREEDY, stdin="Once upon a time"
    )
    assert piped.stdout == from_flag.stdout == dash.stdout != ""


def test_stop_string_cuts_the_text(target_model: Path) -> None:
    full = specdec("run", "-m", str(target_model), "-p", "Once", "-n", "40", "-q", *GREEDY)
    stop = full.stdout[10:14]
    cut = specdec(
        "run", "-m", str(target_model), "-p", "Once", "-n", "40", "--json", "--stop", stop, *GREEDY
    )
    record = json.loads(cut.stdout)
    assert record["stop_reason"] == "stop"
    assert record["text"] == full.stdout[: full.stdout.index(stop)]


def test_prompts_file_gives_json_lines(
    target_model: Path, draft_model: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nThe little dog\nOnce upon a time\n")
    args = ["run", "-m", str(target_model), "-d", str(draft_model), "--prompts", str(prompts)]
    # -k auto, the default: with sampling it must not follow the clock (the draft
    # lengths decide which random numbers go where), or the reruns below would differ.
    # (-fa pinned: -fa auto's first runs may change their choice, and the logits with it.)
    args += ["-n", "12", "--temp", "1", "--seed", "5", "-t", "1", "-fa", "off"]
    result = specdec(*args)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == [
        "Once upon a time",
        "The little dog",
        "Once upon a time",
    ]
    assert all(r["tokens"] == 12 for r in records)
    # Each prompt has its own random stream: the same prompt twice samples differently...
    assert records[0]["text"] != records[2]["text"]
    # ...and the whole file is reproducible from --seed.
    again = specdec(*args)
    assert [json.loads(line)["text"] for line in again.stdout.splitlines()] == [
        r["text"] for r in records
    ]


def test_closed_pipe_ends_quietly(target_model: Path) -> None:
    command = (
        f"{sys.executable} -m specdec_cli run -m {target_model} -p Once -n 2000 "
        f"-c 256 -t 1 --temp 0 | head -c 5"
    )
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120
    )
    assert len(result.stdout) == 5
    assert "Traceback" not in result.stderr and "Error" not in result.stderr
    assert result.returncode == 0


def test_ctrl_c_prints_stats_and_exits_130(target_model: Path, monkeypatch) -> None:
    real_generate = Engine.pieces

    def interrupted(self, *args, **kwargs):
        for i, piece in enumerate(real_generate(self, *args, **kwargs)):
            if i == 5:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(Engine, "pieces", interrupted)
    result = CliRunner().invoke(
        cli.app, ["run", "-m", str(target_model), "-p", "Once", "-n", "50", *GREEDY]
    )
    assert result.exit_code == 130
    assert "stop: interrupted" in result.stderr
    assert "6 tokens" in result.stderr  # the 6th was generated, then Ctrl-C came


def test_draft_model_with_lookup_first(target_model: Path, draft_model: Path) -> None:
    # (The lookup must earn its turn: this target's text loops only after a while.)
    args = ["-p", "the cat ran to the dog and the cat ran to the", "-n", "200", *GREEDY]
    alone = specdec("run", "-m", str(target_model), "-q", *args)
    both = specdec(
        "run",
        "-m",
        str(target_model),
        "-d",
        str(draft_model),
        "-d",
        "ngram",
        "-k",
        "3",
        "--json",
        *args,
    )
    record = json.loads(both.stdout)
    assert record["text"] == alone.stdout.removesuffix("\n")
    assert record["k"] == "3"
    assert set(record["drafters"]) == {"model", "ngram"}  # each proposed something


def test_two_draft_models_are_refused(target_model: Path, draft_model: Path) -> None:
    result = specdec(
        "run", "-m", str(target_model), "-d", str(draft_model), "-d", str(target_model), "-p", "hi"
    )
    assert_user_error(result, "one draft model")


def test_draft_length_is_auto_by_default(target_model: Path, draft_model: Path) -> None:
    result = specdec(
        "run", "-m", str(target_model), "-d", str(draft_model), "-p", "hi", "-n", "8", "--json"
    )
    assert json.loads(result.stdout)["k"] == "auto"


def test_long_lookup_drafts_on_a_copy_prompt(stories260k: Path) -> None:
    """-d ngram -k 600 on text that repeats a story: drafts are cut to one batch (-b),
    said once, and the text is the target's own."""
    model = ["run", "-m", str(stories260k), *GREEDY]
    story = specdec(*model, "-d", "none", "-p", "Once upon a time", "-n", "200").stdout
    prompt = ["-p", f"Once upon a time{story} Once upon a time", "-n", "150", "-b", "64"]
    runs = [
        specdec(*model, *drafting, *prompt, "--json")
        for drafting in (["-d", "none"], ["-d", "ngram", "-k", "600"])
    ]
    reference, lookup = (json.loads(run.stdout) for run in runs)
    assert lookup["text"] == reference["text"]
    assert max(int(k) for k in lookup["k_histogram"]) == 63
    assert runs[1].stderr.count("drafts stop at 63 tokens") == 1


# --- what a new user hits (issue 11) ---------------------------------------------------------


def test_n_predict_minus_one_means_no_limit(
    target_model: Path, draft_model: Path, tmp_path: Path
) -> None:
    """As in llama.cpp: -1 generates until the model stops or the context is full, from
    the command line or from a config file."""
    config = tmp_path / "models.toml"
    config.write_text(
        f'[pairs.p]\ntarget = "{target_model}"\ndraft = "{draft_model}"\nn_predict = -1\n'
    )
    args = ["-p", "Once", "-c", "48", "--json", *GREEDY]
    for model in (["-m", str(target_model), "-n", "-1"], ["-m", "p", "--config", str(config)]):
        record = json.loads(specdec("run", *model, *args).stdout)
        assert record["stop_reason"] in ("context", "eos")
        assert record["tokens"] > 16
        if record["stop_reason"] == "context":
            assert record["prompt_tokens"] + record["tokens"] == 48


@pytest.mark.parametrize("how", ["-f", "--prompts", "stdin"])
def test_text_that_is_not_utf8_is_replaced_and_said(
    target_model: Path, tmp_path: Path, how: str
) -> None:
    data = "Le café était noir".encode("latin-1")
    args = ["run", "-m", str(target_model), "-n", "4", *GREEDY]
    if how == "stdin":
        data = b"\xff\xfe\x00binary\x80"
    else:
        (tmp_path / "prompt.txt").write_bytes(data + b"\n")
        args += [how, str(tmp_path / "prompt.txt")]
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", *args],
        input=data if how == "stdin" else b"",
        capture_output=True,
        timeout=120,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr
    warnings = [line for line in stderr.splitlines() if "not UTF-8" in line]
    assert len(warnings) == 1 and "U+FFFD" in warnings[0]


def test_each_prompts_record_reruns_alone(target_model: Path, tmp_path: Path) -> None:
    """--prompts: `index` is the line number; `seed` with -p gives the same text."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\nOnce upon a time\n\nThe little dog\n")
    sampled = ["-n", "12", "--temp", "1", "-t", "1"]
    result = specdec("run", "-m", str(target_model), "--prompts", str(prompts), *sampled)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == [2, 4]
    for record in records:
        alone = specdec(
            "run", "-m", str(target_model), "-p", record["prompt"], "--seed",
            str(record["seed"]), *sampled, "--json",
        )  # fmt: skip
        assert json.loads(alone.stdout)["text"] == record["text"]


def test_each_prompts_record_reruns_alone_with_what_auto_learns(
    stories260k: Path, tmp_path: Path
) -> None:
    """-k auto, the lookup beside a model, sampled: what a generation learns (acceptance,
    calibration, who drafts) is its own, so a later line drafts as it would alone."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe little dog\nLily and Tom went to the park\n")
    model = ["-m", str(stories260k), "-d", str(stories260k), "-t", "1"]
    sampled = ["-n", "24", "--temp", "1", "-k", "auto"]
    result = specdec("run", *model, "--prompts", str(prompts), "--seed", "5", *sampled)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 3, result.stderr
    for record in records:
        alone = specdec(
            "run", *model, "-p", record["prompt"], "--seed", str(record["seed"]), *sampled,
            "--json",
        )  # fmt: skip
        rerun = json.loads(alone.stdout)
        assert (rerun["text"], rerun["k_histogram"]) == (record["text"], record["k_histogram"])


def test_picked_seed_is_in_the_summary(target_model: Path) -> None:
    args = ["run", "-m", str(target_model), "-p", "Once", "-n", "12", "--temp", "1", "-t", "1"]
    first = specdec(*args, "--seed", "-1")
    seed = re.search(r"seed (\d+)", first.stderr)
    assert seed, first.stderr
    assert specdec(*args, "--seed", seed[1]).stdout == first.stdout


def test_draft_length_without_a_drafter_is_said(target_model: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-k", "3", "-p", "Once", "-n", "4", *GREEDY)
    assert result.returncode == 0
    assert "-k 3 does nothing without a drafter" in result.stderr


@pytest.mark.parametrize(
    ("flags", "word"),
    [
        (["-d", "none", "-d", "ngram"], "-d none"),
        (["-d", "none", "--ngram"], "-d none"),
        (["-d", "ngram", "--no-ngram"], "--no-ngram"),
    ],
)
def test_no_draft_and_lookup_together_are_refused(
    target_model: Path, flags: list[str], word: str
) -> None:
    assert_user_error(specdec("run", "-m", str(target_model), *flags, "-p", "Once"), word)


@pytest.mark.parametrize(
    ("flags", "drafters"), [([], {"model", "ngram"}), (["--no-ngram"], {"model"})]
)
def test_a_draft_model_comes_with_lookup_unless_turned_off(
    target_model: Path, draft_model: Path, flags: list[str], drafters: set[str]
) -> None:
    """Text that repeats itself (this target's greedy text loops after a while): the
    lookup takes it over from the model, by default."""
    prompt = "the cat ran to the dog and the cat ran to the dog and the cat ran to the"
    args = ["run", "-m", str(target_model), "-d", str(draft_model), "-k", "3", *flags]
    record = json.loads(specdec(*args, "-p", prompt, "-n", "200", "--json", *GREEDY).stdout)
    assert set(record["drafters"]) == drafters


@pytest.mark.parametrize(("flag", "stdin"), [(["-p", ""], ""), ([], ""), ([], "\n")])
def test_empty_prompt_is_refused(target_model: Path, flag: list[str], stdin: str) -> None:
    assert_user_error(specdec("run", "-m", str(target_model), *flag, stdin=stdin), "empty")


def test_first_auto_run_says_it_measures_in_a_log(
    target_model: Path, draft_model: Path, cache: Path
) -> None:
    """stderr is a pipe here: the pause to measure costs is still explained, once a run
    in the runs that measure."""
    args = ["run", "-m", str(target_model), "-d", str(draft_model), "-p", "Once", "-n", "4"]
    for n in range(1, costcache.MEASUREMENTS + 1):
        stderr = specdec(*args, *GREEDY).stderr
        assert stderr.count(f"measuring the models' costs for -k auto ({n} of") == 1
    assert "measuring the models' costs" not in specdec(*args, *GREEDY).stderr


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (["-p", "hello", "--chat"], ["no chat template", "--chat-template"]),
        (["-p", "hello " * 100, "-c", "64"], ["the prompt is", "raise -c"]),
    ],
)
def test_a_bad_prompt_is_told_before_a_first_auto_run_measures(
    target_model: Path, draft_model: Path, cache: Path, prompt: list[str], words: list[str]
) -> None:
    """A first -k auto run pauses to measure costs: a prompt it cannot use is told
    before the wait, not after it."""
    result = specdec("run", "-m", str(target_model), "-d", str(draft_model), *prompt)
    assert_user_error(result, *words)
    assert "measuring the models' costs" not in result.stderr


def test_unknown_option_suggests_only_close_ones() -> None:
    bogus = specdec("run", "--bogus")
    assert_user_error(bogus, "--bogus")
    assert "--verbose" not in bogus.stderr
    assert "--temp" in specdec("run", "--tmep", "1").stderr


def test_bare_command_prints_the_usage() -> None:
    result = specdec()
    assert result.returncode == 2
    assert "error" not in result.stderr
    assert result.stderr.startswith("Usage: specdec") and "run" in result.stderr


@pytest.mark.parametrize("command", ["run", "bench"])
def test_help_says_each_default_once(command: str) -> None:
    text = specdec(command, "--help").stdout
    for bad in ("<bool>", "<list[str]>", "<str>", "{model}", "(default:", "[default: ("):
        assert bad not in text
    options = re.split(r"\n  (?=-)", text.split("\nOptions:\n")[1])
    temp = next(o for o in options if o.startswith("--temp"))
    expected = BenchOptions.temp if command == "bench" else SamplingParams.temp
    assert " ".join(temp.split()).count("default") == 1
    assert f"[default: {expected}]" in " ".join(temp.split())
    for option in options:
        assert " ".join(option.split()).count("[default:") <= 1, option


def test_json_tokens_say_who_chose_each_token(target_model: Path, draft_model: Path) -> None:
    args = ["run", "-m", str(target_model), "-d", str(draft_model), "-k", "3", "--json-tokens"]
    record = json.loads(specdec(*args, "-p", "Once upon a time", "-n", "30", *GREEDY).stdout)
    tokens = record["token_list"]
    assert len(tokens) == record["tokens"] == 30
    assert "".join(t["text"] for t in tokens) == record["text"]
    by = [t["by"] for t in tokens]
    drafted = [b for b in by if b != "target"]
    assert len(drafted) == record["accepted"] > 0
    assert set(drafted) <= {"model", "ngram"}  # a draft model comes with lookup first
    assert by.count("target") == record["target_passes"]  # one of its own per pass


@pytest.mark.parametrize("tree", ["1", "wide"])
def test_bad_tree_is_one_line(target_model: Path, tree: str) -> None:
    result = specdec("run", "-m", str(target_model), "-d", "ngram", "--tree", tree, "-p", "x")
    assert_user_error(result, "--tree must be 'off', 'auto' or a number")
