"""What `specdec bench` runs: plain prompts, or questions in Spec-Bench's and MT-Bench's
format, from a file or a built-in suite.

A question file is JSON Lines, one question a line: {"question_id", "category", "turns"}.
Each question is a conversation: its turns are user messages in the target's chat
format, each asked after the model's own answers to the turns before it, as
Spec-Bench's inference loop asks them. A plain prompt file holds one prompt a line,
given to the model as it is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from specdec_cli.commands.prompts import prompt_lines, read_text
from specdec_cli.errors import UserError
from specdec_cli.models.chat import ChatFormat

QUESTION_SHAPE = '{"question_id": 81, "category": "writing", "turns": ["..."]}'
# Built-in question files: package data under specdec_cli/data (each with its licence).
SUITES = {"spec-bench": ("spec_bench", "question.jsonl")}


@dataclass(frozen=True)
class Question:
    """One item of a workload: a plain prompt (one turn, no category), or a question's
    user turns, in order."""

    name: str
    turns: tuple[str, ...]
    category: str | None = None


@dataclass(frozen=True)
class Workload:
    """The prompts a benchmark runs, and where they came from. `chat`: how the turns
    become a conversation (question files); None: plain prompts, tokenized as written."""

    questions: tuple[Question, ...]
    source: str
    chat: ChatFormat | None = None
    per_category: int | None = None  # --per-category: the first N questions of each

    @property
    def categories(self) -> dict[str, list[int]]:
        """Each category's questions, by their index, in the order categories first
        appear; empty for plain prompts."""
        indices: dict[str, list[int]] = {}
        for i, question in enumerate(self.questions):
            if question.category is not None:
                indices.setdefault(question.category, []).append(i)
        return indices

    @property
    def generations(self) -> int:
        """Generations a variant makes in one repeat: one a turn."""
        return sum(len(q.turns) for q in self.questions)

    def described(self) -> dict[str, object]:
        """The prompts as --json records them: a plain prompt's text, a question's category
        and turns."""
        if self.chat is None:
            return {q.name: q.turns[0] for q in self.questions}
        return {q.name: {"category": q.category, "turns": list(q.turns)} for q in self.questions}


def plain_workload(prompts: dict[str, str], source: str) -> Workload:
    return Workload(tuple(Question(name, (text,)) for name, text in prompts.items()), source)


def choose_workload(
    path: Path | None, suite: str | None, per_category: int | None, builtin: dict[str, str]
) -> Workload:
    """--prompts FILE or --suite NAME (else the `builtin` prompts), with --per-category N."""
    if path is not None and suite is not None:
        raise UserError("--prompts and --suite each give the questions; keep one")
    if suite is not None:
        workload = suite_workload(suite)
    elif path is not None:
        workload = read_workload(path)
    else:
        workload = plain_workload(builtin, "built-in prompts")
    if per_category is None:
        return workload
    if workload.chat is None:
        raise UserError(
            "--per-category needs questions with categories: --suite spec-bench, or a "
            f"question file (.jsonl, one {QUESTION_SHAPE} a line)"
        )
    return first_per_category(workload, per_category)


def first_per_category(workload: Workload, n: int) -> Workload:
    """The first `n` questions of each category, in the file's order: the same subset on
    every run and for every tool given the same file."""
    kept = {i for indices in workload.categories.values() for i in indices[:n]}
    questions = tuple(q for i, q in enumerate(workload.questions) if i in kept)
    return replace(workload, questions=questions, per_category=n)


def suite_workload(name: str) -> Workload:
    if name not in SUITES:
        raise UserError(f"--suite {name}: no such suite; the suites: {', '.join(SUITES)}")
    folder, file = SUITES[name]
    text = resources.files("specdec_cli").joinpath("data", folder, file).read_text("utf-8")
    return Workload(parse_questions(text, f"--suite {name}"), name, ChatFormat())


def read_workload(path: Path) -> Workload:
    """A --prompts file: questions when it ends in .jsonl or its first line is a question
    (a JSON object with "turns"), else one plain prompt a line."""
    text = read_text(path)
    if path.suffix.lower() == ".jsonl" or _starts_with_a_question(text):
        return Workload(parse_questions(text, str(path)), str(path), ChatFormat())
    prompts = {f"line {n}": line for n, line in prompt_lines(text, path).items()}
    return plain_workload(prompts, str(path))


def _starts_with_a_question(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        value = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and "turns" in value


def parse_questions(text: str, origin: str) -> tuple[Question, ...]:
    """Every non-blank line a question; a malformed one is refused, naming its line."""
    questions: list[Question] = []
    lines: dict[str, int] = {}  # a question's name: the line it came from
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        question = _question(line, f"{origin}, line {number}")
        if question.name in lines:
            raise UserError(
                f"{origin}, line {number}: {question.name} is also on line "
                f"{lines[question.name]}; give each question an id of its own"
            )
        lines[question.name] = number
        questions.append(question)
    if not questions:
        raise UserError(f"{origin} has no questions; write one {QUESTION_SHAPE} a line")
    return tuple(questions)


def _question(line: str, where: str) -> Question:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{where} is not JSON ({err.msg}, column {err.colno}); each line is one "
            f"{QUESTION_SHAPE}"
        ) from None
    if not isinstance(item, dict):
        raise UserError(f"{where} is not a JSON object; each line is one {QUESTION_SHAPE}")
    turns, category = item.get("turns"), item.get("category")
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
        raise UserError(f'{where}: "turns" must be a non-empty list of strings (the user turns)')
    if not all(t.strip() for t in turns):
        raise UserError(f"{where}: a turn is empty; every turn needs some text")
    if not isinstance(category, str) or not category:
        raise UserError(f'{where}: "category" must be a non-empty string')
    question_id = item.get("question_id")
    if not isinstance(question_id, int | str) or isinstance(question_id, bool):
        raise UserError(f'{where}: "question_id" must be a number or a string')
    return Question(f"question {question_id}", tuple(turns), category)
