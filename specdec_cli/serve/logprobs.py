"""A reply's log-probabilities in OpenAI's shapes (see decoding/logprobs.py for what
the numbers are).

Chat: `logprobs.content`, one entry per token ({token, logprob, bytes, top_logprobs}).
Completions: the legacy shape, parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (a dict token -> logprob per token) and `text_offset` (where each token's
text begins in the completion's text, in characters). Streamed, each chunk carries the
entries of the tokens whose text it carries, and the offsets run on across chunks.

Every generated token is listed, those that went to reasoning_content or into a tool
call included, in the order generated: llama-server lists every token's in
`logprobs.content` too (its probs_output is the whole generation's).
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from specdec_cli.decoding.logprobs import LogprobOptions, TokenLogprob
from specdec_cli.llamacpp.model import Model

# JSON has no -inf (Starlette refuses to write it): vLLM's stand-in for a token the
# distribution cannot draw. An emitted token never is one; a listed alternative is not.
FLOOR = -9999.0


class LogprobWriter:
    """One reply's entries, as the endpoint writes them; `write` is called with each
    chunk's tokens in turn (or once with all of them)."""

    def __init__(
        self, model: Model, chat: bool, options: LogprobOptions, shown: frozenset[int]
    ) -> None:
        """`shown`: control tokens the reply writes out (see PieceStream)."""
        self.model, self.chat, self.options, self.shown = model, chat, options, shown
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0  # characters of the completion's text so far (text_offset)

    def write(self, logprobs: Sequence[TokenLogprob]) -> dict[str, object] | None:
        """The `logprobs` object of a choice carrying these tokens (None for none)."""
        if not logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs]}
        return self._completion(logprobs)

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, object]:
        entry = self._entry(lp.token, lp.logprob, self._bytes(lp.token))
        top = [self._entry(t, v, self.model.piece(t)) for t, v in lp.top]
        entry["top_logprobs"] = top
        if self.options.post_sampling:
            # llama-server's name for the list (its clients read "prob" and "top_probs"),
            # beside OpenAI's (the openai client reads "logprob" and "top_logprobs")
            entry["top_probs"] = top
        return entry

    def _entry(self, token: int, logprob: float, data: bytes) -> dict[str, object]:
        entry: dict[str, object] = {
            "token": data.decode(errors="replace"),
            "logprob": max(logprob, FLOOR),
            "bytes": list(data),
        }
        if self.options.post_sampling:  # as llama-server answers post_sampling_probs
            entry["prob"] = math.exp(logprob)
        return entry

    def _completion(self, logprobs: Sequence[TokenLogprob]) -> dict[str, object]:
        texts, offsets = [], []
        for lp in logprobs:
            data = self._bytes(lp.token)
            offsets.append(self._offset)
            self._offset += len(self._text.decode(data))
            texts.append(data.decode(errors="replace"))
        return {
            "tokens": texts,
            "token_logprobs": [max(lp.logprob, FLOOR) for lp in logprobs],
            "top_logprobs": [
                {self.model.piece(t).decode(errors="replace"): max(v, FLOOR) for t, v in lp.top}
                for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _bytes(self, token: int) -> bytes:
        """The token's text as the reply has it (a shown control token written out)."""
        if token in self.shown:
            return self.model.token_text(token).encode()
        return self.model.piece(token)
