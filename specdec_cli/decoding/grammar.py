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
drafting, and again along the path the verifier walks. Tokens the grammar forces (a
key's letters) are drafted as they are, at probability 1, with no draft call; a lookup's
guesses are cut at the first token the grammar forbids (a deterministic guess may be).
A round under a grammar drafts a chain: a tree's branches would each need a matcher.

libllama's own GBNF sampler is not used: it checks every candidate (11-79 ms a position
on real vocabularies), aborts the process when a token it rejects is accepted, and has
no undo. llguidance computes a mask in about 0.1 ms and says which tokens are forced.
"""

from __future__ import annotations

import ctypes
import json
import threading
from dataclasses import dataclass
from typing import Any

import llama_cpp
import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Model

# The most forced tokens drafted in one round (see forced): a key or a fixed value.
FORCED_MAX = 32
# Whitespace a JSON schema allows between its tokens: llama.cpp's (json-schema-to-grammar's
# SPACE: nothing, a space, or a new line and at most 20 spaces or tabs of indentation).
# llguidance's default, any run of whitespace, lets a model pad forever.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})?"


@dataclass(frozen=True)
class Grammar:
    """A constraint as the user gave it: `kind` "gbnf" (llama.cpp's GBNF, or Lark),
    "json_schema", "json_object" (any JSON object) or "lark" (llguidance's Lark, as
    serve's tool calls write it); `text` the grammar or the schema, `compiled`
    llguidance's grammar for it."""

    kind: str
    text: str
    compiled: str

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """llama.cpp's GBNF (a grammar already in Lark is taken as it is)."""
        if not text.strip():
            raise UserError("the grammar is empty")
        try:
            lark = any_to_lark(text)
        except Exception as e:  # its parser raises plain Exceptions
            raise UserError(f"the grammar does not parse: {_one_line(e)}") from None
        return cls("gbnf", text, llguidance.LLMatcher.grammar_from_lark(lark))

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Grammar:
        if isinstance(schema, str):
            try:
                value = json.loads(schema)
            except ValueError as e:
                raise UserError(f"the JSON schema is not JSON: {_one_line(e)}") from None
        else:
            value = schema
        if not isinstance(value, dict | bool):
            raise UserError("the JSON schema must be a JSON object")
        text = json.dumps(value)
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_pattern": JSON_WHITESPACE}
            )
        except ValueError as e:
            raise UserError(f"the JSON schema is not valid: {_one_line(e)}") from None
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

    def check(self, model: Model) -> None:
        """Raise UserError, in one line, if the grammar is not one llguidance can match
        over `model`'s vocabulary."""
        matcher = llguidance.LLMatcher
        failed, messages = matcher.validate_grammar_with_warnings(self.compiled, tokenizer(model))
        if failed:  # (warnings, such as unsupported keywords ignored, are not errors)
            what = "JSON schema" if self.kind.startswith("json") else "grammar"
            raise UserError(f"the {what} is not valid: {_one_line(messages[0])}")

    def start(self, model: Model) -> Constraint:
        """A generation's matcher, at the start of its output."""
        return Constraint(model, self)


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
    token beyond them (a draft's) and `undo` takes every such try back."""

    def __init__(self, model: Model, grammar: Grammar) -> None:
        self.model = model
        self.matcher = llguidance.LLMatcher(tokenizer(model), grammar.compiled, log_level=0)
        if self.matcher.is_error():
            raise UserError(f"the grammar is not valid: {_one_line(self.matcher.get_error())}")
        self.n_vocab = model.n_vocab
        self._words = np.zeros((self.n_vocab + 31) // 32, np.int32)
        self._tried = 0  # tokens pushed beyond the emitted ones
        self._scratch = np.empty(self.n_vocab, np.float32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans (end-of-generation tokens
        where the grammar may end)."""
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=self.n_vocab)
        return bits.view(np.bool_)

    def push(self, token: int) -> bool:
        """Try `token` after the emitted tokens and those pushed since; False (and
        nothing pushed) if the grammar forbids it or it ends the generation."""
        if self.model.is_eog(token) or not self.matcher.validate_tokens([token]):
            return False
        ok = self.matcher.consume_token(token)
        assert ok, self.matcher.get_error()
        self._tried += 1
        return True

    def undo(self) -> None:
        """Take back every token pushed since the last advance."""
        if self._tried:
            self.matcher.rollback(self._tried)
            self._tried = 0

    def advance(self, tokens: list[int]) -> None:
        """The round's emitted tokens (no end-of-generation token among them)."""
        self.undo()
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(
                f"grammar: an emitted token was forbidden: {self.matcher.get_error()}"
            )

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, after the emitted ones (and those pushed), the grammar
        allows in a row."""
        return int(self.matcher.validate_tokens(tokens))

    def forced(self) -> list[int]:
        """The tokens that must come next, whatever the model says (a key's letters, a
        fixed value): each the only token its position's mask allows."""
        return list(self.matcher.compute_ff_tokens()[:FORCED_MAX])

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
        """The mask of `row`; None where anything goes (past an end of generation)."""
        if row != self._row:
            node = row - 1
            assert self.parents[node] == self._row - 1, "rows are read down one path"
            if not self._off and not self.constraint.push(self.tokens[node]):
                self._off = True
            self._row = row
        return None if self._off else self.constraint.allowed()

    def close(self) -> None:
        self.constraint.undo()
