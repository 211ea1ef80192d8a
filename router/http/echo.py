"""The prompt in a /v1/completions response: `echo` and `prompt_logprobs`.

`echo: true` puts the prompt's text before the choice's text, as OpenAI and
vLLM do; with `logprobs` n the choice's `logprobs` then covers the prompt's
tokens first: `tokens`, `token_logprobs` (None for the first token, which
nothing predicts), `top_logprobs` (None there too; elsewhere the top n and
the prompt token itself, so up to n + 1 entries, as OpenAI documents) and
`text_offset`, then the output tokens as before. lm-evaluation-harness's
`local-completions` log-likelihood requests read exactly these (echo,
logprobs 1, max_tokens 0 or 1).

`prompt_logprobs` m (vLLM's extension) adds `choices[0].prompt_logprobs`:
None for the first token, then per prompt token a map from token id (a
string, as JSON keys are) to `{"logprob", "rank", "decoded_token"}` for the
prompt token and the top m; `rank` is the place among the top m (1 = most
likely), null for a prompt token outside them (the pods compute only the
top m, not every token's rank).

`EchoPrompt` is built by the handler (router.http.server) once per request,
off the event loop for a long prompt; `ResponseShaper` (router.http.responses)
calls the builders here on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.generation import OutputLogprobs


@dataclass(frozen=True, slots=True)
class EchoPrompt:
    """The prompt as the response shows it: `text` (what echo prepends; empty
    without echo) and each token's text (for logprobs)."""

    echo: bool
    text: str
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.token_texts):
            raise ValueError(f"{len(self.token_ids)} prompt token ids but "
                             f"{len(self.token_texts)} token texts")


def _entries(prompt: EchoPrompt, entries: Sequence[OutputLogprobs] | None
             ) -> list[OutputLogprobs | None]:
    """One entry per prompt token: None for the first (and for all, should a
    pod not have sent them: a 1-token prompt has none)."""
    entries = entries or ()
    return [None, *entries][: len(prompt.token_ids)] + [None] * (
        len(prompt.token_ids) - 1 - len(entries))


def echo_logprobs(prompt: EchoPrompt, entries: Sequence[OutputLogprobs] | None, n: int,
                  token_text: Callable[[int], str]) -> dict[str, list[Any]]:
    """The prompt's part of an echoed completion's `logprobs` (its text
    offsets start at 0)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for text, entry in zip(prompt.token_texts, _entries(prompt, entries), strict=True):
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {token_text(t): lp for t, lp in zip(entry.top_token_ids[:n],
                                                  entry.top_logprobs, strict=False)}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def vllm_prompt_logprobs(prompt: EchoPrompt, entries: Sequence[OutputLogprobs] | None, m: int,
                         token_text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """`choices[0].prompt_logprobs` in vLLM's shape."""
    out: list[dict[str, Any] | None] = []
    for token_id, text, entry in zip(prompt.token_ids, prompt.token_texts,
                                     _entries(prompt, entries), strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked: dict[str, Any] = {}
        for rank, (t, lp) in enumerate(zip(entry.top_token_ids[:m], entry.top_logprobs,
                                           strict=False), start=1):
            ranked[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
        if str(token_id) not in ranked:
            ranked = {str(token_id): {"logprob": entry.logprob, "rank": None,
                                      "decoded_token": text}, **ranked}
        out.append(ranked)
    return out


def echo_prompt(echo: bool, text: str | None, token_ids: Sequence[int],
                decode: Callable[[Sequence[int]], str],
                token_text: Callable[[int], str]) -> EchoPrompt:
    """The request's `EchoPrompt` (blocking: one decode per token; the
    handler runs a long prompt's off the event loop). `text` is the prompt
    as the client sent it, None for token ids (then their decode is echoed)."""
    shown = "" if not echo else text if text is not None else decode(token_ids)
    return EchoPrompt(echo=echo, text=shown, token_ids=tuple(token_ids),
                      token_texts=tuple(token_text(t) for t in token_ids))
