"""Grammars as text, each read in time linear in its length: whether it is llguidance's
Lark or llama.cpp's GBNF, GBNF written as Lark, and a Lark grammar's rules as
llguidance's compiler recurses through them (see grammar.check_grammar).

llguidance ships both a GBNF converter (`gbnf_to_lark`) and a test for Lark
(`is_lark_syntax`), but hostile input makes them quadratic: the test's regex rescans
every run of blank lines from each line in it, and the converter passes over every rule
once for each link of a chain of rules, copies comments into one growing string and
prints nested brackets level by level. Here a scanner matches one token at a time with
patterns that read each character one way only, and stops at the first string, class or
regex that does not close (where matching on from the next character would read the rest
again). The Lark written is gbnf_to_lark's, character for character, wherever it converts
(see tests/test_grammar_text.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NoReturn

from specdec_cli.errors import UserError

# --- Lark or GBNF

# What shows a grammar is Lark (llguidance's is_lark_syntax), at the start of a line
# after white space.
_LARK_OPENING = re.compile(r"%llguidance\b|start\s*:")
_WHITE_SPACE = re.compile(r"\s+")


def is_lark(text: str) -> bool:
    """llguidance's is_lark_syntax (`(?m)^\\s*(%llguidance\\b|start\\s*:)`), reading each
    run of white space once: the text after a run is tried where the run starts the text
    or holds a line break."""
    if _LARK_OPENING.match(text):
        return True
    for run in _WHITE_SPACE.finditer(text):
        if (run.start() == 0 or "\n" in run.group()) and _LARK_OPENING.match(text, run.end()):
            return True
    return False


# --- GBNF to Lark, as llguidance's gbnf_to_lark writes it

# A character of a string or a class, escapes as gbnf_to_lark reads them.
_ESCAPE = r'\\(?:["\\\[\]nrt]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})'
_LITERAL = re.compile(r'"((?:[^"\\]|' + _ESCAPE + r')*)"')
_CLASS = re.compile(r"\[((?:[^\]\\]|" + _ESCAPE + r")*)\]")
# The longest start of a string or class that reads, to say where one goes wrong.
_LITERAL_START = re.compile(r'"(?:[^"\\]|' + _ESCAPE + r")*")
_CLASS_START = re.compile(r"\[(?:[^\]\\]|" + _ESCAPE + r")*")
# What gbnf_to_lark writes otherwise than it reads: \u and \U without leading zeros, and
# in a class `/` and `[` escaped.
_LITERAL_REWRITES = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|[\s\S])")
_CLASS_REWRITES = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|[\s\S])|[/\[]")
_NAME = re.compile(r"[\w-]+")  # \w: str.isalnum() and "_", as gbnf_to_lark's names
_COUNT = re.compile(r"[0-9]+")
_SPACE = re.compile(r"[ \t]+")
_SPACE_AND_LINES = re.compile(r"[ \t\r\n]+")
_COMMENT = re.compile(r"#[^\r\n]*")
_CAMEL = re.compile(r"([a-z])([A-Z])")
# Between a rule's alternatives where it has several (gbnf_to_lark's top_str).
_RULE_ALTERNATIVES = "\n     | "


def gbnf_to_lark(text: str) -> str:
    """llama.cpp's GBNF as llguidance's Lark, as llguidance.gbnf_to_lark writes it.
    UserError, in one line, where it does not parse."""
    return _GbnfReader(text).lark()


@dataclass
class _Group:
    """Where a group with alternatives prints its brackets and separators (in the
    pieces of its rule), for a rule that is nothing but the group to print them as its
    own alternatives."""

    opening: int
    closing: int
    separators: list[int]


# What an item prints as, for brackets around it: one thing ("atom": a string, a class,
# a rule, a repetition), a sequence of several or none ("sequence"), or alternatives.
_Kind = str | _Group


@dataclass
class _Frame:
    """A rule's body, or a group in it, being read."""

    nested: bool  # a group: line breaks are white space
    opening: int = -1  # the piece that is its "(" if it has alternatives
    separators: list[int] = field(default_factory=list)
    alternatives: int = 1
    items: int = 0  # in the alternative being read
    item_start: int = 0  # the piece before its last item: "(" if a repetition needs it
    last: _Kind = "atom"


@dataclass
class _Rule:
    comment: str
    pieces: list[str | int]  # a piece that is an int: a rule, by number
    refs: list[int]


class _GbnfReader:
    """gbnf_to_lark's parser and printer in one pass: each item is printed as it is
    read, into its rule's pieces, with empty pieces held where brackets or separators
    may go once the group around them is read whole."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.comments: list[str] = []  # read since the last rule
        self.numbers: dict[str, int] = {}  # rules by name, defined or named
        self.rules: dict[int, _Rule] = {}  # the last definition of each, in first order
        self._skip(lines=True)
        while self.pos < len(text):
            self._rule()
            self._skip(lines=True)

    def _number(self, name: str) -> int:
        return self.numbers.setdefault(name, len(self.numbers))

    def _rule(self) -> None:
        name = _NAME.match(self.text, self.pos)
        if name is None:
            self._fail("expected a rule's name")
        self.pos = name.end()
        self._skip(lines=False)
        if not self.text.startswith("::=", self.pos):
            self._fail("expected ::=")
        self.pos += 3
        self._skip(lines=True)
        pieces: list[str | int] = []
        refs: list[int] = []
        self._body(pieces, refs)
        comment = "".join(self.comments)
        self.comments.clear()
        self.rules[self._number(name.group())] = _Rule(comment, pieces, refs)

    def _body(self, pieces: list[str | int], refs: list[int]) -> None:
        """A rule's alternatives, groups within them by a stack of frames (not
        recursion: brackets may nest thousands deep before the depth check)."""
        frames = [_Frame(nested=False)]
        while True:
            frame = frames[-1]
            c = self.text[self.pos] if self.pos < len(self.text) else ""
            if c and c not in "|)" and (frame.nested or c not in "\r\n") and _starts_item(c):
                if frame.items:
                    pieces.append(" ")
                frame.item_start = len(pieces)
                pieces.append("")
                if c == "(":
                    self.pos += 1
                    self._skip(lines=True)
                    frames.append(_Frame(nested=True, opening=len(pieces)))
                    pieces.append("")
                else:
                    self._atom(c, pieces, refs)
                    self._after_item(frame, "atom", pieces)
                continue
            if not frame.items:  # an empty alternative
                pieces.append('""')
            self._skip(lines=frame.nested)
            if self.text.startswith("|", self.pos):
                self.pos += 1
                self._skip(lines=True)
                frame.separators.append(len(pieces))
                pieces.append("")
                frame.alternatives += 1
                frame.items = 0
                continue
            if not frame.nested:
                _print_as_rule(frame, pieces)
                return
            if not self.text.startswith(")", self.pos):
                self._fail("expected ')'")
            self.pos += 1
            frames.pop()
            self._after_item(frames[-1], _close_group(frame, pieces), pieces)

    def _atom(self, c: str, pieces: list[str | int], refs: list[int]) -> None:
        """A string, a class, `.` or a rule's name."""
        if c == '"':
            content = self._match(_LITERAL, _LITERAL_START, "string")
            pieces.append('"' + _LITERAL_REWRITES.sub(_rewrite, content) + '"')
        elif c == "[":
            content = self._match(_CLASS, _CLASS_START, "character class")
            pieces.append("/[" + _CLASS_REWRITES.sub(_rewrite, content) + "]/")
        elif c == ".":
            self.pos += 1
            pieces.append("/./")
        else:
            name = _NAME.match(self.text, self.pos)
            assert name is not None  # (c is a name's character)
            self.pos = name.end()
            number = self._number(name.group())
            pieces.append(number)
            refs.append(number)

    def _match(self, whole: re.Pattern[str], start: re.Pattern[str], what: str) -> str:
        """The content of a string or class at the position, or UserError saying where
        it goes wrong."""
        match = whole.match(self.text, self.pos)
        if match is not None:
            self.pos = match.end()
            return match.group(1)
        stop = start.match(self.text, self.pos)
        assert stop is not None
        self.pos = stop.end()
        if self.pos >= len(self.text):
            self._fail(f"a {what} is not closed")
        escape = self.text[self.pos : self.pos + 2]
        self._fail(f"an escape that is not one of llama.cpp's: {escape!r}")

    def _after_item(self, frame: _Frame, kind: _Kind, pieces: list[str | int]) -> None:
        """White space and a repetition after an item: brackets around the item where it
        is not one thing."""
        frame.items += 1
        self._skip(lines=frame.nested)
        suffix = self._repetition()
        if suffix is not None:
            if kind != "atom":
                pieces[frame.item_start] = "("
                pieces.append(")")
            pieces.append(suffix)
            kind = "atom"
        self._skip(lines=frame.nested)
        frame.last = kind

    def _repetition(self) -> str | None:
        """`*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`, as gbnf_to_lark writes it (None:
        none)."""
        c = self.text[self.pos : self.pos + 1]
        if c and c in "*+?":
            self.pos += 1
            return c
        if c != "{":
            return None
        self.pos += 1
        self._skip(lines=True)
        low = self._count()
        if low is None:
            self._fail("expected a number")
        self._skip(lines=True)
        if self.text.startswith("}", self.pos):
            high: str | None = low
        elif self.text.startswith(",", self.pos):
            self.pos += 1
            self._skip(lines=True)
            high = self._count()
            self._skip(lines=True)
            if not self.text.startswith("}", self.pos):
                self._fail("expected '}'")
        else:
            self._fail("expected ',' or '}'")
        self.pos += 1
        if high is None:
            return {"0": "*", "1": "+"}.get(low, "{" + low + ",}")
        return "?" if (low, high) == ("0", "1") else "{" + low + "," + high + "}"

    def _count(self) -> str | None:
        """A repetition's count, in digits, as int() then str() would write it."""
        digits = _COUNT.match(self.text, self.pos)
        if digits is None:
            return None
        self.pos = digits.end()
        return digits.group().lstrip("0") or "0"

    def _skip(self, lines: bool) -> None:
        """Spaces and tabs, line breaks if `lines`, and comments (kept, as `//` lines
        printed before the rule they are read in, or the next)."""
        text, pos = self.text, self.pos
        blank, space = (" \t\r\n", _SPACE_AND_LINES) if lines else (" \t", _SPACE)
        while pos < len(text):
            if text[pos] in blank:
                pos = space.match(text, pos).end()  # type: ignore[union-attr]
            elif text[pos] == "#":
                end = _COMMENT.match(text, pos).end()  # type: ignore[union-attr]
                self.comments.append("//" + text[pos + 1 : end] + "\n")
                pos = end
            else:
                break
        self.pos = pos

    def _fail(self, problem: str) -> NoReturn:
        raise UserError(f"the grammar does not parse: {problem} ({_line(self.text, self.pos)})")

    def lark(self) -> str:
        """gbnf_to_lark's text: `%llguidance {}`, then each rule (the last definition of
        a name, where its first was) with the comments before it, `root` as `start`,
        rules that reach only strings and classes as terminals (upper case), a blank
        line around each rule of several lines."""
        rules = self.rules
        names = {number: name for name, number in self.numbers.items()}
        for rule in rules.values():
            for ref in rule.refs:
                if ref not in rules:
                    raise UserError(
                        f"the grammar does not parse: rule {names[ref]!r} is not defined"
                    )
        root = self.numbers.get("root", -1)
        if root not in rules:
            raise UserError("the grammar does not parse: it has no rule named root")
        lark_names = _lark_names(rules, names, root)
        parts = ["%llguidance {}\n\n"]
        after_line = True  # the last rule ended with a blank line
        for number, rule in rules.items():
            body = "".join(p if isinstance(p, str) else lark_names[p] for p in rule.pieces)
            text = f"{rule.comment}{lark_names[number]}: {body}"
            several = "\n" in text
            parts.append("\n" * (several and not after_line) + text + "\n" + "\n" * several)
            after_line = several
        return "".join(parts)


def _starts_item(c: str) -> bool:
    return c in '"[(.' or c.isalnum() or c in "-_"


def _rewrite(match: re.Match[str]) -> str:
    """One character of a string or class as gbnf_to_lark writes it."""
    short, long = match.group(1), match.group(2)
    if short is not None:
        return "\\u" + short.lstrip("0")
    if long is not None:
        return "\\U" + long.lstrip("0")
    text = match.group()
    return "\\" + text if text in ("/", "[") else text


def _close_group(frame: _Frame, pieces: list[str | int]) -> _Kind:
    """The closing piece of a group, its brackets and separators where it has
    alternatives, and what it prints as (gbnf_to_lark's simplify: a group of one
    alternative is that alternative, one of one item that item)."""
    closing = len(pieces)
    pieces.append("")
    if frame.alternatives > 1:
        pieces[frame.opening], pieces[closing] = "(", ")"
        for at in frame.separators:
            pieces[at] = " | "
        return _Group(frame.opening, closing, frame.separators)
    return frame.last if frame.items == 1 else "sequence"


def _print_as_rule(frame: _Frame, pieces: list[str | int]) -> None:
    """A rule's alternatives, or those of the group that is the whole rule, one a line."""
    if frame.alternatives > 1:
        separators = frame.separators
    elif frame.items == 1 and isinstance(frame.last, _Group):
        group = frame.last
        pieces[group.opening] = pieces[group.closing] = ""
        separators = group.separators
    else:
        return
    for at in separators:
        pieces[at] = _RULE_ALTERNATIVES


def _lark_names(rules: dict[int, _Rule], names: dict[int, str], root: int) -> dict[int, str]:
    """Each rule's name in Lark: `root` is `start`; `-` becomes `_` and camelCase
    snake_case; terminals upper case, other rules lower. Renamed in gbnf_to_lark's order
    (the root last), refused where a new name is taken."""
    terminals = _terminals(rules, root)
    lark = {number: names[number] for number in rules}
    lark[root] = "start"
    taken = set(lark.values())
    if len(taken) < len(lark):  # a rule named start beside root
        raise UserError("the grammar does not parse: a rule named start beside root")
    for number in [*(n for n in rules if n != root), root]:
        name = _CAMEL.sub(r"\1_\2", lark[number].replace("-", "_")).lower()
        name = name.upper() if number in terminals else name
        if name != lark[number]:
            if name in taken:
                raise UserError(f"the grammar does not parse: two rules are {name!r} in Lark")
            taken.discard(lark[number])
            taken.add(name)
            lark[number] = name
    return lark


def _terminals(rules: dict[int, _Rule], root: int) -> set[int]:
    """gbnf_to_lark's terminal rules (its fixed point): those, the root apart, whose
    every reference is to a terminal rule; found by counting each rule's references
    down as the rules they name are found terminal."""
    waiting = {number: len(rule.refs) for number, rule in rules.items()}
    users: dict[int, list[int]] = {}
    for number, rule in rules.items():
        for ref in rule.refs:
            users.setdefault(ref, []).append(number)
    found = [number for number, count in waiting.items() if count == 0 and number != root]
    terminals = set(found)
    while found:
        for user in users.get(found.pop(), ()):
            waiting[user] -= 1
            if waiting[user] == 0 and user != root:
                terminals.add(user)
                found.append(user)
    return terminals


# --- A Lark grammar's rules

# Lark's tokens as llguidance's lexer reads them, in a form that reads each character one
# way: white space and comments; strings, regular expressions and special tokens,
# passed over whole; keywords followed by a JSON value; names; any other character. Some
# alternative matches at every place, so finditer reads token after token; the start of
# a string or a regular expression that does not close ends the reading.
_LARK_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<comment>(?:\#|//)[^\n]*)
    | (?P<string>"(?:[^"\\]|\\[\s\S])*"i?)
    | (?P<regex>/(?:[^/\\]|\\[\s\S])+/[imslux]*)
    | (?P<special><[^<>\s]+>)
    | (?P<value>%(?:json|llguidance|regex)\b)
    | (?P<name>[!?]?[\w-]+(?:\.[0-9]+)?)
    | (?P<mark>[^"/])
    | (?P<unclosed>["/])
    """,
    re.VERBOSE,
)
_PASSED = ("space", "comment")
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_STRUCTURE = {"(", ")", "[", "]", ":"}
_Token = tuple[str, str]  # a group of _LARK_TOKEN, and the text


class LarkRules:
    """A Lark grammar's rules by number: `weights` (one, and one for each level of
    brackets within the rule), `edges` (each rule to those it names), and `schemas` (its
    `%json` values, decoded: llguidance compiles them as JSON schemas). RecursionError
    where a `%json` value nests past Python's recursion limit."""

    def __init__(self, text: str) -> None:
        tokens, self.schemas = _lark_tokens(text)
        self.names: dict[str, int] = {}
        self.weights: dict[int, int] = {}
        named: dict[int, set[str]] = {}
        rule, depth, i = -1, 0, 0
        while i < len(tokens):
            kind, token = tokens[i]
            defined = _defines(tokens, i) if kind == "name" else -1
            if defined >= 0:
                rule, depth = self._number(token.lstrip("!?").split(".")[0]), 0
                self.weights.setdefault(rule, 1)
                named.setdefault(rule, set())
                i = defined
            elif rule < 0:
                pass
            elif token in ("(", "["):
                depth += 1
                self.weights[rule] = max(self.weights[rule], 1 + depth)
            elif token in (")", "]"):
                depth = max(depth - 1, 0)
            elif kind == "name":
                named[rule].add(token.lstrip("!?"))
            i += 1
        self.edges = {
            rule: {self.names[n] for n in names if n in self.names} for rule, names in named.items()
        }

    def _number(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))

    def depth(self) -> int:
        """The heaviest chain from any rule (llguidance may compile rules the start does
        not reach): from a node before them all."""
        before = len(self.names)
        weights = {**self.weights, before: 0}
        edges = {**self.edges, before: set(self.weights)}
        return heaviest_path(weights, edges, before)


def _lark_tokens(text: str) -> tuple[list[_Token], list[object]]:
    """The tokens that count (not white space nor comments), and the `%json` values.
    UserError where a string or a regular expression does not close, or a keyword's value
    is not JSON: llguidance's lexer refuses both."""
    tokens: list[_Token] = []
    values: list[object] = []
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        for match in _LARK_TOKEN.finditer(text, pos):
            kind = match.lastgroup or ""
            if kind == "value":
                break
            if kind == "unclosed":
                raise UserError(
                    "the grammar does not parse: a string or regular expression is not "
                    f"closed ({_line(text, match.start())})"
                )
            if kind not in _PASSED:
                tokens.append((kind, match.group()))
        else:
            return tokens, values
        start = _JSON_SPACE.match(text, match.end()).end()  # type: ignore[union-attr]
        try:
            value, pos = decoder.raw_decode(text, start)
        except ValueError as e:  # JSONDecodeError, and numbers too long to convert
            raise UserError(
                f"the grammar does not parse: {match.group()} is not followed by JSON "
                f"({_line(text, start)}: {str(e).splitlines()[0]})"
            ) from None
        if match.group() == "%json":
            values.append(value)


def _line(text: str, pos: int) -> str:
    return f"line {text.count(chr(10), 0, pos) + 1}"


def _defines(tokens: list[_Token], i: int) -> int:
    """Where the definition begun by the name at `i` has its `:` (after the name, or
    after attributes in square brackets, `name[max_tokens=5]:`); -1 if the name does
    not define a rule. The attributes hold no brackets, so no token is looked at twice
    for them."""
    j = i + 1
    if j < len(tokens) and tokens[j][1] == "[":
        j += 1
        while j < len(tokens) and tokens[j][1] not in _STRUCTURE:
            j += 1
        if j >= len(tokens) or tokens[j][1] != "]":
            return -1
        j += 1
    return j if j < len(tokens) and tokens[j][1] == ":" else -1


def heaviest_path(weights: dict[int, int], edges: dict[int, set[int]], start: int) -> int:
    """The heaviest path from `start`, each strongly connected set of nodes counted
    whole (Tarjan's algorithm, without recursion: the chains may be thousands long)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []  # of nodes whose set is not finished
    at: dict[int, int] = {}  # each node's place on it
    heaviest: dict[int, int] = {}  # from each node of a finished set
    work: list[tuple[int, Iterator[int]]] = []

    def enter(node: int) -> None:
        index[node] = low[node] = len(index)
        at[node] = len(stack)
        stack.append(node)
        work.append((node, iter(edges[node])))

    enter(start)
    while work:
        node, following = work[-1]
        for child in following:
            if child not in index:
                enter(child)
                break
            if child not in heaviest:  # on the stack
                low[node] = min(low[node], index[child])
        else:
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:  # the root of a strongly connected set
                members = set(stack[at[node] :])
                del stack[at[node] :]
                after = (heaviest[c] for m in members for c in edges[m] if c not in members)
                total = sum(weights[m] for m in members) + max(after, default=0)
                heaviest.update(dict.fromkeys(members, total))
    return heaviest[start]
