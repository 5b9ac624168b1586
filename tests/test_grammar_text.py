"""Grammars read as text: GBNF written as Lark exactly as llguidance's own converter
writes it, Lark told from GBNF as llguidance tells it, a Lark grammar's rules, and every
pass linear in the grammar's length (hostile grammars at the size limit read in seconds,
where llguidance's converter and a backtracking tokenizer took minutes to hours)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark as llguidance_gbnf_to_lark
from llguidance.gbnf_to_lark import is_lark_syntax

from specdec_cli.decoding.grammar_text import LarkRules, gbnf_to_lark, is_lark
from specdec_cli.errors import UserError

N_GRAMMARS = 1500  # random grammars a run compares (fixed seeds: the same every run)

NAMES = ["root", "a", "b-c", "dE", "f_g", "start", "undefined"]
LITERALS = ['"x"', '"ab"', '""', '"\\n"', '"\\""', '"\\u0041"', '"\\U0001F600"', '"\\x7e"',
            '"/"', '"["', '"é"', '"\\\\"', '"a b"', '"\\t\\r"']  # fmt: skip
CLASSES = ["[a-z]", "[^0-9]", "[/]", "[[]", "[\\]]", "[\\u00e9-\\u00ff]", '["]', "[ \\t]"]
REPEATS = ["", "", "", "*", "+", "?", "{2}", "{0,}", "{1,}", "{0,1}", "{ 2 , 3 }", "{02,3}"]


def random_item(rng: random.Random, names: list[str], depth: int) -> str:
    kind = rng.choice(["literal", "class", "dot", "ref", "ref", "group"][: 6 if depth < 4 else 5])
    if kind == "literal":
        item = rng.choice(LITERALS)
    elif kind == "class":
        item = rng.choice(CLASSES)
    elif kind == "dot":
        item = "."
    elif kind == "ref":
        item = rng.choice(names)
    else:
        space = rng.choice(["", " ", "\n  ", " # note\n "])
        item = f"({space}{random_alternatives(rng, names, depth + 1, nested=True)}{space})"
    return item + rng.choice(REPEATS)


def random_alternatives(rng: random.Random, names: list[str], depth: int, nested: bool) -> str:
    separators = [" | ", "|", " |\n    "] + (["\n  | "] if nested else [])
    space = [" ", "  ", "\t"] + (["\n  "] if nested else [])
    alternatives = [
        rng.choice(space).join(random_item(rng, names, depth) for _ in range(rng.randint(0, 3)))
        for _ in range(rng.choice([1, 1, 2, 3]))
    ]
    return rng.choice(separators).join(alternatives)


def random_gbnf(seed: int) -> str:
    """A grammar of rules that mostly name each other (now and then one not defined, a
    rule defined twice, or named start), with comments, escapes, groups and repetitions."""
    rng = random.Random(seed)
    defined = ["root", *rng.sample(NAMES[1:5], rng.randint(0, 4))]
    if rng.random() < 0.05:
        defined.append(rng.choice(NAMES[5:]))
    referable = defined + (["undefined"] if rng.random() < 0.05 else [])
    rules = []
    for name in rng.sample(defined, len(defined)) + rng.sample(defined, rng.random() < 0.1):
        comment = rng.choice(["", "", "# about it\n", "#\n# two lines\n"])
        trailing = rng.choice(["", "", "  # after it"])
        body = random_alternatives(rng, referable, 0, nested=False)
        rules.append(f"{comment}{name} {rng.choice(['::=', ' ::= '])} {body}{trailing}")
    return rng.choice(["\n", "\r\n", "\n\n"]).join(rules) + rng.choice(["", "\n", "\n# end"])


def converted(convert, text: str) -> str | None:
    try:
        return convert(text)
    except Exception:  # llguidance's converter raises plain Exceptions (and IndexError...)
        return None


def test_gbnf_is_written_as_llguidances_converter_writes_it() -> None:
    same = written = 0
    for seed in range(N_GRAMMARS):
        text = random_gbnf(seed)
        theirs = converted(llguidance_gbnf_to_lark, text)
        try:
            ours: str | None = gbnf_to_lark(text)
        except UserError as error:
            assert "\n" not in str(error)
            ours = None
        assert ours == theirs, text
        same += 1
        written += ours is not None
    assert written > same // 2  # most of them convert: the comparison is of Lark, not errors


GBNF_FRAGMENTS = ["root", " ::= ", "::=", "a", "b-c", "fooBar", "A", "start", " ", "\t", "\n",
                  "\r\n", "\r", "|", "(", ")", '"x"', '"', "[a-z]", "[", "]", "\\", "\\x4",
                  "*", "+", "?", "{2}", "{0,1}", "{", "}", ",", "3", ".", "# c\n", "#", '""',
                  ":"]  # fmt: skip


def test_broken_gbnf_is_refused_where_llguidances_converter_refuses_it() -> None:
    rng = random.Random(0)
    for _ in range(N_GRAMMARS):
        text = "".join(rng.choices(GBNF_FRAGMENTS, k=rng.randint(0, 30)))
        try:
            ours: str | None = gbnf_to_lark(text)
        except UserError:
            ours = None
        assert ours == converted(llguidance_gbnf_to_lark, text), text


def test_lark_is_told_from_gbnf_as_llguidance_tells_it() -> None:
    fragments = [" ", "\t", "\n", "\r", "\r\n", "\x0c", "\u2028", "start", ":", "start:",
                 "start :", "%llguidance", "%llguidancex", "x", "root ::= "]  # fmt: skip
    rng = random.Random(0)
    texts = ["".join(rng.choices(fragments, k=rng.randint(0, 8))) for _ in range(N_GRAMMARS)]
    assert any(map(is_lark, texts)) and not all(map(is_lark, texts))
    for text in texts:
        assert is_lark(text) == is_lark_syntax(text), text


@pytest.mark.parametrize(
    ("grammar", "rules", "depth"),
    [
        ('start: a\na: b "x"\nb: "y"', 3, 3),
        ('start: a\na: "(" # ((( a comment\n  | "b" // (((\nb: /[(]/', 3, 2),
        ('start: x\nx[stop="\\n", max_tokens=3]: y\ny: /.*/', 3, 3),  # attributes
        ("start: x\n?x: y | z\n!y: z\nz.2: /a/", 4, 4),  # inlined, kept, prioritised
        ("start: a [b (c)]\na: b\nb: c\nc: /x/", 4, 6),
        ('start: %json {"type": "object", "properties": {"x": {"type": "string"}}}', 1, 1),
        ('start: a\na: %json {"items": [[[["a", "(", "start"]]]]} | "b"', 2, 2),
        ('start: <[12]> <|end|> a\na: "x"', 2, 2),
    ],
)
def test_lark_rules_as_llguidance_reads_them(grammar: str, rules: int, depth: int) -> None:
    """Strings, regexes, comments (both kinds), `%json` values and special tokens hold
    no rules nor brackets; a rule's attributes and prefixes are not rules."""
    read = LarkRules(grammar)
    assert (len(read.weights), read.depth()) == (rules, depth)


def test_lark_json_values_are_the_schemas() -> None:
    read = LarkRules('start: a\na: %json {"type": "integer"} | %json\n  true\n%llguidance {}')
    assert read.schemas == [{"type": "integer"}, True]


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ('start: "a', ["string or regular expression is not closed", "line 1"]),
        ('start: "a"\nb: /a\\/', ["not closed", "line 2"]),
        ("start: %json {", ["%json is not followed by JSON", "line 1"]),
        ('start: %json {"a": 1' + "1" * 5000 + "}", ["%json is not followed by JSON"]),
    ],
)
def test_lark_that_llguidance_cannot_read_is_one_line(grammar: str, words: list[str]) -> None:
    with pytest.raises(UserError) as error:
        LarkRules(grammar)
    assert "\n" not in str(error.value)
    for word in words:
        assert word in str(error.value)


# Grammars at the size limit whose reading was quadratic or worse: a backtracking
# tokenizer (unclosed brackets, strings, regexes), llguidance's is_lark_syntax (blank
# lines), its converter (a chain of rules ending in a terminal: once over every rule for
# each link; comments), and JSON tried after every %json (each error counting lines).
HOSTILE_SCRIPT = """
import json
from specdec_cli.decoding.grammar import Grammar, MAX_GRAMMAR_BYTES
from specdec_cli.errors import UserError
n = MAX_GRAMMAR_BYTES - 64
chain = "\\n".join(f"r{i} ::= r{i + 1}" for i in range(500)) + '\\nr500 ::= "b"'
many = " ".join(['"a"'] * ((n - len(chain) - 40) // 4))
hostile = {
    "unclosed class": "root ::= " + "[" * n,
    "unclosed string": 'root ::= "' + '\\\\"' * (n // 2),
    "unclosed Lark string": 'start: "' + '\\\\"' * (n // 2),
    "unclosed regex": 'start: "a"\\nx: ' + "/\\\\" * (n // 2),
    "blank lines": "\\n" * n + 'root ::= "a"',
    "comments": "#\\n" * (n // 2) + 'root ::= "a"',
    "many %json": "start: " + "%json " * (n // 6),
    "many %json values": "start: " + "%json {} " * (n // 9),
    "a chain to a terminal": f"root ::= r0 big\\nbig ::= ({many} root)?\\n{chain}",
    "nested groups": "root ::= " + "(" * (n // 2) + ")" * (n // 2),
    "nested optional items": "start: x\\nx: " + "a [" * (n // 3),
    "special tokens": "start: " + "<a" * (n // 2),
}
for name, text in hostile.items():
    assert len(text.encode()) <= MAX_GRAMMAR_BYTES, name
    try:
        Grammar.gbnf(text)
        outcome = "ok"
    except UserError as error:
        outcome = str(error)
    print(json.dumps([name, outcome]))
"""


def test_hostile_grammars_at_the_size_limit_are_read_in_linear_time() -> None:
    """All of them within a generous deadline (a child process, killed past it): each
    took from minutes to hours before."""
    result = subprocess.run(
        [sys.executable, "-c", HOSTILE_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    outcomes = dict(json.loads(line) for line in result.stdout.splitlines())
    assert len(outcomes) == 12
    for name in ("blank lines", "comments", "many %json values", "a chain to a terminal"):
        assert outcomes[name] == "ok", name  # valid grammars: read, and passed on
    assert "not closed" in outcomes["unclosed class"]
    assert "not followed by JSON" in outcomes["many %json"]
    assert "nests too deeply" in outcomes["nested optional items"]
