"""Chat prompts: message files, templates, and BOS, checked against known-good renderings.

Real tokenizers (../shared/vocab) are loaded without weights (vocab_only): that is all
tokenizing and chat formatting need.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import Model
from specdec_cli.models import chat
from specdec_cli.models.chat import ChatFormat, ChatOptions, Message

CONVERSATION = [
    Message("system", "You are terse."),
    Message("user", "Hi"),
    Message("assistant", "Hello!"),
    Message("user", "Name a colour."),
]
# The official formats, written out by hand (Qwen2: ChatML; Gemma: google/gemma-3-*-it,
# where a system message becomes the start of the first user turn).
QWEN2_EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nName a colour.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
GEMMA_EXPECTED = (
    "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nName a colour.<end_of_turn>\n"
    "<start_of_turn>model\n"
)
# google/gemma-3-1b-it's tokenizer.chat_template (its image branch left out).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def jinja_render(template: str, messages: list[Message], bos_token: str) -> str:
    """A template rendered by a real Jinja engine, as Hugging Face's transformers does."""
    jinja2 = pytest.importorskip("jinja2")

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=[{"role": m.role, "content": m.content} for m in messages],
        bos_token=bos_token,
        add_generation_prompt=True,
    )


# --- known-good renderings ---


def test_qwen2_template_from_its_gguf(vocab_model: Callable[[str], Model]) -> None:
    qwen2 = vocab_model("qwen2")
    text = chat.render(qwen2, CONVERSATION)
    assert text == QWEN2_EXPECTED
    assert text == jinja_render(qwen2.chat_template(), CONVERSATION, "")
    tokens = chat.chat_tokens(qwen2, text)
    # Qwen2 adds no BOS: the prompt starts with <|im_start|>, each parsed as one token.
    assert tokens[0] == 151644 and tokens.count(151644) == 5
    assert qwen2.bos not in tokens


def test_gemma_template(vocab_model: Callable[[str], Model]) -> None:
    gemma = vocab_model("gemma-4")
    # As Jinja, the official template writes <bos> itself (chat_tokens keeps one).
    text = chat.render(gemma, CONVERSATION, ChatFormat(GEMMA3_TEMPLATE))
    assert text == "<bos>" + GEMMA_EXPECTED == jinja_render(GEMMA3_TEMPLATE, CONVERSATION, "<bos>")
    # llama.cpp's built-in format, recognised by its markers, leaves BOS to the tokenizer.
    assert chat.render(gemma, CONVERSATION, ChatFormat(GEMMA3_TEMPLATE, jinja=False)) == (
        GEMMA_EXPECTED
    )
    assert chat.render(gemma, CONVERSATION, ChatFormat("gemma")) == GEMMA_EXPECTED


def test_built_in_template_by_name(vocab_model: Callable[[str], Model]) -> None:
    text = chat.render(vocab_model("llama-bpe"), CONVERSATION[:2], ChatFormat("llama3"))
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_a_final_assistant_message_is_continued(vocab_model: Callable[[str], Model]) -> None:
    messages = [Message("user", "Hi"), Message("assistant", "Well,")]
    qwen2 = vocab_model("qwen2")
    turns = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nWell,"
    # Qwen2's own template adds its default system message; llama.cpp's ChatML does not.
    default = "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
    assert chat.render(qwen2, messages) == default + turns
    assert chat.render(qwen2, messages, ChatFormat(jinja=False)) == turns


# --- BOS: added once, as llama-completion adds it ---


@pytest.mark.parametrize(("family", "template"), [("llama-bpe", "llama3"), ("gemma-4", "gemma")])
def test_bos_is_added_when_the_template_does_not_write_it(
    vocab_model: Callable[[str], Model], family: str, template: str
) -> None:
    model = vocab_model(family)
    text = chat.render(model, CONVERSATION, ChatFormat(template))
    tokens = chat.chat_tokens(model, text)
    assert model.add_bos
    assert tokens == [model.bos, *model.tokenize(text, add_special=False)]


def test_bos_written_by_the_template_is_not_doubled(vocab_model: Callable[[str], Model]) -> None:
    """GigaChat's format starts with <s>, Llama 2's BOS, which the vocabulary adds too."""
    llama2 = vocab_model("llama-spm")
    text = chat.render(llama2, CONVERSATION, ChatFormat("gigachat"))
    assert text.startswith("<s>")
    assert llama2.tokenize(text)[:2] == [llama2.bos, llama2.bos]  # what dropping one fixes
    tokens = chat.chat_tokens(llama2, text)
    assert tokens[0] == llama2.bos and tokens[1] != llama2.bos
    assert tokens == llama2.tokenize(text)[1:]


# --- no usable template ---


def test_no_template_and_no_override(vocab_model: Callable[[str], Model]) -> None:
    with pytest.raises(
        UserError,
        match=r"ggml-vocab-llama-bpe\.gguf has no chat template.*"
        r"--chat-template",
    ):
        chat.render(vocab_model("llama-bpe"), CONVERSATION)


def test_template_llama_cpp_does_not_recognise(vocab_model: Callable[[str], Model]) -> None:
    """Gemma 4's own Jinja template matches none of llama.cpp's built-in formats."""
    with pytest.raises(
        UserError,
        match=r"does not recognise the chat template of "
        r"ggml-vocab-gemma-4\.gguf.*drop --no-jinja",
    ):
        chat.render(vocab_model("gemma-4"), CONVERSATION, ChatFormat(jinja=False))


# --- --chat-template ---


def test_template_override_by_name_or_file(tmp_path: Path) -> None:
    assert chat.template_override("chatml") == "chatml"
    path = tmp_path / "gemma.jinja"
    path.write_text(GEMMA3_TEMPLATE)
    assert chat.template_override(str(path)) == GEMMA3_TEMPLATE


def test_template_override_refusals(tmp_path: Path) -> None:
    with pytest.raises(
        UserError,
        match=r"--chat-template chatml2: neither a file nor one of "
        r"llama.cpp's built-in templates \(.*chatml, .*llama3",
    ):
        chat.template_override("chatml2")
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat.template_override(str(path)) == path.read_text()  # as Jinja: any template
    with pytest.raises(UserError, match=r"does not recognise the chat template in .*mine\.jinja"):
        chat.template_override(str(path), use_jinja=False)
    path.write_text("{% for m in messages %}")
    with pytest.raises(UserError, match=r"not valid Jinja .*line 1"):
        chat.template_override(str(path))


# --- --messages ---


def test_messages_are_parsed() -> None:
    text = json.dumps(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "ignored",
            },
        ]
    )
    assert chat.parse_messages(text, "m.json") == (
        Message("system", "Be brief."),
        Message("user", "a\nb"),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[{",
            "m.json is not valid JSON (Expecting property name enclosed in double quotes "
            "at line 1, column 3)",
        ),
        ('{"role": "user"}', "m.json holds a JSON object; --messages takes a JSON list"),
        ('{"messages": []}', 'takes the list itself (the "messages" value of a chat request)'),
        ("[]", "m.json holds an empty list"),
        (
            '[{"role": "user", "content": "a"}, "b"]',
            'm.json: messages[1] is a string, not an object with "role" and "content"',
        ),
        ('[{"content": "a"}]', 'm.json: messages[0] has no "role"'),
        ('[{"role": "user"}]', 'm.json: messages[0] has no "content"'),
        ('[{"role": 1, "content": "a"}]', 'm.json: messages[0]: "role" is a number, not a string'),
        (
            '[{"role": "robot", "content": "a"}]',
            "m.json: messages[0]: unknown role 'robot'; use one of system, user, assistant, tool",
        ),
        (
            '[{"role": "user", "content": null}]',
            'm.json: messages[0]: "content" is a null, not a string or a list of text parts',
        ),
        (
            '[{"role": "user", "content": [{"type": "image_url"}]}]',
            "m.json: messages[0]: content[0] is not a text part",
        ),
        (
            '[{"role": "user", "content": [{"type": "text"}]}]',
            'm.json: messages[0]: content[0] has no "text" string',
        ),
    ],
)
def test_bad_messages_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(UserError) as caught:
        chat.parse_messages(text, "m.json")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_conversation_order() -> None:
    options = ChatOptions(system="S", history=(Message("user", "U1"), Message("assistant", "A1")))
    assert chat.conversation("U2", options) == [
        Message("system", "S"),
        Message("user", "U1"),
        Message("assistant", "A1"),
        Message("user", "U2"),
    ]
    assert chat.conversation(None, options)[-1] == Message("assistant", "A1")


def test_chat_options(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]')
    plain = ChatFormat()
    assert chat.chat_options(False, None, None, "p", plain) is None
    # --system, --messages and a chat template each imply --chat.
    assert chat.chat_options(False, "S", None, "p", plain) == ChatOptions(system="S")
    chatml = ChatFormat("chatml")
    assert chat.chat_options(False, None, None, "p", chatml) == ChatOptions(format=chatml)
    assert chat.chat_options(False, None, str(path), None, plain).history == (
        Message("system", "S"),
        Message("user", "U"),
    )
    with pytest.raises(UserError, match=r"--system and the system message in .*m\.json"):
        chat.chat_options(True, "T", str(path), None, plain)
    with pytest.raises(UserError, match="stdin can feed --messages or -p, not both"):
        chat.chat_options(True, None, "-", "-", plain)
    with pytest.raises(UserError, match=r"messages file not found: .*nope\.json"):
        chat.chat_options(True, None, str(tmp_path / "nope.json"), None, plain)
