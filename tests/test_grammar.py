"""Grammars and JSON schemas: the output follows them, and speculation changes nothing of
it (greedy token for token, sampled in distribution), while forced tokens are drafted
for free."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel
from scipy.stats import chi2_contingency
from test_cli_run import assert_user_error, specdec
from test_decode import PROMPT, REPEATING_PROMPT, contingency, open_engine
from test_tools import tool_model  # noqa: F401 (a fixture)

from specdec_cli.decoding import decode, generation
from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.draft import Draft
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.grammar import MAX_GRAMMAR_BYTES, Grammar
from specdec_cli.decoding.logprobs import LogprobOptions
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}
# Long fixed keys: most of the text is forced.
FORCED_SCHEMA = {
    "type": "object",
    "properties": {
        "the_first_long_fixed_key_name": {"type": "integer", "minimum": 0, "maximum": 99},
        "and_another_long_fixed_key_name": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["the_first_long_fixed_key_name", "and_another_long_fixed_key_name"],
    "additionalProperties": False,
}
# No "r": the target's favourite first token after REPEATING_PROMPT (" ran") is forbidden.
NO_R = "root ::= [a-qs-z ]+"
N_PREDICT = 96


def run(
    engine: Engine,
    decoder: Decoder,
    grammar: Grammar | None,
    prompt: str = PROMPT,
    n: int = N_PREDICT,
    seed: int = 0,
) -> tuple[list[int], Stats]:
    stats, out = Stats(), []
    rng = np.random.default_rng(seed)
    tokens = engine.tokenize(prompt)
    for new in decoder.generate(tokens, n, rng, stats, grammar=grammar):
        out += new.tokens
    return out, stats


def text(engine: Engine, tokens: list[int]) -> str:
    return b"".join(engine.model.piece(t) for t in tokens).decode()


@pytest.fixture(scope="module")
def schema_reference(target_model: Path) -> tuple[list[int], str]:
    """Target-only constrained greedy: the tokens and the text."""
    with open_engine(target_model) as engine:
        out, stats = run(engine, engine.decoder, Grammar.json_schema(SCHEMA))
        assert stats.stop_reason == "eos"  # the grammar ran to its end
        return out, text(engine, out)


def test_the_mask_changes_the_greedy_output(target_model: Path, schema_reference) -> None:
    with open_engine(target_model) as engine:
        free, _ = run(engine, engine.decoder, None)
        written = text(engine, free)  # while the model is loaded
    assert free[: len(schema_reference[0])] != schema_reference[0]
    with pytest.raises(ValueError):
        json.loads(written)


def test_target_only_output_follows_the_schema(schema_reference) -> None:
    jsonschema.validate(json.loads(schema_reference[1]), SCHEMA)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("k", ["1", "3"])
def test_greedy_speculative_equals_constrained_target_only(
    target_model: Path, draft_model: Path, schema_reference, drafter: str, k: str
) -> None:
    # 1-gram matches: the schema's short text repeats no two tokens for the lookup to find
    with open_engine(target_model, draft_model, k, tree="off", ngram_min=1) as engine:
        out, stats = run(engine, engine.make_decoder(drafter, k), Grammar.json_schema(SCHEMA))
        assert out == schema_reference[0]
        jsonschema.validate(json.loads(text(engine, out)), SCHEMA)
    assert stats.proposed_by[drafter] > 0  # the drafter drafted, not only the grammar


def drafts_of(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Draft]]:
    """Every draft verified from now on, with the length of the text it follows."""
    drafts: list[tuple[int, Draft]] = []
    stage_round = generation.Generation.stage_round

    def recorded(self: generation.Generation, plan: generation.Plan, draft: Draft) -> None:
        drafts.append((len(self.tokens), draft))
        stage_round(self, plan, draft)

    monkeypatch.setattr(generation.Generation, "stage_round", recorded)
    return drafts


@pytest.mark.parametrize(("drafter", "tree"), [("model", "8"), ("model+ngram", "4")])
def test_greedy_trees_under_a_schema_equal_constrained_target_only(
    target_model: Path,
    draft_model: Path,
    schema_reference,
    drafter: str,
    tree: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trees under a grammar: each node drafted under the mask after its own path (every
    node is one the grammar allows there), and the output is constrained target-only's."""
    drafts = drafts_of(monkeypatch)
    grammar = Grammar.json_schema(SCHEMA)
    with open_engine(target_model, draft_model, 3, tree=tree) as engine:
        prompt = len(engine.tokenize(PROMPT))
        out, stats = run(engine, engine.make_decoder(drafter, "3"), grammar)
        constraint = grammar.start(engine.model)
        trees = [(n, d) for n, d in drafts if d.parents is not None and d.source == "model"]
        assert trees and stats.proposed_by["model"] > 0
        assert out == schema_reference[0]
        for n_before, draft in trees:
            constraint.advance(out[constraint.n_emitted : n_before - prompt])
            for node in range(len(draft.tokens)):
                *before, token = draft.path(node)
                assert constraint.follow(before) and constraint.allowed()[token], (n_before, node)
            constraint.undo()


def test_gbnf_grammar_through_the_engine_options(target_model: Path, draft_model: Path) -> None:
    grammar = Grammar.gbnf('root ::= ("yes" | "no") (" " ("yes" | "no"))*')
    with open_engine(target_model) as engine:
        reference, _ = run(engine, engine.decoder, grammar, n=24)
    options = EngineOptions(
        target=target_model, draft=draft_model, threads=1, sampling=GREEDY, grammar=grammar
    )
    with Engine(options) as engine:
        out, _ = run(engine, engine.make_decoder("model", "3"), None, n=24)
        words = text(engine, out).split()
    assert out == reference
    assert words and set(words) <= {"yes", "no"}


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_forced_tokens_are_drafted_without_draft_calls(
    target_model: Path, draft_model: Path, drafter: str
) -> None:
    grammar = Grammar.json_schema(FORCED_SCHEMA)
    with open_engine(target_model) as engine:
        reference, alone = run(engine, engine.decoder, grammar)
    with open_engine(target_model, draft_model, 1, tree="off") as engine:
        out, stats = run(engine, engine.make_decoder(drafter, "1"), grammar)
        jsonschema.validate(json.loads(text(engine, out)), FORCED_SCHEMA)
    assert out == reference
    # Both keys' letters: certain, all accepted, and no draft model call made for them.
    assert stats.proposed_by["grammar"] >= 40
    assert stats.accepted_by["grammar"] == stats.proposed_by["grammar"]
    assert stats.drafted > 4 * stats.draft_calls
    assert stats.target_passes * 4 < alone.target_passes


def logit_rows_of(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each target verification from now on: its draft's rows (the tokens and one), and
    how many of them the batch gave logits."""
    calls: list[tuple[int, int]] = []
    stage_round = generation.Generation.stage_round

    def counted(self: generation.Generation, plan: generation.Plan, draft: Draft) -> None:
        stage_round(self, plan, draft)
        rows = len(self.draft.tokens) + 1
        calls.append((rows, rows - self._certain))

    monkeypatch.setattr(generation.Generation, "stage_round", counted)
    return calls


def test_certain_rows_are_verified_without_logits(
    target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the grammar allows one token alone, the target's row there is certain: the
    batch asks no logits of it (no output layer), and the text is the same."""
    grammar = Grammar.json_schema(FORCED_SCHEMA)
    with open_engine(target_model) as engine:
        reference, _ = run(engine, engine.decoder, grammar)
    calls = logit_rows_of(monkeypatch)
    with open_engine(target_model, draft_model, 3, tree="off") as engine:
        out, stats = run(engine, engine.make_decoder("model", "3"), grammar)
    assert out == reference
    skipped = sum(rows - with_logits for rows, with_logits in calls)
    assert skipped >= 40  # most of both keys' letters
    assert stats.accepted_by["grammar"] == stats.proposed_by["grammar"] >= skipped


def test_certain_rows_keep_their_logits_for_log_probabilities(
    target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Log-probabilities read every row: a generation that reports them asks logits of
    all, forced rounds too."""
    calls = logit_rows_of(monkeypatch)
    grammar = Grammar.json_schema(FORCED_SCHEMA)
    with open_engine(target_model, draft_model, 3, tree="off") as engine:
        decoder, stats = engine.make_decoder("model", "3"), Stats()
        rng = np.random.default_rng(0)
        prompt = engine.tokenize(PROMPT)
        rounds = list(
            decoder.generate(prompt, 48, rng, stats, logprobs=LogprobOptions(), grammar=grammar)
        )
    assert stats.proposed_by["grammar"] >= 20
    assert all(r.logprobs is not None and len(r.logprobs) == len(r.tokens) for r in rounds)
    assert all(rows == with_logits for rows, with_logits in calls)


SAMPLING = SamplingParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0)
N_RUNS = 1500
N_FIRST = 3


def first_tokens(engine: Engine, decoder: Decoder, grammar: Grammar | None, seeds: range):
    rows = [run(engine, decoder, grammar, REPEATING_PROMPT, N_FIRST, seed)[0] for seed in seeds]
    return np.array(rows)


@pytest.fixture(scope="module")
def constrained_baseline(target_model: Path) -> np.ndarray:
    with open_engine(target_model, sampling=SAMPLING) as engine:
        return first_tokens(engine, engine.decoder, Grammar.gbnf(NO_R), range(N_RUNS))


def alike(a: np.ndarray, b: np.ndarray) -> list[float]:
    """The chi-square p-value of each of the first tokens' positions."""
    return [chi2_contingency(contingency(a[:, i], b[:, i])).pvalue for i in range(N_FIRST)]


@pytest.mark.parametrize(
    ("drafter", "k", "tree"),
    [("model", "3", "off"), ("ngram", "3", "off"), ("model", "1", "off"), ("model", "3", "8")],
)
def test_sampled_speculative_matches_constrained_target(
    target_model: Path,
    draft_model: Path,
    constrained_baseline: np.ndarray,
    drafter: str,
    k: str,
    tree: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grammar = Grammar.gbnf(NO_R)
    seeds = range(N_RUNS, 2 * N_RUNS)
    drafts = drafts_of(monkeypatch)
    with open_engine(target_model, draft_model, k, SAMPLING, tree=tree) as engine:
        decoder = engine.make_decoder(drafter, k)
        speculative = first_tokens(engine, decoder, grammar, seeds)
        _, stats = run(engine, decoder, grammar, REPEATING_PROMPT, 64)
        written = [text(engine, list(row)) for row in speculative]  # while it is loaded
    assert 0.0 < stats.acceptance_rate < 1.0
    assert any(d.parents is not None for _, d in drafts) == (tree != "off")
    assert not any("r" in row for row in written)
    assert contingency(constrained_baseline[:, 0], speculative[:, 0]).shape[1] > 3
    assert min(alike(constrained_baseline, speculative)) > 1e-3


# Forced text first (certain rows, verified without logits), then free words.
FORCED_START = 'root ::= "the dog ran to the cat and" [a-qs-z ]+'


def test_sampled_tokens_after_certain_rows_match_constrained_target(
    target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokens after a forced run verified without logits are drawn from the target's
    row after it (the batch's rows are counted from those with logits)."""
    grammar = Grammar.gbnf(FORCED_START)
    with open_engine(target_model, sampling=SAMPLING) as engine:
        out, _ = run(engine, engine.decoder, grammar, PROMPT, 24)
        spelt = [text(engine, out[:i]) for i in range(len(out))]
        n_forced = spelt.index("the dog ran to the cat and")  # the forced text's tokens
        n = n_forced + N_FIRST
        rows = [run(engine, engine.decoder, grammar, PROMPT, n, seed)[0] for seed in range(N_RUNS)]
    alone = np.array(rows)[:, n_forced - 1 :]
    calls = logit_rows_of(monkeypatch)
    with open_engine(target_model, draft_model, 3, SAMPLING, tree="off") as engine:
        decoder = engine.make_decoder("model", "3")
        seeds = range(N_RUNS, 2 * N_RUNS)
        rows = [run(engine, decoder, grammar, PROMPT, n, seed)[0] for seed in seeds]
    speculative = np.array(rows)[:, n_forced - 1 :]
    assert sum(r - w for r, w in calls) >= N_RUNS * (n_forced - 2)
    assert len(set(speculative[:, 1])) > 3
    assert min(alike(alone[:, 1:], speculative[:, 1:])) > 1e-3


def test_sampled_slots_under_a_grammar_match_constrained_target(
    target_model: Path, draft_model: Path, constrained_baseline: np.ndarray
) -> None:
    """Two slots at once, each under its own matcher, their rounds verified in one call
    and their drafts made in one: each slot's text is drawn from the constrained target's
    distribution, as a generation alone is."""
    from test_slots import parallel_engine

    grammar = Grammar.gbnf(NO_R)
    rows: list[list[int]] = []
    drafted = 0
    with parallel_engine(target_model, draft_model, 2, k=3, sampling=SAMPLING, tree="off") as e:
        prompt = e.tokenize(REPEATING_PROMPT)
        decoders = [e.make_decoder("model", "3", "off", slot=slot) for slot in range(2)]
        for seed in range(N_RUNS, 2 * N_RUNS, 2):
            runs = [
                d.start(prompt, N_FIRST, np.random.default_rng(seed + i), Stats(), grammar=grammar)
                for i, d in enumerate(decoders)
            ]
            outs: list[list[int]] = [[], []]
            while not all(g.finished for g in runs):
                busy = [g for g in runs if not g.finished]
                decode.step(busy)
                for out, g in zip(outs, runs, strict=True):
                    out += g.round.tokens if g in busy and g.round else []
            rows += outs
            drafted += sum(g.stats.drafted for g in runs)
    speculative = np.array(rows)
    assert drafted > 0
    assert min(alike(constrained_baseline, speculative)) > 1e-3


def test_unconstrained_sampling_is_told_apart(
    target_model: Path, constrained_baseline: np.ndarray
) -> None:
    """The negative control: the test above can see a distribution that is not the
    constrained one."""
    with open_engine(target_model, sampling=SAMPLING) as engine:
        free = first_tokens(engine, engine.decoder, None, range(N_RUNS, 2 * N_RUNS))
    assert alike(constrained_baseline, free)[0] < 1e-6


def test_cutting_sampled_drafts_at_a_forbidden_token_is_told_apart(
    target_model: Path,
    draft_model: Path,
    constrained_baseline: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other negative control: a draft model that draws without the mask, its drafts
    cut at the first forbidden token (as a lookup's are), biases the text. The bias scales
    with the draft's forbidden mass and is small, so it draws twice the runs: at 1500 its
    strongest position's p-value sat on the 0.001 threshold."""
    monkeypatch.setattr(generation, "_grammar_drafter", lambda drafter: None)
    monkeypatch.setattr(generation, "LOOKUPS", (*generation.LOOKUPS, "model"))
    with open_engine(target_model, draft_model, 3, SAMPLING, tree="off") as engine:
        decoder = engine.make_decoder("model", "3")
        cut = first_tokens(engine, decoder, Grammar.gbnf(NO_R), range(N_RUNS, 3 * N_RUNS))
    assert min(alike(constrained_baseline, cut)) < 1e-3


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Grammar.json_schema('{"type": "object",'), ["not JSON"]),
        (lambda: Grammar.json_schema("[1, 2]"), ["JSON object"]),
        (lambda: Grammar.gbnf("root ::= foo"), ["foo"]),
        (lambda: Grammar.gbnf(""), ["empty"]),
    ],
)
def test_bad_grammars_are_one_line(make, words: list[str]) -> None:
    with pytest.raises(UserError) as error:
        make()
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_a_schema_llguidance_refuses_is_said_at_load(target_model: Path) -> None:
    with pytest.raises(UserError, match="Invalid type"):
        Grammar.json_schema('{"type": "objectx"}').check(open_model(target_model))


def open_model(path: Path):
    from specdec_cli.llamacpp.model import Model, init_backend

    init_backend()
    return Model(path, vocab_only=True)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["-j", '{"type": "object",'], ["JSON schema", "not JSON"]),
        (["--json-schema", '{"type": "objectx"}'], ["JSON schema", "objectx"]),
        (["--grammar", "root ::= foo"], ["grammar", "foo"]),
        (["--grammar", "root ::= x", "-j", "{}"], ["--grammar", "--json-schema"]),
        (["--json-schema-file", "/nonexistent/schema.json"], ["cannot read"]),
    ],
)
def test_cli_bad_schema_or_grammar_exits_2_in_one_line(
    target_model: Path, flags: list[str], words: list[str]
) -> None:
    result = specdec("run", "-m", str(target_model), "-p", "Hi", "-n", "4", *flags)
    assert_user_error(result, *words)


def test_cli_json_schema_file(target_model: Path, draft_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    args = ["-m", str(target_model), "-d", str(draft_model), "-p", PROMPT, "--temp", "0"]
    result = specdec("run", *args, "-n", "96", "-t", "1", "--json-schema-file", str(path))
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), SCHEMA)


# A Jinja chat template that takes tools, briefly (the tiny models' context is short): the
# generic call format, no call markers.
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def grammar_server(tmp_path_factory: pytest.TempPathFactory, target_model: Path, draft_model: Path):
    from test_server import start

    folder = tmp_path_factory.mktemp("serve-grammar")
    template = folder / "template.jinja"
    template.write_text(TOOLS_TEMPLATE)
    args = ["-m", str(target_model), "-d", str(draft_model), "--chat-template-file", str(template)]
    proc = start(folder, *args, "-np", "2", "--temp", "0")
    yield proc
    assert proc.stop() == 0, proc.output()


def test_serve_response_format_json_schema(grammar_server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{grammar_server.url}/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="t",
            messages=[{"role": "user", "content": "Say something"}],
            max_tokens=N_PREDICT,
            response_format=fmt,  # type: ignore[arg-type]
            stream=stream,
        )
        if stream:
            content = "".join(chunk.choices[0].delta.content or "" for chunk in reply)
        else:
            content = reply.choices[0].message.content or ""
        jsonschema.validate(json.loads(content), SCHEMA)


def test_serve_llama_server_fields(grammar_server, target_model: Path) -> None:
    import httpx

    grammar = Grammar.gbnf('root ::= ("yes" | "no") (" " ("yes" | "no"))*')
    with open_engine(target_model) as engine:
        reference = text(engine, run(engine, engine.decoder, grammar, n=12)[0])
    url = f"{grammar_server.url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(url, json={**body, "grammar": grammar.text}, timeout=60).json()
    assert reply["choices"][0]["text"] == reference
    reply = httpx.post(url, json={**body, "max_tokens": 96, "json_schema": SCHEMA}, timeout=60)
    jsonschema.validate(json.loads(reply.json()["choices"][0]["text"]), SCHEMA)


# A model that answers "Go:" with an object and then runs on past it (see
# ggufgen.scripted_model): the random pair's objects never end (a key of free text).
OBJECT = '{"answer": 42}'
OBJECT_PIECES = ["Go:", OBJECT, " and more"]
OBJECT_SCRIPT = {"Go:": OBJECT, OBJECT: " and more"}


@pytest.fixture(scope="module")
def object_server(tmp_path_factory: pytest.TempPathFactory):
    from ggufgen import scripted_model
    from test_server import start

    folder = tmp_path_factory.mktemp("serve-object")
    model = scripted_model(folder / "object.gguf", OBJECT_PIECES, OBJECT_SCRIPT, TOOLS_TEMPLATE)
    proc = start(folder, "-m", str(model), "-d", "ngram", "--temp", "0")
    yield proc
    assert proc.stop() == 0, proc.output()


def test_serve_json_object_is_a_whole_object(object_server) -> None:
    """The reply parses as a JSON object and ends there; unconstrained, the same model
    writes on past it."""
    json_object = {"response_format": {"type": "json_object"}}
    (choice,) = complete(object_server, {"prompt": "Go:", **json_object}).json()["choices"]
    assert json.loads(choice["text"]) == {"answer": 42}
    assert choice["finish_reason"] == "stop"
    (free,) = complete(object_server, {"prompt": "Go:"}).json()["choices"]
    assert free["text"] == OBJECT + " and more"


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "yaml"}},
        {"json_schema": '{"type": "object",'},
        {"grammar": "root ::= foo"},
        {"grammar": 5},
        {"grammar": 'root ::= "a"', "json_schema": {}},
    ],
)
def test_serve_bad_grammars_are_400_in_one_line(grammar_server, fields: dict) -> None:
    assert_refused(complete(grammar_server, fields))


def complete(server, fields: dict, max_tokens: int = 4, path: str = "completions"):
    """A greedy request with `fields` (a prompt, or messages for chat completions); an
    answer within a minute, or the test fails: a hang must not block the suite."""
    import httpx

    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


def assert_refused(reply, *words: str) -> None:
    """A 400 whose message is one line naming `words`."""
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert message and "\n" not in message
    for word in words:
        assert word in message, message


def test_coupled_sampled_text_equals_constrained_target_only(
    target_model: Path, draft_model: Path
) -> None:
    """Coupled sampling draws each token before anything is drafted: under a grammar too,
    the text for a seed is target-only's, token for token, whoever drafts."""
    coupled = SamplingParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0, coupled=True)
    grammar = Grammar.gbnf(NO_R)
    with open_engine(target_model, draft_model, 3, coupled, tree="off") as engine:
        for seed in range(4):
            alone, _ = run(engine, engine.make_decoder(None, "1"), grammar, seed=seed, n=48)
            for drafter in ("model", "ngram"):
                out, _ = run(engine, engine.make_decoder(drafter, "3"), grammar, seed=seed, n=48)
                assert out == alone, (seed, drafter)
            assert b"r" not in b"".join(engine.model.piece(t) for t in alone)


def test_serve_concurrent_requests_each_follow_their_own_schema(grammar_server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    other = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
    url = f"{grammar_server.url}/v1/completions"

    def ask(schema: dict) -> object:
        body = {"prompt": PROMPT, "max_tokens": 96, "temperature": 0, "json_schema": schema}
        value = json.loads(httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"])
        jsonschema.validate(value, schema)
        return value

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, [SCHEMA, other, SCHEMA, other]))
    assert replies[0] == replies[2] and replies[1] == replies[3]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hybrid Qwen3.5 target with an MTP head (as test_heads.py's)."""
    from ggufgen import Qwen35Params, spm_vocab, write_qwen35_model

    path = tmp_path_factory.mktemp("qwen35-grammar") / "qwen35-mtp.gguf"
    return write_qwen35_model(path, spm_vocab(), Qwen35Params(), seed=1, weak_scale=0.05)


@pytest.mark.parametrize("schema", [SCHEMA, FORCED_SCHEMA], ids=["schema", "forced"])
def test_greedy_mtp_head_under_a_schema(mtp_model: Path, schema: dict) -> None:
    """The head draws under the mask too, and after a round of forced tokens catches up
    on them with the target's states; a hybrid target rolls back as ever."""
    grammar = Grammar.json_schema(schema)

    def engine(head: bool) -> Engine:
        drafting = DraftOptions(k="3", tree="off")
        options = EngineOptions(
            target=mtp_model, head=head, ngram=False, threads=1, flash_attn="off",
            sampling=GREEDY, drafting=drafting,
        )  # fmt: skip
        return Engine(options)

    with engine(False) as alone:
        reference, _ = run(alone, alone.decoder, grammar)
    with engine(True) as speculative:
        out, stats = run(speculative, speculative.decoder, grammar)
    assert out == reference
    assert stats.proposed_by["mtp"] > 0
    if schema is FORCED_SCHEMA:
        assert stats.proposed_by["grammar"] >= 40


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SHOUT = {
    "type": "function",
    "function": {
        "name": "shout",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "enum": ["hey", "ho"]}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"add", "shout"}),
        ({"type": "function", "function": {"name": "shout"}}, {"shout"}),
    ],
    ids=["required", "named"],
)
def test_serve_tool_choice_is_enforced_by_a_grammar(grammar_server, choice, names) -> None:
    """A random model never writes a call of its own: with tool_choice "required" or a
    named function it must, in the template's format (chatml: the generic JSON one)."""
    import openai

    client = openai.OpenAI(base_url=f"{grammar_server.url}/v1", api_key="x", max_retries=0)
    for stream in (False, True):
        reply = client.chat.completions.create(
            model="t",
            messages=[{"role": "user", "content": "Add"}],
            tools=[ADD, SHOUT],  # type: ignore[list-item]
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=224,  # the random model pads with white space where it may
            stream=stream,
        )
        if stream:
            calls: dict[int, list[str]] = {}
            for chunk in reply:
                for part in chunk.choices[0].delta.tool_calls or []:
                    call = calls.setdefault(part.index, ["", ""])
                    call[0] += part.function.name or ""
                    call[1] += part.function.arguments or ""
            made = [tuple(call) for call in calls.values()]
        else:
            assert reply.choices[0].finish_reason == "tool_calls", reply
            made = [
                (c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls
            ]
        assert len(made) == 1
        name, arguments = made[0]
        assert name in names
        schema = next(t for t in (ADD, SHOUT) if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema["function"]["parameters"])


class Pet(BaseModel):
    kind: Literal["cat", "dog"]


class Adopt(BaseModel):  # small: the random model pads with white space
    pet: Pet


# A tool as the openai client writes one from a Pydantic model with a nested one: $defs
# and $refs within its parameters.
ADOPT = openai.pydantic_function_tool(Adopt)


def validate_call(name: str, arguments: str) -> None:
    """The arguments follow the called tool's parameters."""
    if name == "Adopt":
        assert isinstance(Adopt.model_validate_json(arguments).pet, Pet)
    else:
        schema = next(t for t in (ADD, SHOUT) if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema["function"]["parameters"])


@pytest.mark.parametrize("tools", [[ADD, SHOUT], [ADOPT]], ids=["plain", "pydantic $defs"])
def test_tool_call_grammar_in_every_format(target_model: Path, tools: list[dict]) -> None:
    """Each format's grammar gives a reply that its parser reads as one call, whose
    arguments follow its parameters (their $refs resolved within them: they were
    resolved against the combined call schema, and refused)."""
    from specdec_cli.decoding.grammar import lark_literal
    from specdec_cli.serve.toolcalls import (
        GENERIC,
        HERMES,
        LLAMA3,
        MISTRAL,
        ToolCallParser,
        call_grammar,
    )

    with open_engine(target_model) as engine:
        for kind in (HERMES, MISTRAL, LLAMA3, GENERIC):
            lark = call_grammar(kind, tools, False, lambda t: lark_literal(engine.model, t))
            # (as long as the context allows: the random model pads with white space)
            out, stats = run(engine, engine.decoder, Grammar.lark(lark), n=240)
            assert stats.stop_reason == "eos", kind
            parser = ToolCallParser(kind, parallel=False)
            parser.feed(text(engine, out))
            (call,) = parser.finish().calls
            validate_call(call.name, call.arguments)


def test_serve_tool_choice_with_pydantic_parameters(grammar_server) -> None:
    """tool_choice "required" with a tool whose parameters hold $defs: no 400 (the
    reply is cut short, the chat prompt leaving the random model too few tokens to end
    its padded call: see test_tool_call_grammar_in_every_format for a whole call)."""
    messages = [{"role": "user", "content": "Adopt"}]
    fields = {"messages": messages, "tools": [ADOPT], "tool_choice": "required"}
    reply = complete(grammar_server, fields, max_tokens=24, path="chat/completions")
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith('{"tool_calls"')


def test_hermes_markers_that_are_control_tokens(tool_model: Path) -> None:  # noqa: F811
    """A scripted chat model whose <tool_call> markers are control tokens: the grammar
    names them as tokens (llguidance's <[id]>), and the model's own call passes it."""
    from test_tools import WEATHER

    from specdec_cli.decoding.grammar import lark_literal
    from specdec_cli.models.chat import ChatFormat, Message, chat_tokens, render
    from specdec_cli.serve.toolcalls import HERMES, ToolCallParser, call_grammar

    options = EngineOptions(target=tool_model, threads=1, sampling=GREEDY, flash_attn="off")
    with Engine(options) as engine:
        model = engine.model
        assert lark_literal(model, "<tool_call>").startswith("<[")
        lark = call_grammar(HERMES, [WEATHER], False, lambda t: lark_literal(model, t))
        messages = [Message("user", "Weather in Paris?")]
        prompt = chat_tokens(model, render(model, messages, ChatFormat(), [WEATHER]))
        rng, stats, out = np.random.default_rng(0), Stats(), []
        for new in engine.decoder.generate(prompt, 32, rng, stats, grammar=Grammar.lark(lark)):
            out += new.tokens
        written = "".join(model.token_text(t) for t in out)
    parser = ToolCallParser(HERMES, parallel=False)
    parser.feed(written)
    (call,) = parser.finish().calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_bench_under_a_schema(target_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["-m", str(target_model), "-d", "ngram", "-k", "2", "--tree", "off", "-n", "16"]
    args += ["--repeat", "1", "-t", "1", "-j", json.dumps(SCHEMA), "--json", str(out)]
    result = specdec("bench", *args)
    assert result.returncode == 0, result.stderr
    assert "under a grammar (json schema)" in result.stdout
    figures = json.loads(out.read_text())
    assert json.loads(figures["settings"]["grammar"]["text"]) == SCHEMA
    assert figures["runs"][0]["acceptance_rate"] > 0.5  # forced keys, certain


@pytest.mark.parametrize("k", ["1", "3"])
def test_greedy_translated_draft_under_a_schema(
    target_model: Path, other_vocab_model: Path, schema_reference, k: str
) -> None:
    """A draft of another vocabulary draws without the mask (its tokens are not the
    target's); its translated guesses are cut where the grammar forbids, and the text is
    constrained target-only's."""
    with open_engine(target_model, other_vocab_model, k, tree="off") as engine:
        out, stats = run(engine, engine.make_decoder("model", k), Grammar.json_schema(SCHEMA))
    assert out == schema_reference[0]
    assert stats.proposed_by["model"] > 0


def test_sampled_translated_draft_matches_constrained_target(
    target_model: Path, other_vocab_model: Path, constrained_baseline: np.ndarray
) -> None:
    """Its q, over the texts both vocabularies share, unmasked: rejection sampling against
    the masked target is exact with any q the draft token was drawn from."""
    grammar = Grammar.gbnf(NO_R)
    with open_engine(target_model, other_vocab_model, 3, SAMPLING, tree="off") as engine:
        decoder = engine.make_decoder("model", "3")
        speculative = first_tokens(engine, decoder, grammar, range(N_RUNS, 2 * N_RUNS))
        _, stats = run(engine, decoder, grammar, REPEATING_PROMPT, 64)
    assert stats.proposed_by["model"] > 0
    assert min(alike(constrained_baseline, speculative)) > 1e-3


# --- Hostile input: one line and a non-zero exit, or a 400 and the server goes on; in a
# bounded time (each command and request has a timeout: a hang fails the test).


def ref_chain(n: int, link: Callable[[dict], dict] = lambda ref: ref) -> dict:
    """A schema whose $refs chain n deep, each `link(ref)` (a flat document: llguidance's
    JSON reader, which stops at 128 levels, never sees the depth; its compiler recursed
    on it until the stack overflowed, and the process died)."""
    defs = {f"d{i}": link({"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_arrays(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def many_values(n: int) -> dict:
    """1.3 MB at 30,000: a long enum, which llguidance compiles in a fraction of a second."""
    return {"type": "string", "enum": [f"value number {i} {'x' * 20}" for i in range(n)]}


def many_properties(n: int) -> dict:
    """1.4 MB at 25,000: past llguidance's 50,000 subschemas."""
    properties = {f"key_{i}_{'y' * 20}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": properties}


def rule_chain(n: int, brackets: int = 0, lark: bool = False) -> str:
    """A grammar whose rules chain n deep, each the next within `brackets` levels of
    brackets (llguidance's compiler recursed on it until the stack overflowed)."""
    defines, root = (":", "start") if lark else (" ::=", "root")
    rules = [f"{root}{defines} r0"]
    for i in range(n):
        rules.append(f'r{i}{defines} {"(" * brackets}"a" r{i + 1}{")" * brackets}')
    return "\n".join([*rules, f'r{n}{defines} "b"'])


def many_rules(n: int) -> str:
    return (
        "root ::= "
        + " | ".join(f"r{i}" for i in range(n))
        + "\n"
        + "\n".join(f'r{i} ::= "a{i}"' for i in range(n))
    )


MEGABYTE = 2**20
# Each refused in one line: (grammar or JSON schema, words of the message).
HOSTILE = {
    # No text at all: llguidance's matcher fails at the start (its mask would allow only
    # the end, and the output would end at once, empty, as if complete).
    "rule that only recurses": ("root ::= root", ["grammar allows no text", "at the start"]),
    "lark rule that only recurses": ("start: start", ["grammar allows no text"]),
    # Forced text without end: llguidance's search for forced tokens meets its limit.
    "forced text without end": ('root ::= "a" root', ["forces text without end"]),
    # A dead end after the model's first choice: found while generating, not before.
    "dead end after a choice": ("root ::= [a-z] x\nx ::= x", ["allows no text after 1 token"]),
    "$ref to itself": (
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        ["JSON schema allows no text"],
    ),
    "$ref chain 5000 deep": (ref_chain(5000), ["nests too deeply", "5004 levels", "$ref"]),
    "nesting 600 deep": (nested_arrays(600), ["nests too deeply", "601 levels"]),
    "schema too large for llguidance": (
        {"anyOf": [{}] * 60000},  # 180 kB: past its 50,000 subschemas
        ["JSON schema is too large for llguidance", "smaller"],
    ),
    "1 MB schema": (many_properties(25000), ["JSON schema is 1,", "bytes", "256 KiB"]),
    "1 MB grammar": ("root ::= " + "[" * MEGABYTE, ["grammar is 1,", "bytes", "256 KiB"]),
    "unclosed string": ('root ::= "' + '\\"' * 100000, ["does not parse", "not closed"]),
    "rule chain 3000 deep": (rule_chain(3000), ["grammar nests too deeply", "3002 levels"]),
    "lark rules in brackets": (rule_chain(1000, 4, lark=True), ["nests too deeply", "5002"]),
    "5000 rules": (many_rules(5000), ["grammar has 5001 rules", "at most 4000"]),
    # A schema inside a Lark grammar compiles as one (3,000 deep: past argv's 128 kB else).
    "lark %json $ref chain": ("start: %json " + json.dumps(ref_chain(3000)), ["nests too deeply"]),
}


def hostile_flags(tmp_path: Path, given: str | dict) -> list[str]:
    """The command line's flag for a grammar or a schema (a file past 64 kB: argv holds
    128 kB an argument)."""
    if isinstance(given, str) and len(given) < 2**16:
        return ["--grammar", given]
    path = tmp_path / "given"
    path.write_text(given if isinstance(given, str) else json.dumps(given))
    return ["--grammar-file" if isinstance(given, str) else "--json-schema-file", str(path)]


@pytest.mark.parametrize("name", HOSTILE)
def test_cli_hostile_grammars_exit_2_in_one_line(
    target_model: Path, draft_model: Path, tmp_path: Path, name: str
) -> None:
    given, words = HOSTILE[name]
    assert_user_error(
        run_speculative(target_model, draft_model, hostile_flags(tmp_path, given)), *words
    )


def test_cli_schema_nested_past_pythons_recursion_limit(
    target_model: Path, draft_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "schema.json"
    path.write_text('{"type": "array", "items": ' * 3000 + '{"type": "integer"}' + "}" * 3000)
    flags = ["--json-schema-file", str(path)]
    assert_user_error(run_speculative(target_model, draft_model, flags), "nests too deeply")


def run_speculative(target: Path, draft: Path, flags: list[str]):
    args = ["-m", str(target), "-d", str(draft), "-k", "3", "--tree", "off", "-t", "1"]
    return specdec("run", *args, "-p", PROMPT, "-n", "16", "--temp", "0", *flags)


def test_a_grammar_that_never_ends_stops_at_max_tokens(target_model: Path, grammar_server) -> None:
    """Letters for ever: nothing fails, nothing ends; the output stops at its length."""
    never_ends = "root ::= [a-z] root"
    args = ["-m", str(target_model), "-p", PROMPT, "-n", "24", "-t", "1", "--temp", "0"]
    result = specdec("run", *args, "--grammar", never_ends)
    assert result.returncode == 0, result.stderr
    assert "stop: length" in result.stderr
    assert result.stdout.strip().isalpha()
    reply = complete(grammar_server, {"grammar": never_ends}, max_tokens=24).json()
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["text"].isalpha() and reply["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("name", HOSTILE)
def test_serve_hostile_grammars_are_400_and_it_goes_on(grammar_server, name: str) -> None:
    given, words = HOSTILE[name]
    field = "grammar" if isinstance(given, str) else "json_schema"
    assert_refused(complete(grammar_server, {field: given}, max_tokens=16), *words)
    assert complete(grammar_server, {}).status_code == 200


def test_serve_a_grammar_that_fails_ends_only_its_own_request(grammar_server) -> None:
    """Two requests decoded in the same steps: the one whose grammar meets a dead end
    after its first token gets its 400, and the other runs on to its length."""
    import httpx

    dead_end, words = HOSTILE["dead end after a choice"]
    assert isinstance(dead_end, str)
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    body["grammar"] = "root ::= [a-z] root"  # letters to the end: no early stop
    url = f"{grammar_server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as running:
        events = (line[6:] for line in running.iter_lines() if line.startswith("data: "))
        next(events)  # it is generating
        assert_refused(complete(grammar_server, {"grammar": dead_end}, max_tokens=16), *words)
        chunks = [json.loads(event) for event in events if event != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]


def test_a_grammar_that_fails_while_drafting_ends_only_its_own_slot(
    target_model: Path, draft_model: Path
) -> None:
    """Two slots drafting in the same draft calls: the one whose matcher fails in the
    middle of its draft (llguidance meeting a limit) ends with its error, and the other
    runs on to the text it writes alone."""
    from test_slots import parallel_engine

    grammar = Grammar.json_schema(SCHEMA)
    with open_engine(target_model) as engine:
        alone, _ = run(engine, engine.decoder, grammar, n=48)
    with parallel_engine(target_model, draft_model, 2, k=3, tree="off") as engine:
        prompt = engine.tokenize(PROMPT)
        decoders = [engine.make_decoder("model", "3", "off", slot=slot) for slot in range(2)]
        runs = [
            d.start(prompt, 48, np.random.default_rng(0), Stats(), grammar=grammar)
            for d in decoders
        ]
        failing = runs[0].constraint
        assert failing is not None
        follow = failing.follow

        def meets_a_limit(path: list[int]) -> bool:
            if len(path) > 1 and failing.n_emitted > 4:  # a draft's third token, later on
                raise UserError("the JSON schema cannot go on: a limit met")
            return follow(path)

        failing.follow = meets_a_limit  # type: ignore[method-assign]
        out: list[int] = []
        while not all(g.finished for g in runs):
            decode.step([g for g in runs if not g.finished])
            out += runs[1].round.tokens if runs[1].round else []
    assert isinstance(runs[0].error, UserError) and runs[1].error is None
    assert out == alone


def test_serve_hostile_tool_parameters_are_400_and_it_goes_on(grammar_server) -> None:
    """A tool's parameters go into the grammar that tool_choice "required" builds: the
    same bound on their depth."""
    deep = {"type": "function", "function": {"name": "deep", "parameters": ref_chain(5000)}}
    messages = [{"role": "user", "content": "Go"}]
    fields = {"messages": messages, "tools": [deep], "tool_choice": "required"}
    reply = complete(grammar_server, fields, path="chat/completions")
    assert_refused(reply, "nests too deeply")
    assert reply.json()["error"]["param"] == "tools"
    assert complete(grammar_server, {}).status_code == 200


# Requests a stream on another slot must outlive, each with its answer: past the size
# limit (refused before anything reads them), and within it what was read in quadratic
# time (see test_grammar_text.py), or takes llguidance a while to compile.
LIVENESS = [
    ({"grammar": "root ::= " + "[" * MEGABYTE}, 400),
    ({"json_schema": many_properties(25000)}, 400),
    ({"grammar": 'root ::= "' + '\\"' * 120000}, 400),
    ({"grammar": "start: " + "%json " * 40000}, 400),
    ({"grammar": "\n" * 200000 + "root ::= [a-z]+"}, 200),
    ({"grammar": "start: " + " | ".join(f'"w{i}x"' for i in range(20000))}, 400),
]


def test_serve_streams_on_while_hostile_grammars_come(grammar_server) -> None:
    """While the other slot streams (one generation after another, as long as it takes),
    hostile requests get their answers, and chunks of the stream arrive while they are
    in flight: counted, not timed. A request's grammar is read and compiled in threads of
    its own, never on the event loop nor in the decode loop."""
    import threading

    import httpx

    chunks: list[dict] = []
    done = threading.Event()
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    body["grammar"] = "root ::= [a-z] root"  # letters to the end: no early stop

    def stream() -> None:
        while not done.is_set():
            url = f"{grammar_server.url}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))

    streaming = threading.Thread(target=stream)
    streaming.start()
    try:
        while not chunks:
            assert streaming.is_alive()
            streaming.join(0.1)
        during = []
        for fields, status in LIVENESS:
            before = len(chunks)
            reply = complete(grammar_server, fields, max_tokens=1)
            assert reply.status_code == status, reply.text[:300]
            during.append(len(chunks) - before)
    finally:
        done.set()
        streaming.join(120)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert during[-1] > 0  # a compile that takes a while: the stream went on meanwhile


def test_a_schema_near_the_size_limit_is_followed(
    target_model: Path, grammar_server, tmp_path: Path
) -> None:
    schema = many_values(6000)
    assert 0.9 * MAX_GRAMMAR_BYTES < len(json.dumps(schema)) <= MAX_GRAMMAR_BYTES
    args = ["-m", str(target_model), "-p", PROMPT, "-n", "64", "-t", "1", "--temp", "0"]
    result = specdec("run", *args, *hostile_flags(tmp_path, schema))
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    reply = complete(grammar_server, {"json_schema": schema}, max_tokens=64).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(reply["choices"][0]["text"]), schema)


def test_the_size_limit_is_in_bytes_before_anything_reads_them() -> None:
    """A grammar or schema of exactly MAX_GRAMMAR_BYTES is taken, one byte more refused
    (a schema given as a value is measured as compact JSON, as a client sends it)."""
    filler = MAX_GRAMMAR_BYTES - len('root ::= ""')
    literal = 'root ::= "' + "é" * (filler // 2) + "a" * (filler % 2) + '"'
    assert len(literal.encode()) == MAX_GRAMMAR_BYTES
    Grammar.gbnf(literal)
    with pytest.raises(UserError, match="grammar is 262,145 bytes"):
        Grammar.gbnf(literal + " ")
    schema = {"enum": ["x" * (MAX_GRAMMAR_BYTES - 13)]}
    assert len(json.dumps(schema, separators=(",", ":"))) == MAX_GRAMMAR_BYTES
    Grammar.json_schema(schema)
    schema["enum"].append("")
    with pytest.raises(UserError, match="JSON schema is 262,147 bytes, over the limit"):
        Grammar.json_schema(schema)
    with pytest.raises(UserError, match="JSON schema is 262,147 bytes, over the limit"):
        Grammar.json_schema(json.dumps(schema, separators=(",", ":")))


def big_tool() -> dict:
    return {"type": "function", "function": {"name": "big", "description": "x" * MEGABYTE}}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("completions", {"grammar": "root ::= " + "[" * MEGABYTE}, "grammar"),
        ("completions", {"json_schema": many_values(30000)}, "json_schema"),
        (
            "chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": many_values(30000)},
                }
            },
            "response_format",
        ),
        ("chat/completions", {"tools": [big_tool()]}, "tools"),
    ],
    ids=["grammar", "json_schema", "response_format", "tools"],
)
def test_serve_refuses_past_the_size_limit_naming_the_field(
    grammar_server, path: str, fields: dict, param: str
) -> None:
    messages = {"messages": [{"role": "user", "content": "Go"}]} if path.startswith("chat") else {}
    reply = complete(grammar_server, {**messages, **fields}, path=path)
    assert_refused(reply, "bytes, over the limit of 262,144 (256 KiB)")
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("schema", "bound"),
    [
        (ref_chain(3), 7),  # the root (3 levels), and d0 to d3 (one each)
        (nested_arrays(3), 4),
        # A $ref cycle: each of its parts once, after the root.
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            5,
        ),
        # The root twice: compiled as the whole, and again as "#".
        ({"$defs": {"a": {"$ref": "#"}}, "$ref": "#/$defs/a"}, 7),
        ({"$ref": "https://example.com/other.json"}, 2),  # could lead anywhere: the root's
        (True, 0),
    ],
)
def test_schema_depth_bounds_what_llguidance_recurses_through(schema, bound: int) -> None:
    from specdec_cli.decoding.grammar import schema_depth

    assert schema_depth(schema) == bound


# Links of a $ref chain, in shapes of several levels (the link's object, its keywords'
# objects and arrays, the $ref's own object).
LINKS: list[Callable[[dict], dict]] = [
    lambda ref: ref,
    lambda ref: {"type": "object", "properties": {"x": ref}, "required": ["x"]},
    lambda ref: {"type": "array", "items": {"anyOf": [ref, {"type": "null"}]}},
    lambda ref: {"oneOf": [{"type": "object", "properties": {"y": {"anyOf": [ref]}}}]},
]


def deepest_within_bound(link: Callable[[dict], dict]) -> dict:
    from specdec_cli.decoding.grammar import MAX_SCHEMA_DEPTH, schema_depth

    n = 1
    while schema_depth(ref_chain(n + 1, link)) <= MAX_SCHEMA_DEPTH:
        n += 1
    assert schema_depth(ref_chain(n, link)) > MAX_SCHEMA_DEPTH - 8
    return ref_chain(n, link)


def test_schemas_at_the_depth_bound_compile_in_a_quarter_of_the_stack() -> None:
    """The bound's margin: schemas just within it, in shapes of the most stack a level,
    compile on a 2 MB thread stack (a quarter of the usual 8 MB), in a child process: an
    overflow is a segmentation fault."""
    import subprocess
    import sys

    script = (
        "import json, sys, threading, llguidance\n"
        "schemas = json.load(sys.stdin)\n"
        "threading.stack_size(2 * 2**20)\n"
        "def compile():\n"
        "    for schema in schemas:\n"
        "        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)\n"
        "        llguidance.LLMatcher.validate_grammar(grammar)\n"
        "thread = threading.Thread(target=compile); thread.start(); thread.join()\n"
    )
    schemas = [deepest_within_bound(link) for link in LINKS]
    result = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(schemas), text=True, timeout=120
    )
    assert result.returncode == 0


# Checks a thread makes with the smallest stack threading lets a thread have made.
SMALL_STACK_SCRIPT = """
import json, sys, threading
from pathlib import Path
from specdec_cli.decoding.grammar import Grammar
from specdec_cli.llamacpp.model import Model, init_backend

init_backend()
model = Model(Path(sys.argv[1]), vocab_only=True)
schemas = json.load(sys.stdin)
threading.stack_size(256 * 1024)  # the stack of every thread made from now on

def check():
    for schema in schemas:
        Grammar.json_schema(schema).check(model)
    print("checked")

thread = threading.Thread(target=check)
thread.start()
thread.join()
"""


def test_compiles_run_on_a_stack_of_their_own(target_model: Path) -> None:
    """Schemas at the depth bound, checked by a thread whose stack is small (a server's
    helper thread, a library user's, `ulimit -s`): llguidance compiles them in a thread
    of COMPILE_STACK_BYTES, and the process lives (on the small stack it died of a
    segmentation fault)."""
    import subprocess
    import sys

    schemas = [deepest_within_bound(link) for link in LINKS]
    result = subprocess.run(
        [sys.executable, "-c", SMALL_STACK_SCRIPT, str(target_model)],
        input=json.dumps(schemas),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (0, "checked\n"), result.stderr[-2000:]


def test_a_generation_starts_from_the_matcher_its_check_compiled(
    target_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server checks a request's grammar in a helper thread, and its generation starts
    in the decode loop: that start copies the matcher the check compiled, so that one
    request's compile never holds up the other slots."""
    import llguidance

    model = open_model(target_model)
    grammar = Grammar.json_schema(SCHEMA)
    grammar.check(model)
    compiled = []

    def compile_again(*args: object, **kwargs: object) -> None:
        compiled.append(args)
        raise AssertionError("a generation's start compiled its grammar")

    monkeypatch.setattr(llguidance, "LLMatcher", compile_again)
    constraint = grammar.start(model)
    assert not compiled
    assert constraint.forced()  # a matcher of its own, at the start: `{"name": "` forced
    assert grammar.start(model).forced() == constraint.forced()


@pytest.mark.parametrize("ref", ["#/items/²", "#/items/" + "9" * 5000, "#/items/01"])
def test_a_ref_whose_array_index_is_not_one_is_not_followed(ref: str) -> None:
    """JSON pointers index arrays in ASCII digits, without leading zeros: others are
    $refs this check cannot follow, as a remote one (int() took them, and raised
    ValueError on "²" and past 4,300 digits: a traceback, a server's 500)."""
    from specdec_cli.decoding.grammar import schema_depth

    schema = {"items": [{"type": "array", "items": {"type": "integer"}}], "$ref": ref}
    remote = {**schema, "$ref": "https://example.com/schema.json"}
    assert (
        schema_depth(schema) == schema_depth(remote) > schema_depth({**schema, "$ref": "#/items/0"})
    )
    Grammar.json_schema(schema)


@pytest.mark.parametrize(
    ("grammar", "bound"),
    [
        (rule_chain(3), 5),  # root, r0 to r3
        (rule_chain(3, 2, lark=True), 11),  # start, three levels for each link, r3
        ('root ::= [a-z] x\nx ::= x | "(" [)(]', 2),  # strings and classes hold no brackets
        ('start: x\nx: /[(]/ x | "y" // (((\n', 2),  # nor regexes, nor comments
        ('root ::= a\na ::= b\nb ::= a | "c"', 3),  # a cycle: each of its rules once
    ],
)
def test_grammar_depth_bounds_what_llguidance_recurses_through(
    grammar: str, bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert checked_depth(grammar, monkeypatch) == bound


def checked_depth(grammar: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """The depth Grammar.gbnf finds in `grammar`, as its refusal says it, with no depth
    allowed."""
    import re

    from specdec_cli.decoding import grammar as module

    with monkeypatch.context() as patch:
        patch.setattr(module, "MAX_GRAMMAR_DEPTH", 0)
        with pytest.raises(UserError, match="nests too deeply") as error:
            Grammar.gbnf(grammar)
    found = re.search(r"a chain of rules (\d+) levels deep", str(error.value))
    assert found is not None
    return int(found.group(1))


def test_grammars_at_the_depth_bound_compile_in_a_quarter_of_the_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound's margin, as for schemas: chains just within it, of plain rules and of
    rules in brackets, compile on a 2 MB thread stack in a child process."""
    import subprocess
    import sys

    from specdec_cli.decoding.grammar import MAX_GRAMMAR_DEPTH

    grammars = [rule_chain(MAX_GRAMMAR_DEPTH - 2, lark=True)]
    grammars.append(rule_chain((MAX_GRAMMAR_DEPTH - 2) // 5, 4, lark=True))
    assert [checked_depth(g, monkeypatch) for g in grammars] == [MAX_GRAMMAR_DEPTH] * 2
    script = (
        "import json, sys, threading, llguidance\n"
        "grammars = json.load(sys.stdin)\n"
        "threading.stack_size(2 * 2**20)\n"
        "def compile():\n"
        "    for lark in grammars:\n"
        "        grammar = llguidance.LLMatcher.grammar_from_lark(lark)\n"
        "        assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]\n"
        "thread = threading.Thread(target=compile); thread.start(); thread.join()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(grammars), text=True, timeout=120
    )
    assert result.returncode == 0


# --- The official client's structured output: a Pydantic model, round trip.


def test_openai_parse_with_a_pydantic_model(grammar_server) -> None:
    """client.chat.completions.parse sends the model's strict schema (its $defs, and
    additionalProperties false) and reads the reply back into the model."""
    import openai
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        kind: Literal["cat", "dog"]

    class Household(BaseModel):  # small: the random model pads with white space
        pets: list[Pet] = Field(min_length=1, max_length=1)
        rooms: int = Field(ge=1, le=9)

    client = openai.OpenAI(base_url=f"{grammar_server.url}/v1", api_key="x", max_retries=0)
    completion = client.chat.completions.parse(
        model="t",
        messages=[{"role": "user", "content": "Describe a household"}],
        response_format=Household,
        max_tokens=180,  # what the context (256) leaves
        temperature=0,
        timeout=60,
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Household)
    assert isinstance(choice.message.parsed.pets[0], Pet)
    assert choice.message.parsed == Household.model_validate_json(choice.message.content or "")


# --- Schema features: every output validates, and speculation changes nothing of it.

FEATURE_SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "maxLength": 6},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    "array with minItems and maxItems": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{1,3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "numbers with minimum and maximum": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
        },
        "required": ["ratio", "count"],
        "additionalProperties": False,
    },
    "$ref and $defs": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["id"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "first": {"$ref": "#/$defs/item"},
            "rest": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2},
        },
        "required": ["first", "rest"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", FEATURE_SCHEMAS)
def test_every_schema_feature_validates_and_speculation_changes_nothing(
    target_model: Path, draft_model: Path, name: str
) -> None:
    schema = FEATURE_SCHEMAS[name]
    grammar = Grammar.json_schema(schema)
    with open_engine(target_model) as engine:
        reference, stats = run(engine, engine.decoder, grammar, n=160)
        written = text(engine, reference)  # while the model is loaded
    assert stats.stop_reason == "eos"  # the grammar ran to its end
    jsonschema.validate(json.loads(written), schema)
    with open_engine(target_model, draft_model, 3, tree="off") as engine:
        out, stats = run(engine, engine.make_decoder("model", "3"), grammar, n=160)
    assert out == reference
    assert stats.proposed_by["model"] > 0
