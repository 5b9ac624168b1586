"""The real Gemma 3 270M base model (Q4_K_M, 262k vocabulary) through specdec: what
holds on a real quantized model, on real text.

Greedy speculative text is not always the target-only text here: llama.cpp's K-quant
kernels give slightly different logits for different batch shapes, and near-ties fall
either way (docs/exactness.md, "llama.cpp's numerics"). What holds, and what a real defect (a
wrong cache position, a lost rewind) breaks by whole logits, is that every emitted
token is the argmax, within a small tolerance, of one pass over the whole text.
Token-for-token equality is tested on the F32 and Q8_0 pairs (test_decode.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest
from conftest import MODERATE_COSTS, pin_costs
from ggufgen import set_u32
from test_cli_run import specdec
from test_server import start

from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.logprobs import LogprobOptions
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model
from specdec_cli.models.chat import ChatFormat, Message, chat_tokens, render

N = 64
# How far llama.cpp's kernels move a logit of this model between batch shapes: near-ties
# fell the other way by up to 1.02 logits here (benchmarks/README.md, "Gemma 3 270M"),
# at 3 % of positions at most across many texts, but one 64-token text under -k auto
# (whose batches follow the clock) once had 7, all within 0.3 logits. A token lost from
# the text costs 4-15 logits.
TIE_TOLERANCE = 1.5
MOST_TIES = N // 8
# Text that repeats itself, so that the lookup has something to draft.
COPY_PROMPT = (
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. "
    "The dog sat on the log. The cat sat on the mat. The dog"
)
STORY_PROMPT = "Once upon a time, there was a little girl named Lily. She"
# The command lines measure nothing: flash attention as given, and a fixed draft length
# (the first three -k auto runs with a model each pause to measure its costs). Both have
# tests of their own, and measured here they would be most of these tests' time.
QUICK = ("-fa", "off", "--tree", "off", "-k", "4")


@pytest.fixture(scope="module")
def engine(gemma3: Path) -> Iterator[Engine]:
    """Gemma, greedy, with n-gram lookup: its decoders run it alone or with the lookup.
    -k auto priced with pinned costs: measuring Gemma's (tested elsewhere) took 13-25 s
    of the first auto test here, and what is tested is the text, whatever the lengths."""
    drafting = DraftOptions(k="auto", tree="off")
    options = EngineOptions(
        target=gemma3, ngram=True, sampling=GREEDY, flash_attn="off", drafting=drafting
    )
    with pytest.MonkeyPatch.context() as patch, Engine(options) as engine:
        pin_costs(patch, MODERATE_COSTS)
        yield engine


def generate(engine: Engine, prompt: str, kind: str | None, k: str) -> tuple[list[int], Stats]:
    tokens = engine.tokenize(prompt)
    stats = Stats()
    decoder = engine.make_decoder(kind, k)
    pieces = engine.pieces(tokens, N, np.random.default_rng(0), stats, decoder=decoder)
    return [p.token for p in pieces if p.token is not None], stats


def argmax_gaps(model: Model, prompt: list[int], generated: list[int]) -> list[float]:
    """For each generated token, how far its logit lies below the row's best, in one
    decode call over the prompt and the text (every row's logits from one batch)."""
    text = prompt + generated
    ctx = Context(model, ContextParams(len(text) + 1, 2, "off", n_batch=len(text)))
    try:
        ctx.decode(text[:-1], 0, n_logits=len(generated))
        gaps = []
        for i, token in enumerate(generated):
            row = ctx.logits(i)
            gaps.append(float(row.max() - row[token]))
        return gaps
    finally:
        ctx.close()


@pytest.mark.parametrize(
    ("prompt", "kind", "k"),
    [
        (STORY_PROMPT, None, "0"),
        (COPY_PROMPT, None, "0"),
        (COPY_PROMPT, "ngram", "4"),
        (COPY_PROMPT, "ngram", "auto"),
        (STORY_PROMPT, "ngram", "auto"),
    ],
)
def test_every_greedy_token_is_the_argmax_of_one_pass(
    engine: Engine, prompt: str, kind: str | None, k: str
) -> None:
    generated, stats = generate(engine, prompt, kind, k)
    assert len(generated) == N
    if kind and prompt is COPY_PROMPT:
        assert stats.accepted > 0  # the lookup drafted, and the target took some of it
    gaps = argmax_gaps(engine.model, engine.tokenize(prompt), generated)
    ties = [(i, round(g, 3)) for i, g in enumerate(gaps) if g > 0]
    assert max(gaps) <= TIE_TOLERANCE and len(ties) <= MOST_TIES, ties


# A record with long keys and an enum (benchmarks/record_schema.json's kind): much of its
# text is forced, the rest the model's choice under the mask.
PERSON = {
    "type": "object",
    "properties": {
        "full_name_of_the_person": {"type": "string", "maxLength": 24},
        "age_in_whole_years": {"type": "integer", "minimum": 0, "maximum": 120},
        "favourite_colour": {"enum": ["red", "green", "blue", "yellow"]},
    },
    "required": ["full_name_of_the_person", "age_in_whole_years", "favourite_colour"],
    "additionalProperties": False,
}
PERSON_PROMPT = "Lily is a girl of seven who loves the sky. Her record as JSON: "


def masked_argmax_gaps(model: Model, prompt: list[int], generated: list[int]) -> list[float]:
    """argmax_gaps under the schema's mask: how far each token's logit lies below the best
    the grammar allows there (inf for a token it forbids)."""
    text = prompt + generated
    ctx = Context(model, ContextParams(len(text) + 1, 2, "off", n_batch=len(text)))
    constraint = Grammar.json_schema(PERSON).start(model)
    try:
        ctx.decode(text[:-1], 0, n_logits=len(generated))
        gaps = []
        for i, token in enumerate(generated):
            row, allowed = ctx.logits(i), constraint.allowed()
            if not allowed[token]:  # the grammar cannot go on past it
                return [*gaps, float("inf")]
            gaps.append(float(row[allowed[: len(row)]].max() - row[token]))
            if not model.is_eog(token):
                constraint.advance([token])
        return gaps
    finally:
        ctx.close()


@pytest.mark.parametrize(("kind", "k"), [(None, "0"), ("ngram", "4"), ("ngram", "auto")])
def test_constrained_greedy_is_the_masked_argmax(engine: Engine, kind: str | None, k: str) -> None:
    """Under a JSON schema: the text parses and validates, and every token is the argmax
    of one pass's row under the grammar's mask, within the tie tolerance."""
    tokens = engine.tokenize(PERSON_PROMPT)
    stats, decoder = Stats(), engine.make_decoder(kind, k)
    grammar = Grammar.json_schema(PERSON)
    rng = np.random.default_rng(0)
    pieces = engine.pieces(tokens, 96, rng, stats, decoder=decoder, grammar=grammar)
    generated = [p.token for p in pieces if p.token is not None]
    assert stats.stop_reason == "eos"  # the record was finished
    text = b"".join(engine.model.piece(t) for t in generated if not engine.model.is_eog(t))
    jsonschema.validate(json.loads(text), PERSON)
    gaps = masked_argmax_gaps(engine.model, tokens, generated)
    ties = [(i, round(g, 3)) for i, g in enumerate(gaps) if g > 0]
    assert max(gaps) <= TIE_TOLERANCE and len(ties) <= MOST_TIES, ties
    damaged = generated[:6] + generated[7:]  # a token lost: somewhere off the mask's argmax
    assert max(masked_argmax_gaps(engine.model, tokens, damaged)) > TIE_TOLERANCE


def test_the_argmax_check_catches_a_lost_token(engine: Engine) -> None:
    """The negative control: the same text with one token lost in the middle (what a
    lost rewind does) is far from the argmax somewhere."""
    generated, _ = generate(engine, STORY_PROMPT, "ngram", "4")
    damaged = generated[: N // 2] + generated[N // 2 + 1 :]
    assert max(argmax_gaps(engine.model, engine.tokenize(STORY_PROMPT), damaged)) > TIE_TOLERANCE


def test_chat_with_its_format_named(gemma3: Path) -> None:
    """The base model has no template: --chat says so, --chat-template gemma formats it."""
    args = ["run", "-m", str(gemma3), "-d", "ngram", "-p", "What is the capital of France?", *QUICK]
    refused = specdec(*args, "--chat", "-n", "4")
    assert refused.returncode == 2
    assert "no chat template" in refused.stderr and "--chat-template" in refused.stderr
    result = specdec(*args, "--chat-template", "gemma", "--temp", "0", "-n", "16", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["tokens"] > 0 or record["stop_reason"] == "eos"
    rendered, prompt = chat_prompt(gemma3, "What is the capital of France?", "gemma")
    assert rendered.startswith("<start_of_turn>user\n") and rendered.endswith("model\n")
    assert prompt.count(prompt[0]) == 1  # BOS, once
    assert record["prompt_tokens"] == len(prompt)


def chat_prompt(path: Path, question: str, template: str) -> tuple[str, list[int]]:
    """A one-question conversation in `template`'s format: its text and its tokens."""
    model = Model(path, vocab_only=True)
    try:
        rendered = render(model, [Message("user", question)], ChatFormat(template))
        return rendered, chat_tokens(model, rendered)
    finally:
        model.close()


def test_stop_string_on_real_text(gemma3: Path) -> None:
    """A stop string taken from the model's own greedy text cuts it just before."""
    args = ["run", "-m", str(gemma3), "-d", "ngram", "-p", COPY_PROMPT, "--temp", "0", *QUICK]
    full = json.loads(specdec(*args, "-n", "24", "--json").stdout)
    stop = full["text"][10:16]
    cut = json.loads(specdec(*args, "-n", "24", "--json", "--stop", stop).stdout)
    assert cut["stop_reason"] == "stop"
    assert cut["text"] == full["text"][: full["text"].index(stop)]


@pytest.fixture(scope="module")
def gemma3_full_stop(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma with "." as its end-of-sequence token. The base model writes on past any
    real end (its <eos> and <end_of_turn> are never its greedy choice here), so the
    test declares a token of its text the end, as a model's metadata does."""
    path = tmp_path_factory.mktemp("gemma-eos") / "gemma-3-270m-eos-full-stop.gguf"
    shutil.copyfile(gemma3, path)
    model = Model(path, vocab_only=True)
    try:
        (full_stop,) = model.tokenize(".", add_special=False)
    finally:
        model.close()
    set_u32(path, "tokenizer.ggml.eos_token_id", full_stop)
    return path


def test_eos_ends_real_text(gemma3_full_stop: Path) -> None:
    """The end-of-sequence token ends generation on real text, and is not printed."""
    args = ["run", "-m", str(gemma3_full_stop), "-d", "ngram", *QUICK, "--temp", "0"]
    question = "What is the capital of France?"
    record = json.loads(specdec(*args, "-n", "64", "-p", question, "--json").stdout)
    assert record["stop_reason"] == "eos"
    assert record["text"] == "\n\nThe capital of France is Paris"


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def assert_a_weather_call(client: openai.OpenAI, choice: object) -> None:
    """tool_choice "required" or named: a call that parses and follows its parameters."""
    reply = client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "How warm is it in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        parallel_tool_calls=False,  # else the base model calls it again and again
        max_tokens=128,
    )
    assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message.content
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tool_choice_makes_gemma_call_a_tool(gemma3: Path, tmp_path: Path) -> None:
    """tool_choice "required" or a named function: the base model, with a ChatML template
    that lists the tools (tools need a Jinja template), replies with a call that parses
    and follows the tool's parameters (the generic JSON format, drafted by the lookup)."""
    from test_grammar import TOOLS_TEMPLATE

    template = tmp_path / "chatml-tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    flags = ("-np", "1", "-t", "0", "--temp", "0", "--chat-template-file", str(template))
    server = start(tmp_path, "-m", str(gemma3), "-d", "ngram", *flags, *QUICK)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
            assert_a_weather_call(client, choice)
    finally:
        assert server.stop() == 0, server.output()


def test_serve_with_the_openai_client(gemma3: Path, tmp_path: Path) -> None:
    """No chat template in the file: the server falls back to ChatML and says so; the
    chat endpoint answers, as do completions, greedy equal to the engine's."""
    # One slot and the machine's threads (test_server's start asks for less).
    quick = ("-np", "1", "-t", "0", *QUICK)
    server = start(tmp_path, "-m", str(gemma3), "-d", "ngram", "--temp", "0", *quick)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8
        )
        assert chat.choices[0].message.content is not None
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(chat_prompt(gemma3, "Name a colour.", "chatml")[1])
        completion = client.completions.create(
            model="gemma", prompt=COPY_PROMPT, max_tokens=16, temperature=0
        )
        text = completion.choices[0].text
        stream = client.completions.create(
            model="gemma", prompt=COPY_PROMPT, max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == text
        assert " sat on the" in text
    finally:
        assert server.stop() == 0, server.output()
    fallback = [line for line in server.output().splitlines() if "no chat template" in line]
    assert len(fallback) == 1 and "chatml" in fallback[0] and "--chat-template" in fallback[0]


def logprobs_of(engine: Engine, prompt: str, kind: str | None, k: str) -> list:
    """Each emitted token's log-probability (and top 5), greedy."""
    decoder, out = engine.make_decoder(kind, k), []
    rounds = decoder.generate(
        engine.tokenize(prompt), N, np.random.default_rng(0), Stats(), GREEDY, LogprobOptions(5)
    )
    for new in rounds:
        out += new.logprobs or []
    return out


def test_log_probabilities_are_the_targets_within_the_tie_tolerance(engine: Engine) -> None:
    """On the K-quant Gemma, a token's log-probability read from its verification row
    equals the target-only run's for the same text, within what a batch's shape moves a
    logit here (the texts may part at a near-tie: compared up to there)."""
    drafted = logprobs_of(engine, COPY_PROMPT, "ngram", "4")
    alone = logprobs_of(engine, COPY_PROMPT, None, "0")
    same = 0
    while same < min(len(drafted), len(alone)) and drafted[same].token == alone[same].token:
        same += 1
    assert same >= 16
    gaps = [abs(d.logprob - a.logprob) for d, a in zip(drafted[:same], alone[:same], strict=True)]
    assert max(gaps) <= TIE_TOLERANCE, max(gaps)
