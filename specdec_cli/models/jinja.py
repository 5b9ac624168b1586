"""Chat templates as Jinja, the way Hugging Face transformers' apply_chat_template runs
them (templates are written against its conventions), in a sandbox.

The conventions: trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson`
that does not HTML-escape, `raise_exception` and `strftime_now`, and the variables
messages, add_generation_prompt, bos_token, eos_token, tools and documents.

The sandbox: jinja2's ImmutableSandboxedEnvironment keeps a template from Python (no
attribute that starts with "_", so no walk to __class__ or __globals__; no changing
the messages), and there is no loader, so no import, include or file. A template that
computes without end is bounded here: every call, attribute and loop step checks a
deadline, `*` and `**` cannot build huge values, and the output has a size limit.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from specdec_cli.errors import UserError

TIME_LIMIT_S = 5.0
OUTPUT_LIMIT = 16 * 2**20  # characters: far beyond any context's worth of text
_CHECK_EVERY = 1024  # loop steps between two looks at the clock
_MAX_POWER_BITS = 1 << 16
_LONG_NUMBER = re.compile(r"\d{8,}")  # in a format string: a width that may pass OUTPUT_LIMIT
# Calls (str methods, filters) that make their output as wide as they are asked to,
# and those that read widths from a format string.
_WIDENERS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "indent"})
_FORMATTERS = frozenset({"format", "format_map"})


class TemplateRaised(UserError):
    """The template itself stopped: its raise_exception, or an error in what it does."""


class TemplateLimit(SecurityError):
    """A template went past what it may compute (time, or the size of a value)."""


_deadline = threading.local()


def _check_clock() -> None:
    if time.monotonic() > getattr(_deadline, "at", float("inf")):
        raise TemplateLimit(f"it ran for more than {TIME_LIMIT_S:.0f} s")


def _power_bits(base: Any, exponent: Any) -> int:
    """About how many bits base ** exponent takes (0 where that is not integer work)."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent < 0:
        return 0
    return max(base.bit_length(), 1) * exponent


def _check_call(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """What a call may make from little: a width ("a".ljust(10**9), |center, |indent),
    or a width in a format string ("{:>999999999}".format(1), "%999999999d"|format)."""
    if name in _WIDENERS:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > OUTPUT_LIMIT:
                raise TemplateLimit(f"a width of {value} is more than a template may make")
    spec = args[0] if args else None  # the format string: str.format's self, |format's value
    if name in _FORMATTERS and isinstance(spec, str) and _asks_too_wide(spec):
        raise TemplateLimit("a format string asks for more than a template may make")


def _asks_too_wide(spec: str) -> bool:
    """Whether a format string holds a width past OUTPUT_LIMIT."""
    return any(int(number) > OUTPUT_LIMIT for number in _LONG_NUMBER.findall(spec))


def _guarded(name: str, filter_: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that looks at the clock, and at the sizes it is asked for."""

    @functools.wraps(filter_)  # keeps jinja_pass_arg (a context or environment first)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_clock()
        _check_call(name, args, kwargs)
        return filter_(*args, **kwargs)

    return guarded


class _WatchedRange(Sequence[int]):
    """range() for templates: jinja2's size cap, and a look at the clock as it runs."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args)

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):  # type: ignore[override]
        return self._range[index]

    def __iter__(self) -> Iterator[int]:
        for i, value in enumerate(self._range):
            if i % _CHECK_EVERY == 0:
                _check_clock()
            yield value


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_clock()
        name = getattr(__obj, "__name__", "")
        # jinja2 hands a template a string's format method wrapped: the string is the
        # wrapped method's.
        method = getattr(__obj, "__wrapped__", __obj)
        _check_call(name, [getattr(method, "__self__", None), *args], kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Refuse at once: jinja2 would hand back an Undefined that prints as ""."""
        raise SecurityError(f"{attribute!r} of a {type(obj).__name__} is out of a template's reach")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_clock()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_clock()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _power_bits(left, right) > _MAX_POWER_BITS:
            raise TemplateLimit("a power larger than a template may compute")
        if operator == "*":
            sizes = [len(v) for v in (left, right) if isinstance(v, str | list | tuple)]
            counts = [v for v in (left, right) if isinstance(v, int)]
            if sizes and counts and sizes[0] * counts[0] > OUTPUT_LIMIT:
                raise TemplateLimit("a repeated value would be larger than a template may make")
        return super().call_binop(context, operator, left, right)


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain JSON, not HTML-escaped (jinja2's own escapes <, >, &)."""
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    # Compiled templates call filters directly, not through the environment: each is
    # wrapped to look at the clock and at the sizes it is asked for (center, indent).
    env.filters = {name: _guarded(name, f) for name, f in env.filters.items()}
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, range=_WatchedRange
    )
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A template compiled once (a server renders the same one for every request)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise UserError(
            f"the chat template is not valid Jinja ({err.message}, line {err.lineno}); fix "
            "it, or use --no-jinja for llama.cpp's built-in formats"
        ) from None


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The template rendered for these messages; one line naming what went wrong if it
    fails (its own raise_exception, an error in it, or a limit)."""
    template = compile_template(source)
    variables = {
        **(extra or {}),  # --chat-template-kwargs: never in place of the conversation
        "messages": list(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": list(tools) if tools else None,
        "documents": list(documents) if documents else None,
    }
    _deadline.at = time.monotonic() + TIME_LIMIT_S
    parts: list[str] = []
    size = 0
    try:
        for part in template.generate(variables):
            size += len(part)
            if size > OUTPUT_LIMIT:
                raise TemplateLimit(f"its output passed {OUTPUT_LIMIT // 2**20} MiB")
            parts.append(part)
    except TemplateLimit as err:
        raise UserError(f"the chat template was stopped: {err}") from None
    except SecurityError as err:
        raise UserError(f"the chat template was refused: {err}") from None
    except jinja2.TemplateError as err:
        raise TemplateRaised(f"the chat template failed: {err.message or err}") from None
    except (RecursionError, ArithmeticError, TypeError, ValueError, LookupError) as err:
        raise TemplateRaised(f"the chat template failed: {type(err).__name__}: {err}") from None
    finally:
        _deadline.at = float("inf")
    return "".join(parts)
