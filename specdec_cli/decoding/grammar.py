"""Grammars and JSON schemas: the constraint as one more mask on the distributions the
verifier already compares.

A generation with a grammar has a matcher (llguidance's LLMatcher) that follows the
tokens it emits. At every verified position the target's distribution is the masked
one: the tokens the grammar forbids get -inf logits before temperature, top-k, top-p and
min-p, in a scratch copy of the row (llama.cpp's rows are read again, for
log-probabilities). Greedy, a draft token is accepted only if it is the masked argmax;
sampling, rejection sampling compares the masked target with the distribution the draft
token was drawn from (the draft's own, masked where the drafter knows the grammar:
see ModelDrafter.children). A forbidden draft token has p = 0 and is rejected by the
rule; a sampled draft is never cut, which would bias the text.

The matcher advances only on emitted tokens. The masks of the draft's positions are
found by trying the draft's tokens and rolling back (`Constraint.push`, `undo`): while
drafting (a tree's node by node, `follow`ing each one's path from the last's), and again
along the path the verifier walks. Tokens the grammar forces (a key's letters) are
drafted as they are, at probability 1, with no draft call; a lookup's guesses are cut at
the first token the grammar forbids (a deterministic guess may be).

libllama's own GBNF sampler is not used: it checks every candidate (11-79 ms a position
on real vocabularies), aborts the process when a token it rejects is accepted, and has
no undo. llguidance computes a mask in about 0.1 ms and says which tokens are forced.

Hostile input: every grammar, JSON schema and request's tools is refused past
MAX_GRAMMAR_BYTES before anything reads it, and every pass of Python over one is linear in
its length (grammar_text.py reads grammars: llguidance's own GBNF converter is quadratic
on hostile input). llguidance bounds its own work (LLParserLimits: its defaults, e.g.
500,000 symbols a grammar, 50,000 parser items a step), and a grammar that meets a bound
fails in one line. Three things it does not bound are checked here: how deep a JSON
schema's $refs chain (its compiler recurses, and a deep chain overflows the stack: a
segmentation fault, see schema_depth), how deep a grammar's rules chain (the same, see
check_grammar), and a grammar no text completes that fails before the model chooses
anything (see Grammar.check). One that fails later ends its generation with a UserError
(that generation alone: the others decoded in the same step go on, see decode.step); one
that never fails but never ends (`root ::= [a-z] root`) stops at max_tokens, as any
generation does. llguidance compiles in threads of a known stack (on_compile_thread),
never in the thread that asks: the depth bounds hold whatever stack that thread has, and
a server's decode loop only copies a matcher compiled before (Grammar.matcher).
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote

import llama_cpp
import llguidance
import numpy as np

from specdec_cli.decoding.grammar_text import LarkRules, gbnf_to_lark, heaviest_path, is_lark
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import common_prefix
from specdec_cli.llamacpp.model import Model

# The most forced tokens drafted in one round (see forced): a key or a fixed value.
FORCED_MAX = 32
# Whitespace a JSON schema allows between its tokens: llama.cpp's (json-schema-to-grammar's
# SPACE: nothing, a space, or a new line and at most 20 spaces or tabs of indentation).
# llguidance's default, any run of whitespace, lets a model pad forever.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})?"
# The most bytes a grammar, a JSON schema (as compact JSON) or a request's tools may take,
# refused before anything reads them: every later pass is linear in it, and llguidance's
# compile grows with it. Far above what people write (llama.cpp's grammars, JSON's
# among them, are under 2 kB).
MAX_GRAMMAR_BYTES = 256 * 1024
# The deepest a JSON schema may nest, in objects and arrays, counted on through its $refs.
# llguidance compiles a schema by recursion, up to 3.3 kB of stack a level (measured, 1.9.1:
# a chain of 2,500 $refs overflowed a thread's 8 MB and killed the process, 2,000 did
# not). Its JSON reader stops at 128 levels in one piece, but $refs chain pieces without
# limit. A quarter of what overflowed on COMPILE_STACK_BYTES, and far more than real
# schemas nest.
MAX_SCHEMA_DEPTH = 512
# The deepest llguidance may recurse through a grammar's rules, and the most rules. Its
# compiler enters a rule's definition where it first meets the rule, by recursion, as it
# does a schema's $refs (measured, 1.9.1: a chain of 2,500 rules compiled on an 8 MB
# thread stack and 2,750 overflowed it; on 2 MB, 600 and 700; a rule four brackets deep
# costs less than five rules; brackets within one rule it refuses past about 30 levels).
# A quarter of what overflowed on COMPILE_STACK_BYTES, under what overflowed on 2 MB. Its
# compile time grows faster than the number of rules (4,000 0.3 s, 16,000 2.3 s).
MAX_GRAMMAR_DEPTH = 512
MAX_GRAMMAR_RULES = 4000
# The stack of the threads llguidance compiles in, set when each is made: the depth bounds
# above are measured against it. The thread that asks has whatever stack its platform,
# `ulimit -s` or threading.stack_size gave it (a helper thread of the server's event loop,
# the command line's main thread).
COMPILE_STACK_BYTES = 8 * 2**20
# Compiles that go on at once (llguidance lets go of the GIL while it compiles); more
# requests' compiles wait their turn, while the generations already running go on.
COMPILE_THREADS = 4

T = TypeVar("T")


@dataclass(frozen=True)
class Grammar:
    """A constraint as the user gave it: `kind` "gbnf" (llama.cpp's GBNF, or Lark),
    "json_schema", "json_object" (any JSON object) or "lark" (llguidance's Lark, as
    serve's tool calls write it); `text` the grammar or the schema, `compiled`
    llguidance's grammar for it."""

    kind: str
    text: str
    compiled: str
    # llguidance's matcher at the start of the output, for each model it was compiled
    # over (see matcher)
    _starts: dict[int, tuple[Model, llguidance.LLMatcher]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """llama.cpp's GBNF (a grammar already in Lark is taken as it is)."""
        check_bytes("the grammar", text)
        if not text.strip():
            raise UserError("the grammar is empty")
        lark = text if is_lark(text) else gbnf_to_lark(text)
        check_grammar(lark)
        return cls("gbnf", text, llguidance.LLMatcher.grammar_from_lark(lark))

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Grammar:
        if isinstance(schema, str):
            check_bytes("the JSON schema", schema)
            try:
                value = json.loads(schema)
            except ValueError as e:
                raise UserError(f"the JSON schema is not JSON: {_one_line(e)}") from None
            except RecursionError:
                raise UserError(_too_deep(f"over {sys.getrecursionlimit()}")) from None
        else:
            value = schema
            check_json_bytes("the JSON schema", value)
        if not isinstance(value, dict | bool):
            raise UserError("the JSON schema must be a JSON object")
        check_schema_depth(value)
        text = json.dumps(value)
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_pattern": JSON_WHITESPACE}
            )
        except ValueError as e:
            raise UserError(_not_valid("JSON schema", _one_line(e))) from None
        return cls("json_schema", text, compiled)

    @classmethod
    def lark(cls, text: str, kind: str = "lark") -> Grammar:
        """A grammar in llguidance's Lark (see lark_literal for special tokens)."""
        return cls(kind, text, llguidance.LLMatcher.grammar_from_lark(text))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's response_format json_object)."""
        grammar = cls.json_schema({"type": "object"})
        return cls("json_object", grammar.text, grammar.compiled)

    @property
    def what(self) -> str:
        """What the user gave, as messages name it."""
        return "JSON schema" if self.kind.startswith("json") else "grammar"

    def check(self, model: Model) -> None:
        """Raise UserError, in one line, if the grammar is not one llguidance can match
        over `model`'s vocabulary, or if it fails before the model chooses anything.
        Compiled here, in a compile thread, once for this model (see matcher)."""
        on_compile_thread(self._check, model)

    def _check(self, model: Model) -> None:
        matcher = llguidance.LLMatcher
        failed, messages = matcher.validate_grammar_with_warnings(self.compiled, tokenizer(model))
        if failed:  # (warnings, such as unsupported keywords ignored, are not errors)
            raise UserError(_not_valid(self.what, _one_line(messages[0])))
        self._try_start(model)

    def _try_start(self, model: Model) -> None:
        """Refuse now a grammar that fails on the way to the model's first choice: one
        that allows no text (`root ::= root`; its matcher would allow only the end, and
        the output end at once as if complete), or whose forced start has no end
        (`root ::= "a" root`: llguidance's search for forced tokens meets its limit).
        Refused here, a server answers 400 before anything is decoded."""
        constraint = self.start(model)
        constraint.allowed()
        constraint.advance(constraint.forced())
        constraint.allowed()

    def start(self, model: Model) -> Constraint:
        """A generation's matcher, at the start of its output."""
        return Constraint(model, self)

    def matcher(self, model: Model) -> llguidance.LLMatcher:
        """llguidance's matcher at the start of the output: a copy of one compiled once
        for `model`, in a compile thread (by check, before a server queues the request:
        a generation's start in the decode loop then compiles nothing)."""
        entry = self._starts.get(id(model))
        if entry is None or entry[0] is not model:
            entry = self._starts[id(model)] = (model, on_compile_thread(self._compile, model))
        return entry[1].deep_copy()

    def _compile(self, model: Model) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(tokenizer(model), self.compiled, log_level=0)


_compile_pool_thread = threading.local()  # `marked` in the pool's threads


def _mark_compile_thread() -> None:
    _compile_pool_thread.marked = True


_compile_pool = ThreadPoolExecutor(COMPILE_THREADS, "specdec-compile", _mark_compile_thread)
_stack_size_lock = threading.Lock()


def on_compile_thread(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` in a thread whose stack is COMPILE_STACK_BYTES, once it is done (at
    once where this is one). The pool makes a thread only inside submit (where none is
    idle), so each is made while the process's size for new threads is that one."""
    if getattr(_compile_pool_thread, "marked", False):
        return work(*args)
    with _stack_size_lock:
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            future = _compile_pool.submit(work, *args)
        finally:
            threading.stack_size(before)
    return future.result()


def check_bytes(what: str, text: str) -> None:
    """Refuse, in one line, `what` past MAX_GRAMMAR_BYTES in UTF-8."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise UserError(
            f"{what} is {size:,} bytes, over the limit of {MAX_GRAMMAR_BYTES:,} (256 KiB); "
            "make it smaller"
        )


def check_json_bytes(what: str, value: object) -> None:
    """check_bytes for a value read from JSON, written compactly, as a client sends it."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        raise UserError(f"{what} nests too deeply") from None
    check_bytes(what, text)


def check_schema_depth(schema: object) -> None:
    """Raise UserError, in one line, if compiling `schema` could take llguidance deeper
    than MAX_SCHEMA_DEPTH (see schema_depth)."""
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise UserError(_too_deep(str(depth)))


def check_grammar(lark: str) -> None:
    """Raise UserError, in one line, if a Lark grammar has more than MAX_GRAMMAR_RULES
    rules, a chain of rules deeper than MAX_GRAMMAR_DEPTH (LarkRules.depth), or a `%json`
    schema deeper than a JSON schema may be (llguidance compiles them alike), before
    llguidance's compiler sees it."""
    try:
        rules = LarkRules(lark)
    except RecursionError:  # a %json value, past Python's JSON reader
        raise UserError(_too_deep(f"over {sys.getrecursionlimit()}")) from None
    if len(rules.weights) > MAX_GRAMMAR_RULES:
        raise UserError(
            f"the grammar has {len(rules.weights)} rules (at most {MAX_GRAMMAR_RULES}); "
            "make it smaller"
        )
    depth = rules.depth()
    if depth > MAX_GRAMMAR_DEPTH:
        raise UserError(
            f"the grammar nests too deeply: a chain of rules {depth} levels deep, counting "
            f"the brackets within each (at most {MAX_GRAMMAR_DEPTH}); shorten its chains of "
            "rules that refer to the next"
        )
    for schema in rules.schemas:
        check_schema_depth(schema)


def _too_deep(depth: str) -> str:
    return (
        f"the JSON schema nests too deeply: {depth} levels of objects and arrays, counted "
        f"on through its $refs (at most {MAX_SCHEMA_DEPTH}); flatten it or shorten its "
        "chains of $refs"
    )


# The part of a schema that stands for $refs this check cannot follow (a remote one, one
# relative to a nested "$id"): it may lead to any part.
_ANYWHERE = -1


def schema_depth(schema: object) -> int:
    """A depth llguidance's compiler never recurses past on `schema`, in levels of
    nested objects and arrays. It compiles the whole, and each $ref's target the first
    time the $ref is met (once a name: a name met again, or met inside its own target,
    is a reference), all by recursion: so the deepest it goes is along a chain of parts,
    each entered once, each at most its own height. Parts that reach each other (a
    cycle) are counted whole, in any order."""
    parts = _SchemaParts(schema)
    return heaviest_path(parts.weights, parts.edges, id(schema))


class _SchemaParts:
    """A schema's parts (the root, and each $ref's target), by id: `weights` (height,
    times the names it is compiled under) and `edges` (each part to the parts it names
    or holds within it)."""

    def __init__(self, schema: object) -> None:
        self.root = schema
        self.heights: dict[int, int] = {}
        refs, anchors, rebased = self._survey()
        targets = {ref: self._resolve(ref, anchors, rebased) for ref in refs}
        root_height = self.heights.get(id(schema), 0)
        self.weights = {id(schema): root_height}
        for target in targets.values():
            # a part it cannot follow may be any part: as high as the root
            key = id(target) if target is not None else _ANYWHERE
            height = self.heights.get(key, 0) if target is not None else root_height
            self.weights[key] = self.weights.get(key, 0) + height
        self.edges: dict[int, set[int]] = {key: set() for key in self.weights}
        self._link(targets)
        if _ANYWHERE in self.weights:
            self.edges[_ANYWHERE] = set(self.weights) - {_ANYWHERE}

    def _survey(self) -> tuple[set[str], dict[str, object | None], bool]:
        """Every $ref's text, every anchor's part (None: named twice), whether a part
        below the root has an id of its own; and every container's height."""
        refs: set[str] = set()
        anchors: dict[str, object | None] = {}
        rebased = False
        order = list(_containers(self.root))
        for value in order:
            if isinstance(value, dict):
                if isinstance(value.get("$ref"), str):
                    refs.add(value["$ref"])
                for key in ("$anchor", "$dynamicAnchor"):
                    name = value.get(key)
                    if isinstance(name, str):
                        anchors[name] = value if name not in anchors else None
                ids = (value.get("$id"), value.get("id"))
                rebased |= value is not self.root and any(isinstance(i, str) for i in ids)
        for value in reversed(order):  # children before their parents
            below = (self.heights[id(c)] for c in _children(value))
            self.heights[id(value)] = 1 + max(below, default=0)
        return refs, anchors, rebased

    def _resolve(self, ref: str, anchors: dict[str, object | None], rebased: bool) -> object:
        """The part `ref` names (a scalar or a bool where it names one); None where this
        check cannot follow it."""
        if rebased or not ref.startswith("#"):
            return None
        fragment = unquote(ref[1:])
        if not fragment.startswith("/"):
            return anchors.get(fragment) if fragment else self.root
        value: object = self.root
        for token in fragment[1:].split("/"):
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(value, dict) and token in value:
                value = value[token]
            elif isinstance(value, list) and _is_index(token, len(value)):
                value = value[int(token)]
            else:
                return None
        return value

    def _link(self, targets: dict[str, object | None]) -> None:
        """An edge from each part to each part it holds and to each it names, from the
        innermost part around it."""
        stack = [(self.root, id(self.root))]
        while stack:
            value, owner = stack.pop()
            if id(value) in self.weights and value is not self.root:
                self.edges[owner].add(id(value))
                owner = id(value)
            ref = value.get("$ref") if isinstance(value, dict) else None
            if isinstance(ref, str):
                target = targets[ref]
                self.edges[owner].add(id(target) if target is not None else _ANYWHERE)
            stack += [(child, owner) for child in _children(value)]


def _is_index(token: str, length: int) -> bool:
    """Whether a JSON pointer's token indexes an array of `length`: ASCII digits without
    a leading zero (int() also reads other digits, and slowly long ones, past its limit
    in error)."""
    digits = token.isascii() and token.isdigit() and not (token.startswith("0") and token != "0")
    return digits and len(token) <= len(str(length)) and int(token) < length


def _containers(root: object) -> Iterator[object]:
    """Every object and array in `root`, each before what it holds."""
    stack = [root] if isinstance(root, dict | list) else []
    while stack:
        value = stack.pop()
        yield value
        stack += _children(value)


def _children(value: object) -> list[object]:
    """The objects and arrays `value` holds directly."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [item for item in items if isinstance(item, dict | list)]


def lark_literal(model: Model, text: str) -> str:
    """`text` in llguidance's Lark: the special token it is, where the vocabulary has one
    that llguidance sees as special (see _tokenizer: control tokens, and user-defined ones
    in angle brackets), else the string."""
    tokens = model.tokenize(text, add_special=False, parse_special=True)
    if len(tokens) == 1:
        token = tokens[0]
        if _is_special(model.vocab, token, model.token_text(token).encode()):
            return f"<[{token}]>"
    return json.dumps(text)


def _is_special(vocab: Any, token: int, piece: bytes) -> bool:
    attr = llama_cpp.llama_vocab_get_attr(vocab, token)
    if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
        return True
    user_defined = attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    return bool(user_defined) and piece.startswith(b"<") and piece.endswith(b">")


def _one_line(error: object) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines)[:300] or type(error).__name__


def _not_valid(what: str, reason: str) -> str:
    """llguidance's refusal: a limit of its own met (LLParserLimits' max_grammar_size of
    500,000 symbols, its JSON compiler's 50,000 subschemas: "schema too large"), or a
    fault in what the user gave."""
    if "too big" in reason or "too large" in reason:
        return f"the {what} is too large for llguidance ({reason}); make it smaller"
    return f"the {what} is not valid: {reason}"


def _matcher_reason(matcher: llguidance.LLMatcher) -> str:
    """Why a matcher failed, without the parser state it dumps after its reason."""
    return _one_line(matcher.get_error().split("<state>")[0])


_tokenizers: dict[int, tuple[Model, llguidance.LLTokenizer]] = {}
_tokenizers_lock = threading.Lock()


def tokenizer(model: Model) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary, built once per model (1-2 s on a real
    vocabulary), with every end-of-generation token as its EOS (llama_vocab_is_eog)."""
    with _tokenizers_lock:
        entry = _tokenizers.get(id(model))
        if entry is None or entry[0] is not model:
            entry = _tokenizers[id(model)] = (model, _tokenizer(model))
        return entry[1]


def _tokenizer(model: Model) -> llguidance.LLTokenizer:
    """As llguidance.llamacpp.lltokenizer_from_vocab (control tokens marked with a 0xff
    byte), through llama_vocab_get_attr: its llama_token_get_attr warns of deprecation
    once a token."""
    vocab = model.vocab
    size = 16 * 1024
    buffer = ctypes.create_string_buffer(size + 1)
    pieces: list[bytes] = []
    eog: list[int] = []
    for token in range(model.n_vocab):
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
        if n < 0:
            raise ValueError(f"token {token}'s text is longer than {size} bytes")
        piece = buffer.raw[:n]
        if _is_special(vocab, token, piece):
            piece = b"\xff" + piece
        pieces.append(piece)
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            eog.append(token)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=pieces,
        vocab_ptr=vocab,
        tokenize_fptr=tokenize,
        eos_token=eog or [model.eos],
        slices=None,
    )


class Constraint:
    """One generation's matcher. `advance` takes the emitted tokens; `push` tries a
    token beyond them (a draft's), `follow` moves to a path of such tries (a tree's
    node), and `undo` takes every try back."""

    def __init__(self, model: Model, grammar: Grammar) -> None:
        self.model = model
        self.matcher = grammar.matcher(model)
        self.what = grammar.what
        if self.matcher.is_error():
            raise UserError(_not_valid(self.what, _matcher_reason(self.matcher)))
        self.n_emitted = 0  # tokens advanced over, for messages
        self.n_vocab = model.n_vocab
        self._words = np.zeros((self.n_vocab + 31) // 32, np.int32)
        self._tried: list[int] = []  # tokens pushed beyond the emitted ones
        self._scratch = np.empty(self.n_vocab, np.float32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans (end-of-generation tokens
        where the grammar may end)."""
        words = self._mask_words()
        bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=self.n_vocab)
        return bits.view(np.bool_)

    def _mask_words(self) -> np.ndarray:
        """The mask of what may come next, 32 tokens a word (token t: bit t % 32 of word
        t // 32)."""
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self._fail_if_stuck()  # (a failed matcher's mask allows only the end)
        return words

    def certain(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (next after the emitted ones) the grammar allows alone, one
        after another: at each, the mask allows that token and nothing else, not even the
        end. The target's masked distribution there is certain, whatever its logits say.
        (A forced token need not be: a shorter token may spell its start.)"""
        n = 0
        for token in tokens:
            words = self._mask_words().view(np.uint32)
            word, bit = divmod(token, 32)
            if words[word] != 1 << bit or np.count_nonzero(words) != 1 or not self.push(token):
                break
            n += 1
        self.undo()
        return n

    def push(self, token: int) -> bool:
        """Try `token` after the emitted tokens and those pushed since; False (and
        nothing pushed) if the grammar forbids it or it ends the generation. UserError
        where llguidance meets a limit past it (see _failure)."""
        if self.model.is_eog(token) or not self.matcher.validate_tokens([token]):
            return False
        if not self.matcher.consume_token(token):  # allowed, so a limit met
            raise self._failure()
        self._tried.append(token)
        return True

    def follow(self, path: Sequence[int]) -> bool:
        """Stand after the emitted tokens and `path` (tries beyond them), taking back and
        pushing only where the tries so far differ: a tree's nodes come in an order where
        their paths share most of the way. False where the grammar forbids a token of the
        path, or it ends the generation: the matcher then stands before that token."""
        tried = self._tried
        n = common_prefix(tried, path)
        if n < len(tried):
            self.matcher.rollback(len(tried) - n)
            del tried[n:]
        return all(self.push(token) for token in path[n:])

    def undo(self) -> None:
        """Take back every token pushed since the last advance."""
        self.follow(())

    def advance(self, tokens: list[int]) -> None:
        """The round's emitted tokens (no end-of-generation token among them)."""
        self.undo()
        if tokens and not self.matcher.consume_tokens(tokens):
            raise self._failure()
        self.n_emitted += len(tokens)

    def _fail_if_stuck(self) -> None:
        """Raise where the matcher has failed (see _failure): a failed matcher's mask
        allows only the end, which would end the output as if it were complete."""
        if self.matcher.is_error():
            raise self._failure()

    def _failure(self) -> Exception:
        """Why the matcher failed, in one line: the grammar allows nothing after the text
        so far, or llguidance met one of its limits (UserError: the grammar's fault); or
        a forbidden token was emitted (RuntimeError: a defect here). A failed matcher
        stays failed: rollback does not mend it."""
        reason = _matcher_reason(self.matcher)
        # llguidance's words for a token its mask forbade: "... doesn't satisfy the grammar"
        if reason.startswith("Parser Error: token"):
            return RuntimeError(f"grammar: an emitted token was forbidden: {reason}")
        n = self.n_emitted + len(self._tried)
        where = f"after {n} token{'s' * (n != 1)} of output" if n else "at the start of the output"
        if reason == "NoExtensionBias":  # no token may come next, not even the end
            return UserError(f"the {self.what} allows no text {where}: {self._hint('root')}")
        if "ff_tokens" in reason:  # its search for the forced tokens met its item limit
            hint = self._hint('"a" root')
            return UserError(f"the {self.what} forces text without end {where}: {hint} ({reason})")
        return UserError(f"the {self.what} cannot go on {where}: {reason}")

    def _hint(self, example: str) -> str:
        """What to look for in a grammar that cannot be completed."""
        if self.what == "JSON schema":
            return "does a $ref lead back to itself with no way out?"
        return f"does a rule recurse with no alternative that ends (as root ::= {example})?"

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, after the emitted ones (and those pushed), the grammar
        allows in a row."""
        return int(self.matcher.validate_tokens(tokens))

    def forced(self) -> list[int]:
        """The tokens that must come next, whatever the model says (a key's letters, a
        fixed value): each the only token its position's mask allows."""
        forced = self.matcher.compute_ff_tokens()
        self._fail_if_stuck()
        return list(forced[:FORCED_MAX])

    def mask(self, logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """`logits` with every forbidden token at -inf, in a buffer kept for it (valid
        until the next call; the row itself is never written)."""
        n = min(len(logits), self.n_vocab)
        if len(self._scratch) != len(logits):
            self._scratch = np.empty(len(logits), np.float32)
        out = self._scratch
        out.fill(-np.inf)
        np.copyto(out[:n], logits[:n], where=allowed[:n])
        return out

    def argmax(self, logits: np.ndarray, allowed: np.ndarray) -> int:
        """The masked row's argmax (the lowest id among equals, as np.argmax): the row's
        own where the grammar allows it, without a copy."""
        top = int(np.argmax(logits))
        if top < len(allowed) and allowed[top]:
            return top
        return int(np.argmax(self.mask(logits, allowed)))


class PathMasks:
    """The masks of the rows a verifier reads, down one path of a draft: row 0 follows
    the emitted tokens, row j + 1 draft token j. The rows must be asked for in path
    order (each the child of the last), as the verifiers walk them; the tokens on the way
    are pushed, and `close` takes them back."""

    def __init__(self, constraint: Constraint, tokens: list[int], parents: list[int]) -> None:
        self.constraint, self.tokens, self.parents = constraint, tokens, parents
        self._row = 0
        self._off = False  # past an end of generation: nothing more is emitted

    def allowed(self, row: int) -> np.ndarray | None:
        """The mask of `row`; None where anything goes (past an end of generation). Rows
        on the way need not have been asked for (certain rows, which have no logits)."""
        if row != self._row:
            below, node = [], row - 1
            while node != self._row - 1:
                assert node > self._row - 1, "rows are read down one path"
                below.append(node)
                node = self.parents[node]
            for node in reversed(below):
                if not self._off and not self.constraint.push(self.tokens[node]):
                    self._off = True
            self._row = row
        return None if self._off else self.constraint.allowed()

    def masked(self, row: int, logits: np.ndarray) -> np.ndarray:
        """`row`'s logits under its mask (as they are where anything goes)."""
        allowed = self.allowed(row)
        return logits if allowed is None else self.constraint.mask(logits, allowed)

    def close(self) -> None:
        self.constraint.undo()
