"""Chat templates run as Jinja: rendered as references say, by transformers' conventions,
and in a sandbox that hostile templates cannot leave or hang.

References: llama.cpp's own table (tests/test-chat-template.cpp: each template's output
from its C++ Jinja engine for a fixed conversation, extracted into
data/llama_cpp_chat_templates.json), llama.cpp's built-in formats, and the formats the
model cards document. Templates are the models' own: from ../shared/vocab, the real Gemma
3, and llama.cpp's models/templates (copied into data/templates).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from test_chat import GEMMA3_TEMPLATE
from test_cli_run import assert_user_error, specdec
from test_server import start

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import Model, init_backend
from specdec_cli.models import chat, jinja
from specdec_cli.models.chat import ChatFormat, Message
from specdec_cli.serve.reasoning import opens_thinking

DATA = Path(__file__).parent / "data"
LLAMA_CPP_CASES = json.loads((DATA / "llama_cpp_chat_templates.json").read_text(encoding="utf-8"))
# The conversation of llama.cpp's table.
LLAMA_CPP_CONVERSATION = [
    ("system", "You are a helpful assistant"),
    ("user", "Hello"),
    ("assistant", "Hi there"),
    ("user", "Who are you"),
    ("assistant", "   I am an assistant   "),
    ("user", "Another question"),
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def template(name: str) -> str:
    return (DATA / "templates" / name).read_text(encoding="utf-8")


def messages(*pairs: tuple[str, str]) -> list[Message]:
    return [Message(role, content) for role, content in pairs]


# --- references ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [c for c in LLAMA_CPP_CASES if c.get("supported_with_jinja", True)],
    ids=lambda c: c["name"],
)
def test_llama_cpp_s_table(case: dict) -> None:
    conversation = messages(
        *LLAMA_CPP_CONVERSATION, *map(tuple, case.get("extra_conversation", []))
    )
    text = chat.render_jinja(
        case["template_str"],
        conversation,
        bos_token=case.get("bos_token", ""),
        eos_token=case.get("eos_token", ""),
    )
    assert text == (case.get("expected_output_jinja") or case["expected_output"])


def test_gemma3_s_template_renders_as_llama_cpp_s_gemma_format(gemma3: Path) -> None:
    """Gemma 3's instruction template (the base model in the suite has none) on the real
    Gemma 3 vocabulary: the same tokens as llama.cpp's built-in format, one BOS."""
    init_backend()
    model = Model(gemma3, vocab_only=True)
    try:
        conversation = messages(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"))
        conversation.append(Message("user", "A colour?"))
        as_jinja = chat.render(model, conversation, ChatFormat(GEMMA3_TEMPLATE))
        built_in = chat.render(model, conversation, ChatFormat("gemma"))
        assert as_jinja == "<bos>" + built_in  # the template writes BOS; llama.cpp does not
        tokens = chat.chat_tokens(model, as_jinja)
        assert tokens == chat.chat_tokens(model, built_in) and tokens.count(model.bos) == 1
    finally:
        model.close()


def test_gemma4_s_own_template(vocab_model: Callable[[str], Model]) -> None:
    """llama.cpp recognises none of its built-in formats in it: it needs Jinja."""
    gemma4 = vocab_model("gemma-4")
    conversation = messages(("system", "Be brief."), ("user", "Hi"))
    # Thinking off unless asked (enable_thinking undefined, as transformers leaves it):
    # the template closes an empty thought channel.
    turns = "<bos><|turn>system\n{}Be brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    text = chat.render(gemma4, conversation)
    assert text == turns.format("") + "<|channel>thought\n<channel|>"
    thinking = chat.render(gemma4, conversation, ChatFormat(kwargs={"enable_thinking": True}))
    assert thinking == turns.format("<|think|>")
    with pytest.raises(UserError, match="does not recognise the chat template"):
        chat.render(gemma4, messages(("user", "Hi")), ChatFormat(jinja=False))


@pytest.mark.parametrize(
    ("kwargs", "tail"),
    [
        ({}, "<|im_start|>assistant\n"),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)  # fmt: skip
def test_qwen3_thinking_on_and_off(kwargs: dict, tail: str) -> None:
    text = chat.render_jinja(
        template("Qwen-Qwen3-0.6B.jinja"), messages(("user", "Hi")), kwargs=kwargs
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n" + tail


def test_qwen2_5_adds_its_default_system_message() -> None:
    text = chat.render_jinja(template("Qwen-Qwen2.5-7B-Instruct.jinja"), messages(("user", "Hi")))
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_1_with_tools() -> None:
    """Meta's documented JSON tool-calling prompt: tools in the first user turn."""
    text = chat.render_jinja(
        template("meta-llama-Llama-3.1-8B-Instruct.jinja"),
        messages(("user", "Weather in Paris?")),
        bos_token="<|begin_of_text|>",
        tools=[WEATHER_TOOL],
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}.Do not use variables.\n\n"
        + json.dumps(WEATHER_TOOL, indent=4)
        + "\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_mistral_nemo_with_tools() -> None:
    text = chat.render_jinja(
        template("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
        messages(("user", "Weather in Paris?")),
        bos_token="<s>",
        tools=[WEATHER_TOOL],
    )
    tools = json.dumps([WEATHER_TOOL], ensure_ascii=False)
    assert text == f"<s>[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST]"


# DeepSeek's markers are written with FULLWIDTH VERTICAL LINE (U+FF5C).
DEEPSEEK = {
    "BOS": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "EOS": "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "USER": "<\uff5cUser\uff5c>",
    "ASSISTANT": "<\uff5cAssistant\uff5c>",
}


def test_deepseek_r1_drops_earlier_thinking() -> None:
    conversation = messages(
        ("user", "2+2?"), ("assistant", "<think>Easy.</think>4"), ("user", "3+3?")
    )
    text = chat.render_jinja(
        template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
        conversation,
        bos_token=DEEPSEEK["BOS"],
        kwargs={"enable_thinking": True},  # llama.cpp's copy asks (its own default)
    )
    assert "Easy." not in text
    expected = "{BOS}{USER}2+2?{ASSISTANT}4{EOS}{USER}3+3?{ASSISTANT}<think>\n"
    assert text == expected.format(**DEEPSEEK)
    assert opens_thinking(text)  # so the server reads the reply as thinking first


# --- transformers' conventions --------------------------------------------------------------


def render(source: str, **variables: object) -> str:
    return jinja.render(source, [], add_generation_prompt=False, extra=variables)


def test_conventions() -> None:
    # tojson: not HTML-escaped, and with transformers' arguments
    assert render("{{ x|tojson }}", x={"a": "<b>&é"}) == '{"a": "<b>&é"}'
    assert render("{{ x|tojson(indent=2, sort_keys=true) }}", x={"b": 1, "a": 2}) == (
        '{\n  "a": 2,\n  "b": 1\n}'
    )
    assert render("{{ x|tojson(ensure_ascii=true) }}", x="é") == '"\\u00e9"'
    # trim_blocks, lstrip_blocks, loop controls
    assert render("  {% if true %}\nyes\n  {% endif %}\n") == "yes\n"
    loop = "{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}"
    assert render(loop + "{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "02"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    # large numbers as values are fine: only widths are bounded
    assert render("{{ '%s'|format(n) }} {{ '{}'.format(n) }}", n=1700000000) == (
        "1700000000 1700000000"
    )
    # --chat-template-kwargs are variables; they cannot replace the conversation
    assert render("{{ enable_thinking }}", enable_thinking=False) == "False"
    assert jinja.render("{{ messages|length }}", [{"role": "user", "content": "x"}],
                        extra={"messages": []}) == "1"  # fmt: skip


def test_the_template_s_own_error_is_one_line() -> None:
    with pytest.raises(UserError, match="the chat template failed: Roles must alternate"):
        render("{{ raise_exception('Roles must alternate') }}")
    with pytest.raises(UserError, match=r"not valid Jinja \(.*line 1\)"):
        render("{% if %}")


# --- the sandbox ---------------------------------------------------------------------------

HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ joiner.__init__.__globals__['os'].system('touch {marker}') }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ strftime_now.__globals__ }}",
    "{{ range.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ messages.append(1) }}",
    "{{ tojson.__globals__ }}",
    "{% import 'os' as os %}{{ os }}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{% from 'os' import system %}{{ system('touch {marker}') }}",
]


@pytest.mark.parametrize("source", HOSTILE)
def test_hostile_templates_are_refused(source: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    source = source.replace("{marker}", str(marker))
    with pytest.raises(UserError) as refused:
        jinja.render(source, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(refused.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
        "{{ 'x' * 1000000000 }}",
        "{{ [1] * 1000000000 }}",
        "{{ 2 ** 100000000 }}",
        "{% set x = 10 ** 100 %}{{ (x ** 100) ** 100 }}",
        "{{ 'a'.ljust(1000000000) }}",
        "{{ 'a'|center(1000000000) }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '%999999999d'|format(1) }}",
        "{{ 'x'|indent(1000000000) }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}"
        "{% endfor %}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    ],
)
def test_templates_that_would_not_end_are_stopped(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jinja, "TIME_LIMIT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(UserError, match=r"the chat template (was stopped|failed)"):
        jinja.render(source, [])
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "source",
    [
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '{:>99999999}'.format(1) }}",
        "{{ '{x:>999999999}'.format_map({'x': 1}) }}",
        "{{ '%99999999d'|format(1) }}",
    ],
)
def test_a_wide_format_string_is_stopped_before_it_is_filled(source: str) -> None:
    """A string's format method reached the template wrapped by jinja2, so the width check
    never saw its format string: the output limit stopped it only after it had built a
    string of a billion characters. A width past the output limit is refused unbuilt."""
    with pytest.raises(UserError, match="a format string asks for more than a template may make"):
        jinja.render(source, [])


def test_a_system_message_goes_into_the_first_user_turn_where_the_template_has_none() -> None:
    """As llama-server does: the template raises on a system message, or leaves it out."""
    strict = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    silent = (
        "{% for m in messages %}{% if m.role != 'system' %}[{{ m.role }}]{{ m.content }}"
        "{% endif %}{% endfor %}"
    )
    conversation = messages(("system", "S"), ("user", "U"))
    assert chat.render_jinja(strict, conversation) == "[user]S\nU"
    assert chat.render_jinja(silent, conversation) == "[user]S\nU"


# --- Gemma 4 end to end: run --chat and serve -------------------------------------------


def test_gemma4_chat_in_run_and_serve(
    real_vocab_pair: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    """A model that carries Gemma 4's real tokenizer and template (random weights)."""
    target, _ = real_vocab_pair("gemma-4")
    run = specdec("run", "-m", str(target), "--chat", "-p", "Hi", "-n", "4", "--temp", "0",
                  "-q", "--verbose-prompt")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "<|turn>user\nHi<turn|>\n<|turn>model\n" in run.stderr
    assert "prompt (" in run.stderr and "tokens)" in run.stderr
    server = start(tmp_path, "-m", str(target), "-np", "1")
    try:
        reply = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(gemma4_prompt(target))
    finally:
        assert server.stop() == 0, server.output()


def gemma4_prompt(target: Path) -> list[int]:
    model = Model(target, vocab_only=True)
    try:
        return chat.chat_tokens(model, chat.render(model, messages(("user", "Hi"))))
    finally:
        model.close()


def test_template_flags_in_one_line(target_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    base = ["run", "-m", str(target_model), "-p", "Hi", "-n", "2"]
    assert_user_error(specdec(*base, "--chat-template-file", str(bad)), "not valid Jinja")
    assert_user_error(
        specdec(*base, "--chat", "--chat-template-kwargs", "[1]"), "must be a JSON object"
    )
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('no, thank you') }}")
    result = specdec(*base, "--chat-template-file", str(raising))
    assert_user_error(result, "the chat template failed: no, thank you")
