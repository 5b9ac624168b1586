"""Log-probabilities under speculation (issue 53): every emitted token's value and its
top-N list are the target's own, whoever drafted the token (a model's chain or tree,
the lookup, a translated draft, a slot beside another), equal to a target-only run's and
to an independent re-evaluation through llama-cpp-python's high-level API; and what
`run`, the OpenAI client and a bad request see of them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as llama_capi
import numpy as np
import openai
import pytest
from test_cli_run import assert_user_error, specdec
from test_decode import COUPLED, REPEATING_PROMPT, SAMPLING
from test_decode import open_engine as open_any_engine
from test_server import ServerProcess, start
from test_translate import shuffled  # noqa: F401  (a fixture: stories260K, ids shuffled)

from specdec_cli.decoding.decode import Decoder, step
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.generation import Generation
from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.logprobs import MAX_TOP, LogprobOptions, TokenLogprob, token_logprob
from specdec_cli.decoding.pieces import PieceStream, Round
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.models.chat import ChatFormat, Message
from specdec_cli.serve.api import ApiError, parse_request

PROMPT = "Once upon a time"
N = 40
TOP = 5
OPTIONS = LogprobOptions(TOP)
TOLERANCE = 1e-4
# Through a server or `run` (a KV cache in F16, llama.cpp's default): a token decoded
# alone and the same token verified in a batch differ by up to 4e-4 (measured), as the
# cache's F16 rounding of slightly different F32 values differs.
F16_CACHE_TOLERANCE = 1e-3
GGML_TYPE_F32 = 0
# Who drafts: (drafter, k, tree). Every one must have a drafted token accepted.
DRAFTING = [("model", "3", "off"), ("model", "3", "8"), ("ngram", "3", "off")]
# Rejection sampling with only top-k: its post-sampling distribution is written out
# independently below (log_softmax of the top k logits over the temperature).
TOP_K_ONLY = SamplingParams(temp=0.7, top_k=8, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module", autouse=True)
def exact_arithmetic() -> Iterator[None]:
    """This module's own engines keep their KV caches in F32 (and open_engine turns flash
    attention off, which on the CPU rounds through F16 whatever the cache): a row then
    differs between batch shapes by ~5e-6 (measured), not the ~4e-4 of an F16 cache, and
    1e-4 tells an exact value from a wrong row. Nothing in specdec sets the cache's type."""

    def f32_cache() -> llama_capi.llama_context_params:
        params = LLAMA_DEFAULTS()
        params.type_k = params.type_v = GGML_TYPE_F32
        return params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_capi, "llama_context_default_params", f32_cache)
        yield


LLAMA_DEFAULTS = llama_capi.llama_context_default_params


def open_engine(*args: object, **kwargs: object) -> Engine:
    return open_any_engine(*args, flash_attn="off", **kwargs)  # type: ignore[arg-type]


def as_served(target: Path, prompt: list[int] | None = None) -> list[TokenLogprob]:
    """A greedy target-only reference for a server or `run` (another process): its
    cache in F16 as theirs is."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_capi, "llama_context_default_params", LLAMA_DEFAULTS)
        with open_engine(target) as engine:
            return generate(engine, prompt=prompt)[0]


def generate(
    engine: Engine,
    decoder: Decoder | None = None,
    sampling: SamplingParams = GREEDY,
    options: LogprobOptions = OPTIONS,
    seed: int = 0,
    prompt: list[int] | None = None,
) -> tuple[list[TokenLogprob], Stats]:
    """Each emitted token's log-probability, one per token, and the run's figures."""
    stats, out = Stats(), []
    prompt = engine.tokenize(PROMPT) if prompt is None else prompt
    rng = np.random.default_rng(seed)
    for new in (decoder or engine.decoder).generate(prompt, N, rng, stats, sampling, options):
        assert new.logprobs is not None and [lp.token for lp in new.logprobs] == new.tokens
        out += new.logprobs
    return out, stats


def assert_same(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    assert [lp.token for lp in got] == [lp.token for lp in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g.logprob - w.logprob) < TOLERANCE, (g, w)
        assert [t for t, _ in g.top] == [t for t, _ in w.top], (g, w)
        assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=TOLERANCE)


@pytest.fixture(scope="module")
def alone(target_model: Path) -> dict[tuple[str, bool], list[TokenLogprob]]:
    """Target-only runs, greedy and coupled (whose text a seed fixes whatever drafts),
    each with the model's and the post-sampling distribution."""
    runs = {}
    with open_engine(target_model) as engine:
        for name, sampling in (("greedy", GREEDY), ("coupled", COUPLED)):
            for post in (False, True):
                options = LogprobOptions(TOP, post)
                runs[name, post] = generate(engine, sampling=sampling, options=options)[0]
    return runs


@pytest.fixture(scope="module")
def engine(target_model: Path, draft_model: Path) -> Iterator[Engine]:
    with open_engine(target_model, draft_model, 3, tree="16") as engine:
        yield engine


@pytest.mark.parametrize("post", [False, True], ids=["model", "post-sampling"])
@pytest.mark.parametrize("sampling", ["greedy", "coupled"])
@pytest.mark.parametrize(("drafter", "k", "tree"), DRAFTING)
def test_speculation_reports_the_targets_own_numbers(
    engine: Engine, alone, drafter: str, k: str, tree: str, sampling: str, post: bool
) -> None:
    decoder = engine.make_decoder(drafter, k, tree)
    params = GREEDY if sampling == "greedy" else COUPLED
    got, stats = generate(engine, decoder, params, LogprobOptions(TOP, post))
    assert stats.accepted > 0  # drafted tokens were read from their verification rows
    assert_same(got, alone[sampling, post])


def test_a_row_off_by_one_is_caught(engine: Engine, alone, monkeypatch) -> None:
    """The negative control: each token read from the row after the one it was verified
    against (the row its own token predicts, where there is one), as an off-by-one
    would, gives other numbers, and the comparison above sees it."""

    def shifted(self, draft, path, next_token):
        logits = self.decoder.target.logits
        tokens = [*(draft.tokens[i] for i in path), next_token]
        rows = [*(i + 1 for i in path), len(path) and path[-1] + 1]
        return [
            token_logprob(logits(r), t, OPTIONS, GREEDY) for r, t in zip(rows, tokens, strict=True)
        ]

    monkeypatch.setattr(Generation, "_logprobs", shifted)
    got, stats = generate(engine, engine.make_decoder("model", "3", "off"))
    assert stats.accepted > 0
    with pytest.raises(AssertionError):
        assert_same(got, alone["greedy", False])


def test_greedy_post_sampling_is_certain(engine: Engine) -> None:
    decoder = engine.make_decoder("model", "3", "8")
    got, _ = generate(engine, decoder, GREEDY, LogprobOptions(3, True))
    assert all(lp.logprob == 0.0 and lp.top == ((lp.token, 0.0),) for lp in got)


@pytest.fixture(scope="module")
def high_level(target_model: Path) -> Iterator[llama_cpp.Llama]:
    """The target in llama-cpp-python's own high-level API, every row's logits kept."""
    llm = llama_cpp.Llama(
        str(target_model),
        logits_all=True,
        n_ctx=256,
        n_threads=1,
        n_threads_batch=1,  # its default, every core, fights this process's own threads
        flash_attn=False,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=False,
    )
    yield llm
    llm.close()


def reevaluated(llm: llama_cpp.Llama, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The rows that predict each of `tokens`, from one batch of prompt + tokens."""
    llm.reset()
    llm.eval([*prompt, *tokens])
    return np.array(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], np.float64)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize(
    ("drafter", "k", "tree", "sampling"),
    [
        ("model", "3", "off", GREEDY),
        ("model", "3", "8", SAMPLING),
        ("ngram", "3", "off", SAMPLING),
        ("model", "4", "off", TOP_K_ONLY),
    ],
    ids=["greedy-chain", "sampled-tree", "sampled-lookup", "top-k-chain"],
)
def test_equal_to_llama_cpp_pythons_own_evaluation(
    engine: Engine, high_level, drafter: str, k: str, tree: str, sampling: SamplingParams
) -> None:
    """Rejection-sampled texts differ from target-only ones: each is checked against
    the target's logits for that very text, evaluated apart from specdec. The lookup's
    prompt repeats itself: it has n-grams to find."""
    prompt = engine.tokenize(REPEATING_PROMPT if drafter == "ngram" else PROMPT)
    decoder = engine.make_decoder(drafter, k, tree)
    got, stats = generate(engine, decoder, sampling, prompt=prompt)
    assert stats.accepted > 0
    want = log_softmax(reevaluated(high_level, prompt, [lp.token for lp in got]))
    for lp, row in zip(got, want, strict=True):
        assert abs(lp.logprob - row[lp.token]) < TOLERANCE
        top = np.argsort(-row, kind="stable")[:TOP]
        assert [t for t, _ in lp.top] == top.tolist()
        assert np.allclose([v for _, v in lp.top], row[top], atol=TOLERANCE)
    if sampling is TOP_K_ONLY:  # and the distribution it was drawn from, written out
        post, _ = generate(engine, decoder, sampling, LogprobOptions(TOP, True), prompt=prompt)
        rows = reevaluated(high_level, prompt, [lp.token for lp in post])
        for lp, row in zip(post, rows, strict=True):
            kept = np.argsort(-row, kind="stable")[: sampling.top_k]
            drawn = dict(zip(kept.tolist(), log_softmax(row[kept] / sampling.temp), strict=True))
            assert abs(lp.logprob - drawn[lp.token]) < TOLERANCE
            assert [t for t, _ in lp.top] == kept[:TOP].tolist()


def test_post_sampling_under_a_grammar_is_the_masked_distribution(
    engine: Engine, high_level
) -> None:
    """Each token's post-sampling numbers are those of the distribution it was drawn
    from: the target's row with every token the grammar forbids taken out before top-k
    and temperature. Written out here apart from llguidance: no "r" anywhere (the
    target's favourite " ran" after this prompt is forbidden), so a token is allowed
    where its text is made of the grammar's characters, the end once some text came."""
    grammar = Grammar.gbnf("root ::= [a-qs-z ]+")
    prompt = engine.tokenize(REPEATING_PROMPT)
    decoder = engine.make_decoder("model", "3", "off")
    got, rng = [], np.random.default_rng(0)
    options = LogprobOptions(TOP, True)
    stats = Stats()
    for new in decoder.generate(prompt, N, rng, stats, TOP_K_ONLY, options, grammar):
        assert new.logprobs is not None
        got += new.logprobs
    assert stats.accepted > 0
    model = engine.model
    texts = [model.piece(t) for t in range(model.n_vocab)]
    allowed = np.array(
        [bool(text) and set(text) <= set(b"abcdefghijklmnopqstuvwxyz ") for text in texts]
    )
    ends = np.array([model.is_eog(t) for t in range(model.n_vocab)])
    rows = reevaluated(high_level, prompt, [lp.token for lp in got])
    forbidden_kept = 0  # places where top-k of the unmasked row keeps a forbidden token
    for i, (lp, row) in enumerate(zip(got, rows, strict=True)):
        masked = np.where(allowed | (ends & (i > 0)), row, -np.inf)
        kept = np.argsort(-masked, kind="stable")[: TOP_K_ONLY.top_k]
        drawn = dict(zip(kept.tolist(), log_softmax(masked[kept] / TOP_K_ONLY.temp), strict=True))
        assert abs(lp.logprob - drawn[lp.token]) < TOLERANCE
        assert [t for t, _ in lp.top] == kept[:TOP].tolist()
        assert np.allclose([v for _, v in lp.top], [drawn[t] for t in kept[:TOP]], atol=TOLERANCE)
        unmasked = np.argsort(-row, kind="stable")[: TOP_K_ONLY.top_k]
        forbidden_kept += not allowed[unmasked].all()
    assert forbidden_kept > 0  # the mask changed what was drawn from


def test_slots_side_by_side(target_model: Path, draft_model: Path, alone) -> None:
    """Two generations in one target call per round, each with its own rows."""
    options = EngineOptions(
        target_model,
        draft_model,
        n_ctx=512,
        threads=1,
        parallel=2,
        flash_attn="off",
        sampling=GREEDY,
        drafting=DraftOptions(k="3", tree="8"),
    )
    with Engine(options) as engine:
        prompt = engine.tokenize(PROMPT)
        other = engine.tokenize("The little dog ran")
        generations = [
            decoder.start(p, N, np.random.default_rng(3), Stats(), GREEDY, OPTIONS)
            for decoder, p in zip(engine.decoders, (prompt, other), strict=True)
        ]
        outs: list[list[TokenLogprob]] = [[], []]
        while not all(g.finished for g in generations):
            step([g for g in generations if not g.finished])
            for out, g in zip(outs, generations, strict=True):
                if g.round and g.round.logprobs:
                    out += g.round.logprobs
                    g.round = None
        assert sum(g.stats.accepted for g in generations) > 0
        for g in generations:
            g.close()
    assert_same(outs[0], alone["greedy", False])
    with open_engine(target_model) as single:
        assert_same(outs[1], generate(single, prompt=single.tokenize("The little dog ran"))[0])


def test_translated_draft(shuffled: Path, stories260k: Path) -> None:  # noqa: F811
    with open_engine(shuffled) as engine:
        want, _ = generate(engine)
    with open_engine(shuffled, stories260k, "3", tree="8") as engine:
        assert engine.translation is not None
        got, stats = generate(engine, engine.make_decoder("model", "3", "8"))
    assert stats.accepted > 0
    assert_same(got, want)


# --- pieces: a stop string's tokens, and text held back ---------------------------------


class Letters:
    """A stand-in vocabulary: token i is the i-th of TEXTS."""

    TEXTS = (b"Hello", b" E", b"ND", b" more", b"\xe2\x82", b"\xac")

    def piece(self, token: int) -> bytes:
        return self.TEXTS[token]

    def token_text(self, token: int) -> str:
        return self.TEXTS[token].decode()


def fake(tokens: list[int]) -> Round:
    return Round(tokens, 0, logprobs=tuple(TokenLogprob(t, -float(t)) for t in tokens))


def test_a_stop_strings_tokens_have_none() -> None:
    """Token " E" begins with a space the reply keeps; "ND" begins in the stop string."""
    stream = PieceStream(Letters(), ("END",))  # type: ignore[arg-type]
    pieces = stream.round(fake([0, 1, 2, 3]))
    assert [p.text for p in pieces] == ["Hello", " ", ""]
    assert [[lp.token for lp in p.logprobs] for p in pieces] == [[0], [1], []]
    assert stream.finish().logprobs == ()


def test_held_text_carries_its_tokens_out_later() -> None:
    stream = PieceStream(Letters(), ("ENDING",))  # type: ignore[arg-type]
    pieces = [*stream.round(fake([1, 2, 4, 5])), stream.finish()]
    assert "".join(p.text for p in pieces) == " END€"
    assert [lp.token for p in pieces for lp in p.logprobs] == [1, 2, 4, 5]
    for p in pieces:  # a token's value comes out with (or after) the text it begins
        assert p.text or not p.logprobs or p.token is None


def test_log_softmax_of_a_row_without_drafts() -> None:
    row = np.random.default_rng(0).standard_normal(70_000).astype(np.float32) * 4
    lp = token_logprob(row, 5, LogprobOptions(20), GREEDY)
    want = log_softmax(row.astype(np.float64))
    assert abs(lp.logprob - want[5]) < 1e-5
    assert [t for t, _ in lp.top] == np.argsort(-want, kind="stable")[:20].tolist()


# --- the API: shapes through the openai client, and refusals -------------------------------


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, target_model: Path, draft_model: Path
) -> Iterator[ServerProcess]:
    args = ["-m", str(target_model), "-d", str(draft_model), "--tree", "8", "-k", "3"]
    proc = start(tmp_path_factory.mktemp("serve-logprobs"), *args, "--chat-template", "chatml")
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def chat_reference(target_model: Path) -> list[TokenLogprob]:
    with open_engine(target_model) as engine:
        messages = [Message("user", "Tell me a story")]
        prompt = engine.tokenize_messages(messages, ChatFormat("chatml"))
    return as_served(target_model, prompt)


def test_chat_logprobs_through_the_openai_client(client: openai.OpenAI, target_model: Path) -> None:
    reply = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    want = chat_reference(target_model)[: len(entries)]
    assert len(entries) == reply.usage.completion_tokens == len(want)
    for entry, lp in zip(entries, want, strict=True):
        assert abs(entry.logprob - lp.logprob) < F16_CACHE_TOLERANCE
        assert bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert np.allclose(
            [t.logprob for t in entry.top_logprobs],
            [v for _, v in lp.top],
            atol=F16_CACHE_TOLERANCE,
        )

    stream = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True,
        top_logprobs=5, stream=True,
    )  # fmt: skip
    streamed, text = [], ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, logprobs = chunk.choices[0].delta, chunk.choices[0].logprobs
        text += delta.content or ""
        mine = logprobs.content if logprobs and logprobs.content else []
        assert "".join(e.token for e in mine) == (delta.content or "")  # its own tokens
        streamed += mine
    assert text == choice.message.content
    assert [e.token for e in streamed] == [e.token for e in entries]
    # the second request reads its prompt from the cache: other batch shapes
    streamed_values = [e.logprob for e in streamed]
    assert np.allclose(streamed_values, [e.logprob for e in entries], atol=F16_CACHE_TOLERANCE)


def test_completion_logprobs_through_the_openai_client(
    client: openai.OpenAI, target_model: Path
) -> None:
    want = as_served(target_model)
    with open_engine(target_model) as engine:
        prompt = engine.tokenize(PROMPT)
        texts = {
            t: engine.model.piece(t).decode(errors="replace") for lp in want for t, _ in lp.top
        }
    reply = client.completions.create(
        model="x", prompt=prompt, max_tokens=N, temperature=0, logprobs=5
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert np.allclose(
        logprobs.token_logprobs, [lp.logprob for lp in want], atol=F16_CACHE_TOLERANCE
    )
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1:] == list(np.cumsum([len(t) for t in logprobs.tokens])[:-1])
    for tops, lp in zip(logprobs.top_logprobs, want, strict=True):
        assert tops == pytest.approx({texts[t]: v for t, v in lp.top}, abs=F16_CACHE_TOLERANCE)

    stream = client.completions.create(
        model="x", prompt=prompt, max_tokens=N, temperature=0, logprobs=5, stream=True
    )
    tokens, offsets = [], []
    for chunk in stream:
        part = chunk.choices[0].logprobs
        if part is not None and part.tokens:
            assert "".join(part.tokens) == chunk.choices[0].text
            tokens += part.tokens
            offsets += part.text_offset
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset


def test_post_sampling_probs_in_llama_servers_names(server: ServerProcess) -> None:
    import httpx

    body = {
        "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
        "top_logprobs": 3, "post_sampling_probs": True,
    }  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    for entry in reply["choices"][0]["logprobs"]["content"]:
        assert entry["prob"] == 1.0 and entry["logprob"] == 0.0  # greedy: certain
        assert [t["token"] for t in entry["top_probs"]] == [entry["token"]]


@pytest.mark.parametrize(
    ("path", "fields", "named"),
    [
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_requests_are_refused(
    server: ServerProcess, path: str, fields: dict[str, object], named: str
) -> None:
    import httpx

    body = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": PROMPT}
    answer = httpx.post(f"{server.url}/v1/{path}", json=body | fields, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert named in error["message"] and "\n" not in error["message"]
    assert error["param"] == named


def test_requests_parse_to_options() -> None:
    chat = parse_request({"messages": MESSAGES, "logprobs": True}, True, GREEDY)
    assert chat.logprobs == LogprobOptions(0)
    assert parse_request({"messages": MESSAGES}, True, GREEDY).logprobs is None
    body = {"prompt": "x", "logprobs": 20, "post_sampling_probs": True}
    assert parse_request(body, False, GREEDY).logprobs == LogprobOptions(20, True)
    with pytest.raises(ApiError, match="chat field"):
        parse_request({"prompt": "x", "top_logprobs": 2}, False, GREEDY)


# --- run ----------------------------------------------------------------------------------


def test_run_adds_them_to_the_json_tokens(target_model: Path, draft_model: Path) -> None:
    args = ["-m", str(target_model), "-d", str(draft_model), "-k", "3", "-p", PROMPT]
    args += [
        "-n",
        str(N),
        "--temp",
        "0",
        "--seed",
        "3",
        "-t",
        "1",
        "-q",
        "--tree",
        "off",
        "-fa",
        "off",
    ]
    result = specdec("run", *args, "--logprobs", str(TOP))
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)["token_list"]
    want = as_served(target_model)
    assert [r["id"] for r in records] == [lp.token for lp in want]
    for record, lp in zip(records, want, strict=True):
        assert abs(record["logprob"] - lp.logprob) < F16_CACHE_TOLERANCE
        assert [t["id"] for t in record["top_logprobs"]] == [t for t, _ in lp.top]
    post = specdec("run", *args, "--logprobs", "1", "--post-sampling-probs")
    records = json.loads(post.stdout)["token_list"]
    assert all(r["logprob"] == 0.0 and len(r["top_logprobs"]) == 1 for r in records)
    assert_user_error(specdec("run", *args, "--post-sampling-probs"), "--logprobs")


def test_run_refuses_more_logprobs_than_the_api(target_model: Path) -> None:
    """--logprobs N sorts N of the vocabulary for every token: the API's bound (20) holds
    for the CLI too, refused in one line before any model is loaded."""
    for too_many in (str(MAX_TOP + 1), "200000"):
        result = specdec("run", "-m", str(target_model), "-p", "Once", "--logprobs", too_many)
        assert_user_error(result, "--logprobs", str(MAX_TOP))
        assert len(result.stderr.strip().splitlines()) == 1


def test_nothing_is_computed_when_nobody_asks(engine: Engine, monkeypatch) -> None:
    """The default path does no work per token for them (the gate is one check)."""
    import specdec_cli.decoding.generation as generation

    def forbidden(*args, **kwargs):
        raise AssertionError("computed without being asked")

    monkeypatch.setattr(generation, "token_logprob", forbidden)
    stats, rounds = Stats(), []
    prompt = engine.tokenize(PROMPT)
    for new in engine.decoder.generate(prompt, 8, np.random.default_rng(0), stats):
        rounds.append(new)
    assert all(r.logprobs is None for r in rounds)
