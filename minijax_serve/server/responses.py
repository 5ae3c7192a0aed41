"""The OpenAI response bodies: completions and chat completions, whole or as streamed chunks.

A :class:`Choices` accumulates the Deltas of one HTTP request's choices (prompt index * n +
sample index) and writes either form: the whole answer once every choice finished, or one chunk
per Delta as it comes (the completions API's ``text`` or the chat API's ``delta``, the role
first), and the usage chunk at the end.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from minijax_serve.server.deltas import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TokenText:
    """Token id -> its text (decoded alone; ``token_id:<id>`` with ``as_ids``), cached: the
    strings of logprobs."""

    def __init__(self, tokenizer: Any, as_ids: bool = False):
        self._tokenizer, self._as_ids = tokenizer, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = f"token_id:{token}" if self._as_ids else self._tokenizer.decode([token])
            self._cache[token] = text
        return text


def top_items(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The top ``k`` of one engine logprob dict (the chosen token first, then the top k not
    chosen: k + 1 entries when the chosen one is outside the top k): chat's ``top_logprobs``.
    The completions API's has the chosen token besides (OpenAI's "up to logprobs + 1")."""
    items = list(lp.items())
    return items[1:] if len(items) > k else sorted(items, key=lambda kv: -kv[1])


class Choices:
    """The state of one HTTP request's choices and how to write them, for either endpoint."""

    def __init__(self, chat: bool, model: str, prompt_lengths: list[int], n: int,
                 top_logprobs: int | None, token_text: TokenText,
                 echo: list[tuple[str, list[int]]] | None = None, echo_only: bool = False):
        """``n`` choices per prompt; ``echo``: each choice's prompt (text, token ids), to start
        its answer with; ``echo_only``: the answer is that alone (the outputs are dropped)."""
        num_choices = len(prompt_lengths) * n
        self.chat, self.model, self.n = chat, model, n
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.k = top_logprobs
        self.token_text = token_text
        self.prompt_tokens = sum(prompt_lengths)
        self.cached_tokens = [0] * num_choices
        self.text = [""] * num_choices
        self.num_tokens = [0] * num_choices
        self.finish = [None] * num_choices
        self.offset = [0] * num_choices  # completions' text_offset so far
        self.logprobs: list[list[Any]] = [[] for _ in range(num_choices)]
        self.started = [False] * num_choices  # a chat stream sent the role chunk
        self.echo, self.echo_only = echo, echo_only
        self.echoed = [echo is None] * num_choices
        self.weights_version = 0  # the newest any of its tokens came from (update_weights)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; a prompt's cached tokens are those of its first sample's."""
        completion = sum(self.num_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens[::self.n])}}

    def add(self, d: Delta) -> tuple[str, Any]:
        """Record a Delta; returns the text it adds and its logprobs in the endpoint's form
        (None if not asked): the echoed prompt's first, on the choice's first tokens."""
        i = d.choice
        if self.echo_only:  # the one token generated is dropped: max_tokens 0 reached
            finish = d.finish_reason if d.finish_reason in (None, "abort") else "length"
            d = d._replace(token_ids=[], text="", num_output_tokens=0, finish_reason=finish,
                           logprobs=None if d.logprobs is None else [])
        echo = not self.echoed[i] and (d.token_ids or d.prompt_logprobs is not None
                                       or d.finish_reason is not None)
        if echo:
            self.echoed[i] = True
            d = self._echoed(d, *self.echo[i])
        self.text[i] += d.text
        self.num_tokens[i] = d.num_output_tokens
        self.cached_tokens[i] = d.cached_tokens
        self.weights_version = max(self.weights_version, d.weights_version)
        if d.finish_reason is not None:
            self.finish[i] = d.finish_reason
        if self.k is None or d.logprobs is None:
            return d.text, None
        lps = self._chat_logprobs(d) if self.chat else self._completion_logprobs(d)
        self.logprobs[i].append(lps)
        return d.text, lps

    def _echoed(self, d: Delta, text: str, ids: list[int]) -> Delta:
        """``d`` with the prompt before its tokens; its logprobs with the prompt's (None for
        the first prompt token, as OpenAI's)."""
        lps = None
        if d.logprobs is not None and d.prompt_logprobs is not None:
            lps = [*d.prompt_logprobs, *d.logprobs]
        return d._replace(token_ids=[*ids, *d.token_ids], text=text + d.text, logprobs=lps)

    def _chat_logprobs(self, d: Delta) -> list[dict[str, Any]]:
        def entry(token: int, value: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return [{**entry(t, lp[t]), "top_logprobs": [entry(a, v) for a, v in top_items(lp, self.k)]}
                for t, lp in zip(d.token_ids, d.logprobs)]

    def _completion_logprobs(self, d: Delta) -> dict[str, list[Any]]:
        tokens = [self.token_text(t) for t in d.token_ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset[d.choice])
            self.offset[d.choice] += len(text)
        return {"tokens": tokens, "token_logprobs": [
                    None if lp is None else lp[t] for t, lp in zip(d.token_ids, d.logprobs)],
                "top_logprobs": [None if lp is None else {  # the top k and the chosen one
                    self.token_text(a): v for a, v in sorted(lp.items(), key=lambda kv: -kv[1])}
                    for lp in d.logprobs],
                "text_offset": offsets}

    def _joined_logprobs(self, i: int) -> Any:
        if self.k is None:
            return None
        parts = self.logprobs[i]
        if self.chat:
            return {"content": [e for part in parts for e in part], "refusal": None}
        return {key: [v for part in parts for v in part[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "weights_version": self.weights_version}

    def body(self) -> dict[str, Any]:
        """The whole answer (every choice finished)."""
        choices = []
        for i, text in enumerate(self.text):
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=self._joined_logprobs(i), finish_reason=self.finish[i])
            choices.append(choice)
        return {**self._head(self.object), "choices": choices, "usage": self.usage()}

    def chunks(self, d: Delta, include_usage: bool,
               continuous: bool = False) -> list[dict[str, Any]]:
        """The stream chunks of a Delta (recorded by this call); with ``continuous`` each
        carries the usage so far, else ``"usage": null`` when the last chunk will have it."""
        text, logprobs = self.add(d)
        i, out = d.choice, []
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        usage = {"usage": self.usage() if continuous else None} if include_usage else {}
        if self.chat and not self.started[i]:
            self.started[i] = True
            out.append({**self._head(obj), "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}], **usage})
        if text or logprobs or d.finish_reason is not None:
            if self.chat:
                delta = {"content": text} if text or logprobs else {}
                choice = {"index": i, "delta": delta, "logprobs":
                          None if logprobs is None else {"content": logprobs, "refusal": None}}
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs}
            choice["finish_reason"] = d.finish_reason
            out.append({**self._head(obj), "choices": [choice], **usage})
        return out

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}
