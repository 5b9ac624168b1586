"""Drafts across vocabularies (translate.py): the translation's edge cases on real
tokenizers, and end to end: greedy output equal to target-only output, sampled output
following the target's distribution (with a negative control that must fail)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openai
import pytest
from gguf import GGUFValue
from ggufgen import read_f32_model, write_gguf
from scipy.stats import chi2_contingency
from test_cli_run import specdec
from test_decode import COUPLED, N_FIRST, SAMPLING, contingency, generate, open_engine
from test_real_model import MOST_TIES, TIE_TOLERANCE, argmax_gaps
from test_server import start
from test_slots import Job, parallel_engine, run_together

from specdec_cli.decoding.draft import Draft, merge_into_tree
from specdec_cli.decoding.draftlength import AutoLength
from specdec_cli.decoding.policy import TRANSLATED_MARGIN, TRANSLATED_PRIOR
from specdec_cli.decoding.stats import Stats
from specdec_cli.decoding.translate import (
    SharedVocab,
    bytes_per_token,
    leaf_paths,
    tokens_after,
    whole_text,
)
from specdec_cli.llamacpp.model import Model
from specdec_cli.models.chat import ChatFormat, ChatOptions

# Multi-byte characters of 2, 3 and 4 bytes, and text a story draft knows.
PROMPT = "Once upon a time, a naïve cat — 日本の猫 🙂 — sat"
TEXTS = ("Once upon a time", " there was a café", " 日本語と 🙂 emoji", "\n\n  indented, then")
N_RUNS = 2000


def spell(model: Model, tokens: list[int]) -> bytes:
    return b"".join(model.piece(t) for t in tokens)


@pytest.mark.parametrize("family", ["llama-spm", "qwen2", "gemma-4", "llama-bpe", "phi-3"])
@pytest.mark.parametrize("split", range(1, len(TEXTS)))
def test_tokens_after_spell_the_text(vocab_model, family: str, split: int) -> None:
    """After a context, the new text's tokens spell it exactly, and where the new text
    starts a word they are the whole text's own tokens (the join tokenizes as in it)."""
    model = vocab_model(family)
    before, after = "".join(TEXTS[:split]), "".join(TEXTS[split:])
    context = model.tokenize(before, add_special=False)
    result = tokens_after(model, context, after, back=8)
    assert result is not None
    kept, tokens = result
    assert kept <= len(context)
    assert spell(model, context[:kept] + tokens) == spell(model, context) + after.encode()
    whole = model.tokenize(before + after, add_special=False)
    if kept == len(context) and whole[: len(context)] == context:
        assert tokens == whole[len(context) :]


def test_a_draft_token_split_into_several_target_tokens(vocab_model) -> None:
    """A word that is one token of the draft's and several of the target's."""
    target = vocab_model("qwen2")
    context = target.tokenize("The", add_special=False)
    result = tokens_after(target, context, " antidisestablishmentarianism")
    assert result is not None and result[0] == len(context)
    assert len(result[1]) > 1
    assert spell(target, result[1]) == b" antidisestablishmentarianism"


def test_draft_tokens_merged_into_one_target_token(vocab_model) -> None:
    """ "Hel" accepted, "lo world" drafted, and "Hello" is one token: the target
    cannot take "Hel" back, so nothing joins there (no draft this round); the draft's
    memory can, and goes back to before "Hel"."""
    model = vocab_model("qwen2")
    context = model.tokenize("Hel", add_special=False)
    assert len(model.tokenize("Hello", add_special=False)) == 1
    assert tokens_after(model, context, "lo world") is None
    result = tokens_after(model, context, "lo world", back=4)
    assert result is not None
    kept, tokens = result
    assert kept < len(context)
    assert spell(model, context[:kept] + tokens) == b"Hello world"


def test_whole_text_waits_for_a_cut_character() -> None:
    cat = "猫".encode()  # three bytes
    assert whole_text(b"a" + cat[:2]) == ("a", 1)
    assert whole_text(b"a" + cat) == ("a猫", 4)
    assert whole_text(b"a" + cat[:2], complete=True)[1] == 3  # nothing more will come
    assert whole_text(b"a\xffb") == ("a\ufffdb", 3)  # no UTF-8 at all


def test_spm_space_prefix_is_not_doubled(vocab_model) -> None:
    """SentencePiece puts a space before the text it tokenizes: not before a join."""
    model = vocab_model("llama-spm")
    context = model.tokenize("Once upon a time", add_special=False)
    result = tokens_after(model, context, " there")
    assert result is not None
    assert spell(model, result[1]) == b" there"


def test_shared_texts_across_whitespace_markers(vocab_model) -> None:
    """SentencePiece's "▁the" and byte-level BPE's "Ġthe" are one text, " the"; byte
    tokens map to the plain token of their byte."""
    spm, bpe = vocab_model("llama-spm"), vocab_model("qwen2")
    shared = SharedVocab.build(bpe, spm)
    (the_spm,) = spm.tokenize(" the", add_special=False)[-1:]
    (the_bpe,) = bpe.tokenize(" the", add_special=False)
    assert shared.to_target[the_spm] == the_bpe
    byte_a = spm.tokenize("<0x41>", add_special=False, parse_special=True)
    plain_a = bpe.tokenize("A", add_special=False)
    if len(byte_a) == 1:  # the byte token's text is its byte
        assert shared.to_target[byte_a[0]] == plain_a[0]
    assert 10_000 < shared.n_shared < spm.n_vocab


# --- end to end ---------------------------------------------------------------------


def relabelled(stories260k: Path, path: Path, alter_every: int = 0) -> Path:
    """stories260K with its token ids from 3 on shuffled (the same texts under other ids:
    a vocabulary llama.cpp would not pair with the original), and the text of every
    `alter_every`-th plain token changed, so that the draft has no token of that text
    (0: none). The model computes what stories260K computes, token by token."""
    metadata, tensors = read_f32_model(stories260k)
    n = len(metadata["tokenizer.ggml.tokens"].value)
    order = np.concatenate([np.arange(3), 3 + np.random.default_rng(0).permutation(n - 3)])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        field = metadata[key]
        metadata[key] = GGUFValue([field.value[i] for i in order], field.type, field.sub_type)
    if alter_every:
        tokens, types = (
            metadata["tokenizer.ggml.tokens"].value,
            metadata["tokenizer.ggml.token_type"].value,
        )
        for i in range(3, n, alter_every):
            if types[i] == 1:  # a plain token (not a byte or a control token)
                tokens[i] += "ˣ"
    for name in ("token_embd.weight", "output.weight"):
        if name in tensors:
            tensors[name] = tensors[name][order]
    return write_gguf(path, metadata, tensors)


@pytest.fixture(scope="session")
def shuffled(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return relabelled(stories260k, tmp_path_factory.mktemp("shuffled") / "shuffled.gguf")


@pytest.fixture(scope="session")
def half_shared(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("half-shared")
    return relabelled(stories260k, folder / "half-shared.gguf", alter_every=2)


def test_check_says_drafts_are_translated(shuffled: Path, stories260k: Path) -> None:
    result = specdec("check", "-m", str(shuffled), "-d", str(stories260k))
    assert result.returncode == 0, result.stderr
    assert "translated" in result.stdout and "token texts" in result.stdout
    report = json.loads(
        specdec("check", "-m", str(shuffled), "-d", str(stories260k), "--json").stdout
    )
    assert report["vocabulary"] == "translated" and report["shared_token_texts"] > 400


def target_only(target: Path, prompt: str, n: int = 48) -> list[int]:
    with open_engine(target) as engine:
        return generate(engine, n, prompt=engine.tokenize(prompt))[0]


@pytest.mark.parametrize("k", ["1", "3", "8", "auto"])
@pytest.mark.parametrize("tree", ["off", "auto"])
def test_greedy_translated_equals_target_only(
    shuffled: Path, stories260k: Path, k: str, tree: str
) -> None:
    """The same model under shuffled ids: every translated draft token can be taken."""
    reference = target_only(shuffled, PROMPT)
    with open_engine(shuffled, stories260k, k, tree=tree) as engine:
        assert engine.translation is not None
        decoder = engine.make_decoder("model", k)
        out, stats = generate(engine, 48, decoder=decoder, prompt=engine.tokenize(PROMPT))
    assert out == reference
    assert stats.acceptance_rate > 0.8  # the draft is the target: nearly all is taken


def test_a_coupled_translated_text_is_the_target_onlys(shuffled: Path, stories260k: Path) -> None:
    """Coupled, a translated draft proposes its likeliest text (the noise is keyed by
    the target's tokens): the target's draws decide, and the text is target-only's."""
    with open_engine(shuffled, sampling=COUPLED) as engine:
        reference = generate(engine, 48, seed=3, prompt=engine.tokenize(PROMPT))[0]
    with open_engine(shuffled, stories260k, "3", COUPLED) as engine:
        decoder = engine.make_decoder("model", "3")
        out, stats = generate(engine, 48, 3, decoder, engine.tokenize(PROMPT))
    assert out == reference
    assert stats.accepted > 0


def test_translated_slots_draft_together(shuffled: Path, stories260k: Path) -> None:
    """Two slots' translated drafts in shared draft calls, one text cut mid-character
    (the draft's text then stops growing for a round): each is its text alone."""
    with parallel_engine(shuffled, stories260k, 2, k=3, tree="off") as engine:
        jobs = [
            Job(engine.decoders[slot], engine.tokenize(prompt), 40)
            for slot, prompt in enumerate((PROMPT, TEXTS[2]))
        ]
        together = run_together(jobs)
        drafted = [ctx.decode_calls for ctx in engine.draft_slots if ctx]
    for tokens, prompt in zip(together, (PROMPT, TEXTS[2]), strict=True):
        assert tokens == target_only(shuffled, prompt, 40)
    assert min(drafted) > 10


# -k auto by pinned costs: a measured curve can leave a translated draft unpaid in 32 tokens
@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize("family", ["gemma-4", "qwen2", "llama-bpe"])
@pytest.mark.parametrize("k", ["3", "auto"])
def test_greedy_translated_to_real_tokenizers(
    real_vocab_pair: Callable[[str], tuple[Path, Path]], stories260k: Path, family: str, k: str
) -> None:
    """stories260K's SentencePiece drafts for targets with the Gemma, Qwen2 and Llama 3
    tokenizers (random weights: little is accepted, all is translated and checked)."""
    target = real_vocab_pair(family)[0]
    reference = target_only(target, PROMPT, 32)
    with open_engine(target, stories260k, k) as engine:
        out, stats = generate(
            engine, 32, decoder=engine.make_decoder("model", k), prompt=engine.tokenize(PROMPT)
        )
    assert out == reference
    assert stats.drafted > 0


@pytest.fixture(scope="module")
def half_shared_baseline(half_shared: Path) -> np.ndarray:
    with open_engine(half_shared, sampling=SAMPLING) as engine:
        return first_tokens(engine, range(N_RUNS))


def first_tokens(engine, seeds: range, decoder=None) -> np.ndarray:
    prompt = engine.tokenize("Once upon a time")
    rows = []
    for seed in seeds:
        out, _ = generate(engine, N_FIRST, seed=seed, decoder=decoder, prompt=prompt)
        rows.append(out[:N_FIRST])
    return np.array(rows)


def sampled_translated(half_shared: Path, stories260k: Path, tree: str) -> tuple[np.ndarray, Stats]:
    with open_engine(half_shared, stories260k, 3, SAMPLING, tree=tree) as engine:
        decoder = engine.make_decoder("model", "3")
        tokens = first_tokens(engine, range(N_RUNS, 2 * N_RUNS), decoder)
        _, stats = generate(engine, 64, decoder=decoder, prompt=engine.tokenize("Once upon a time"))
    return tokens, stats


def differs(baseline: np.ndarray, sample: np.ndarray) -> float:
    """The smallest chi-square p-value over the first tokens' positions."""
    return min(
        chi2_contingency(contingency(baseline[:, i], sample[:, i])).pvalue for i in range(N_FIRST)
    )


@pytest.mark.parametrize("tree", ["off", "8"])
def test_sampled_translated_follows_the_target(
    half_shared: Path, stories260k: Path, half_shared_baseline: np.ndarray, tree: str
) -> None:
    """Token-level intersection, against a target half of whose texts the draft lacks."""
    sample, stats = sampled_translated(half_shared, stories260k, tree)
    assert 0.0 < stats.acceptance_rate < 1.0
    assert differs(half_shared_baseline, sample) > 1e-3


def test_tli_without_renormalising_is_caught(
    half_shared: Path, stories260k: Path, half_shared_baseline: np.ndarray, monkeypatch
) -> None:
    """The negative control: a draft that draws among the shared tokens but reports
    the probabilities it had before their mass was made whole again (here, the half
    the excluded tokens took) accepts too often, and the check sees it."""
    mapped = SharedVocab.map_dist

    def forgetful(self, q):
        dist = mapped(self, q)
        return type(dist)(dist.ids, dist.probs * 0.5)

    monkeypatch.setattr(SharedVocab, "map_dist", forgetful)
    sample, _ = sampled_translated(half_shared, stories260k, "off")
    assert differs(half_shared_baseline, sample) < 1e-6


@pytest.mark.parametrize("tree", ["off", "8"])
def test_real_pair_gemma_drafted_by_stories260k(gemma3: Path, stories260k: Path, tree: str) -> None:
    """Two real models, neither ours, of two tokenizers (Gemma's 262k and stories260K's
    512-token SentencePiece), writing the same kind of story: each emitted token is the
    target's argmax within the batch-shape tolerance of one pass (see test_real_model),
    and the draft's translated guesses are taken. With a tree, the draft's other paths
    are translated too, and the target takes some of them where the first was wrong."""
    prompt = "Once upon a time, there was a little girl named Lily. She"
    with open_engine(gemma3, stories260k, 4, n_ctx=512, tree=tree) as engine:
        tokens = engine.tokenize(prompt)
        decoder = engine.make_decoder("model", "4", tree)
        out, stats = generate(engine, 64, decoder=decoder, prompt=tokens)
        gaps = argmax_gaps(engine.model, tokens, out)
    assert max(gaps) <= TIE_TOLERANCE and sum(g > 0 for g in gaps) <= MOST_TIES
    assert stats.accepted > 0 and stats.tokens_per_pass > 1.3
    assert (stats.accepted_beside > 0) == (tree != "off")


def test_a_draft_trees_paths_primary_first() -> None:
    """Each root-to-leaf path of a draft tree is translated on its own: the primary path
    (first children) first, so that it stays the merged tree's primary path."""
    tree = Draft(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 2])
    assert leaf_paths(tree) == [[10, 12, 14], [11], [10, 13]]
    assert leaf_paths(Draft(tokens=[5, 6])) == [[5, 6]]
    merged = Draft()
    merge_into_tree(merged, [[20, 22], [21], [20, 23]], 8)
    assert merged.primary_path() == [20, 22] and merged.parents == [-1, 0, -1, 0]


def test_each_model_reads_a_chat_in_its_own_format(shuffled: Path, stories260k: Path) -> None:
    """The target's chat markers never reach a translated draft as text: a draft without
    a chat format of its own gets the messages' words."""
    with open_engine(shuffled, stories260k) as engine:
        chat = ChatOptions(system="Be brief.", format=ChatFormat("chatml"))
        tokens = engine.tokenize("What is a cat?", chat)
        assert engine.translation is not None
        draft_tokens = engine.translation.draft_tokens(tokens)
        draft = engine.translation.draft
        assert spell(engine.model, tokens).count(b"im_start") == 3
        assert spell(draft, draft_tokens).strip() == b"Be brief.\n\nWhat is a cat?"


def test_serve_and_bench_translate(shuffled: Path, stories260k: Path, tmp_path: Path) -> None:
    """A translated pair behind the server (greedy: the target's own text, its drafts
    taken) and in bench, which measures it like any pair."""
    reference = target_only(shuffled, "Once upon a time", 24)
    # -k 3: the same model on both sides, a draft as dear as the target: -k auto's first
    # probe would come after more rounds than this request has.
    server = start(tmp_path, "-m", str(shuffled), "-d", str(stories260k), "--temp", "0", "-k", "3")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="m", prompt="Once upon a time", max_tokens=24)
        model = Model(shuffled, vocab_only=True)
        expected = spell(model, reference).decode()
        model.close()
        assert out.choices[0].text == expected
        assert out.model_extra["timings"]["draft_n_accepted"] > 0
    finally:
        assert server.stop() == 0, server.output()
    assert sum("translated" in line for line in server.output().splitlines()) == 1
    bench = specdec(
        "bench", "-m", str(shuffled), "-d", str(stories260k), "--no-ngram", "-k", "3",
        "-n", "16", "--repeat", "1", "-t", "1",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert "model k=3" in bench.stdout


def test_auto_prices_a_translated_draft_by_its_calls(
    real_vocab_pair: Callable[[str], tuple[Path, Path]], stories260k: Path
) -> None:
    """Gemma 4's tokens are about twice as long as stories260K's: each target token
    drafted takes about two draft calls, and -k auto's costs say so."""
    with open_engine(real_vocab_pair("gemma-4")[0], stories260k, "auto") as engine:
        assert engine.translation is not None
        calls = bytes_per_token(engine.model) / bytes_per_token(engine.translation.draft)
        costs = engine.costs()
        length = engine.make_decoder("model", "auto").length
        length.begin(invariant=True)  # a greedy generation's: the median's prices
        round_costs = length.costs
    assert calls > 1.5
    # A call keeps a call's price (the clock times calls); a round counts its calls.
    assert round_costs.draft_seconds == pytest.approx(
        costs.draft_over_target * costs.target_seconds
    )
    drafting = (
        round_costs.of(2)
        - round_costs.of(0)
        - (costs.verify[3] - costs.verify[1]) * costs.target_seconds
    )
    assert drafting == pytest.approx(2 * calls * round_costs.draft_seconds)
    assert length.prior == TRANSLATED_PRIOR < AutoLength.PRIOR  # and starts less trusted
    assert length.margin == TRANSLATED_MARGIN > 0  # and must promise more to go on
