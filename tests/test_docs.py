"""The documents hold: every flag they show exists (specdec's in its --help, a benchmark
script's in its argument parser), every relative link and #anchor resolves, and every
figure of README.md's headline tables is one that benchmarks/README.md gives.

The checks read the Markdown and the command line's own declaration (no subprocess), so
they are quick; each is shown to fail on a broken document too."""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import typer

from specdec_cli.commands.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "README.md"
DOCS = [README, RESULTS, ROOT / "benchmarks" / "method.md", *sorted((ROOT / "docs").glob("*.md"))]
HEADLINE = "## What it gains"

# Flags that the documents name for other tools: llama.cpp's own (its tools and
# llama-server), pip's. A flag in backticks that is none of these, nor specdec's, nor a
# benchmark script's, is a mistake.
OTHER_TOOLS_FLAGS = {
    "--spec-type",  # llama.cpp: which drafter
    "--spec-draft-n-max",  # llama.cpp: the draft length
    "--no-cache-dir",  # pip
}
SHELL_OPERATOR = re.compile(r"^[();<>|&]+$")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*")
CMAKE_DEFINE = re.compile(r"^-D[A-Z]")
SPECDEC_COMMAND = re.compile(r"(?<![\w./-])specdec(_cli)? ")
# A benchmark script's --specdec-flags go to one specdec command.
SPECDEC_FLAGS_OF = {"vs_llama_cpp.py": "run", "serve_concurrency.py": "serve"}


# --- reading Markdown ---


def split_code(text: str) -> tuple[str, list[str]]:
    """The prose (fenced blocks blanked out, line numbers kept) and the code blocks'
    logical lines (a line ending in a backslash joined with the next)."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
            continue
        if fenced:
            if code and code[-1].endswith("\\"):
                code[-1] = code[-1][:-1] + " " + line.strip()
            else:
                code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), code


def code_spans(prose: str) -> list[str]:
    """Inline code, which may wrap from one line to the next."""
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but hyphens and
    underscores dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 ... on repeats."""
    prose, _ = split_code(text)
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", prose, re.M):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


# --- flags ---


@cache
def specdec_flags() -> dict[str, frozenset[str]]:
    """Each command's flags as its --help lists them ("" : the top level's)."""
    group = typer.main.get_command(app)
    commands = {"": group, **group.commands}
    return {
        name: frozenset(
            {"-h", "--help"}
            | {
                opt
                for param in command.params
                if not getattr(param, "hidden", False)
                for opt in (*param.opts, *param.secondary_opts)
            }
        )
        for name, command in commands.items()
    }


def any_specdec_flag() -> frozenset[str]:
    return frozenset().union(*specdec_flags().values())


@cache
def any_script_flag() -> frozenset[str]:
    scripts = (ROOT / "benchmarks").glob("*.py")
    return frozenset().union(*(script_flags(path.name) for path in scripts))


@cache
def script_flags(script: str) -> frozenset[str]:
    """A benchmark script's flags, from its add_argument calls and those of the scripts
    beside it that it imports (which add their arguments to its parser)."""
    path = ROOT / "benchmarks" / script
    if not path.is_file():
        return frozenset()
    source = path.read_text(encoding="utf-8")
    calls = re.findall(r"add_argument\(\s*((?:\"-[^\"]+\",\s*)+)", source)
    own = {flag for call in calls for flag in re.findall(r'"(-[^"]+)"', call)}
    for module in re.findall(r"^from (\w+) import", source, re.M):
        if module != path.stem:
            own |= script_flags(f"{module}.py")
    return frozenset({"-h", "--help"} | own)


def tokens(line: str) -> list[str]:
    """A shell line's words and operators; one with an unclosed quote, split on blanks."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:
        return line.split()


def flags_in(words: list[str]) -> list[str]:
    """The flags among a command's words (a quoted word with blanks is a value)."""
    return [
        FLAG.match(w).group()
        for w in words
        if FLAG.match(w) and " " not in w and not CMAKE_DEFINE.match(w)
    ]


def set_variables(line: str, variables: dict[str, str]) -> None:
    """The variables a line sets (NAME=VALUE, NAME=(WORDS ...)), so that the flags they
    hold are checked where they are used."""
    for part in line.split("; "):
        match = re.match(r"^\s*(\w+)=(\(.*\)|\"[^\"]*\"|[^\s$]\S*)\s*(#.*)?$", part)
        if match:
            value = match.group(2)
            quoted = value[:1] + value[-1:] in ("()", '""')
            variables[match.group(1)] = value[1:-1] if quoted else value


def expand(line: str, variables: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return variables.get(name, match.group())

    return re.sub(r'"\$\{(\w+)\[@\]\}"|\$\{(\w+)\}|\$(\w+)', value, line)


def at_command_start(words: list[str], i: int) -> bool:
    """Whether words[i] stands where a command does: first, after an operator or a
    variable's assignment, or as `python -m`'s module."""
    before = words[i - 1] if i else None
    return (
        before is None
        or bool(SHELL_OPERATOR.match(before))
        or bool(re.match(r"^\w+=", before))
        or (before == "-m" and words[i] == "specdec_cli")
        or before == "sudo"
    )


def command_problems(line: str) -> tuple[list[str], int]:
    """What is wrong with the specdec and benchmark commands on a line, and how many it
    holds. A quoted word that is itself a command (a server setup) is read as one."""
    problems: list[str] = []
    words = tokens(line)
    found = 0
    for i, word in enumerate(words):
        inner = re.sub(r"^[\w-]+=(?=\S+ )", "", word)  # NAME=COMMAND, as --setup takes
        if " " in inner and SPECDEC_COMMAND.search(inner):
            more, n = command_problems(inner)
            problems += more
            found += n
        if word in ("specdec", "specdec_cli") and at_command_start(words, i):
            found += 1
            problems += specdec_problems(words[i + 1 :])
        elif word.startswith("benchmarks/") and word.endswith(".py"):
            found += 1
            problems += script_problems(Path(word).name, words[i + 1 :])
    return problems, found


def until_operator(words: list[str]) -> list[str]:
    end = next((i for i, w in enumerate(words) if SHELL_OPERATOR.match(w)), len(words))
    return words[:end]


def specdec_problems(words: list[str]) -> list[str]:
    words = until_operator(words)
    name = words[0] if words and not words[0].startswith("-") else ""
    known = specdec_flags()
    if name not in known:
        return [f"specdec {name}: no such command"]
    flags = flags_in(words[1:] if name else words)
    return [
        f"specdec {name} {flag}: not in its --help" for flag in flags if flag not in known[name]
    ]


def script_problems(script: str, words: list[str]) -> list[str]:
    words = until_operator(words)
    own = script_flags(script)
    if not own:
        return [f"benchmarks/{script}: no such script"]
    problems = [
        f"benchmarks/{script} {flag}: not its flag" for flag in flags_in(words) if flag not in own
    ]
    command = SPECDEC_FLAGS_OF.get(script)
    for flag_at, word in enumerate(words[:-1]):
        if word == "--specdec-flags":
            allowed = specdec_flags()[command] if command else any_specdec_flag()
            problems += [
                f"benchmarks/{script} --specdec-flags {flag}: not a flag of specdec {command}"
                for flag in flags_in(words[flag_at + 1].split())
                if flag not in allowed
            ]
    return problems


def span_problems(span: str) -> list[str]:
    """A code span in prose that starts with a flag names a flag of specdec, of a
    benchmark script, or of another tool the documents name."""
    if not FLAG.match(span):
        return []
    allowed = any_specdec_flag() | any_script_flag() | OTHER_TOOLS_FLAGS
    return [
        f"`{span}`: {flag} is no flag of specdec, of benchmarks/, or of OTHER_TOOLS_FLAGS"
        for flag in flags_in(span.split())
        if flag not in allowed
    ]


def flag_problems(text: str) -> tuple[list[str], int]:
    """Every problem with the flags a document shows, and how many commands it holds."""
    prose, code = split_code(text)
    variables: dict[str, str] = {}
    problems: list[str] = []
    found = 0
    for line in [*code, *code_spans(prose)]:  # in order: a variable is set before it is used
        set_variables(line, variables)
        more, n = command_problems(expand(line, variables))
        problems += more
        found += n
    for span in code_spans(prose):
        if not SPECDEC_COMMAND.search(span):
            problems += span_problems(span)
    return problems, found


# --- links ---


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """Every relative link and #anchor of a document that leads nowhere."""
    text = path.read_text(encoding="utf-8") if text is None else text
    prose, _ = split_code(text)
    problems = []
    for target in re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        destination = (path.parent / file).resolve()
        if file and not destination.exists():
            problems.append(f"{path.name}: ({target}): no file {file}")
        elif anchor and (not file or destination.suffix == ".md"):
            page = destination.read_text(encoding="utf-8") if file else text
            if anchor not in anchors(page):
                problems.append(f"{path.name}: ({target}): no heading #{anchor}")
    return problems


# --- the headline's figures ---


def headline_figures(readme: str) -> list[str]:
    """The figures in the "figure" column of the tables under README's headline."""
    section = readme.split(HEADLINE, 1)[1].split("\n## ", 1)[0]
    figures: list[str] = []
    column = None
    for line in section.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if column is None:
            column = cells.index("figure")
        elif not set(line) <= set("|-: "):
            figures += re.findall(r"\d+\.\d+(?:-\d+\.\d+)?", cells[column])
    return figures


def missing_figures(readme: str, results: str) -> list[str]:
    return [
        f
        for f in headline_figures(readme)
        if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", results)
    ]


# --- the documents ---


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_shown_exists(doc: Path) -> None:
    problems, _ = flag_problems(doc.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_commands_are_found() -> None:
    """The reading finds the commands the pages hold, so that the check above checks them."""
    for doc, at_least in ((README, 20), (RESULTS, 60)):
        assert flag_problems(doc.read_text(encoding="utf-8"))[1] >= at_least, doc


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert link_problems(doc) == []


def test_headline_figures_are_on_the_results_page() -> None:
    readme = README.read_text(encoding="utf-8")
    assert len(headline_figures(readme)) >= 20
    assert missing_figures(readme, RESULTS.read_text(encoding="utf-8")) == []


# --- the checks fail where they should ---


def test_a_made_up_flag_is_caught() -> None:
    good = '```\nspecdec run -m t.gguf -d ngram --tree auto -p "a" | head\n```\n'
    assert flag_problems(good) == ([], 1)
    for bad, named in (
        ("```\nspecdec run -m t.gguf --tree-width 3\n```\n", "--tree-width"),
        ("```\nspecdec worker --api-key K\n```\n", "--api-key"),  # serve's, not worker's
        ("`specdec bench -m t.gguf --temperature 0`", "--temperature"),
        (
            '```\npython3 benchmarks/vs_llama_cpp.py --specdec-flags "-k 3 --alias x"\n```\n',
            "--alias",
        ),
        ('```\nX=(--setup "a=specdec serve -m t --ngram-size 2")\n```\n', "--ngram-size"),
        ("```\npython3 benchmarks/replay_tree.py --curves gpu\n```\n", "--curves"),
        ("use `--draft-lenght 4` for that", "--draft-lenght"),
        ("```\nspecdec generate -p a\n```\n", "generate"),
    ):
        problems, _ = flag_problems(bad)
        assert len(problems) == 1 and named in problems[0], (bad, problems)


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## What `exactly` means\n")
    good = "# Page\n\n## A: b's\n\n[x](#a-bs) [y](other.md#what-exactly-means)\n"
    assert link_problems(page, good) == []
    for bad in ("[x](#a-b)", "[y](other.md#what-exactly)", "[z](missing.md)", "[w](#page-1)"):
        assert len(link_problems(page, good + bad)) == 1, bad
    fenced = good + "```\n[z](missing.md)\n# not a heading\n```\n[w](#not-a-heading)\n"
    assert len(link_problems(page, fenced)) == 1


def test_a_figure_moved_on_one_page_is_caught() -> None:
    readme = README.read_text(encoding="utf-8")
    results = RESULTS.read_text(encoding="utf-8")
    first = headline_figures(readme)[0]
    moved = first[:-1] + str((int(first[-1]) + 1) % 10)
    section_start = readme.index(HEADLINE)
    at = readme.index(first, section_start)
    changed = readme[:at] + moved + readme[at + len(first) :]
    assert missing_figures(changed, results) == [moved]
    assert missing_figures(readme, results.replace(first, moved)) != []
