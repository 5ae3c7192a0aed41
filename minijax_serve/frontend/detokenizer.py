"""Incremental detokenization and stop strings.

Each step decodes only a short window of the newest tokens: the text of ``seq[prefix:]`` minus
the text of ``seq[prefix:read]``, where the window first starts on the prompt's last tokens (as
vLLM's and SGLang's: a SentencePiece decoder strips the leading space of what it decodes first;
not when the prompt ends inside a UTF-8 character).
Text is held back while it ends in an incomplete UTF-8 character (U+FFFD), so multi-byte
characters split over tokens come out whole. The EOS or stop token that ends a request is not
decoded, nor is a stop string kept (as in vLLM and SGLang; the token stays in the token ids),
unless ``include_stop_str_in_output``. Of the decoded text, a tail that
could still be the start of a stop string is not final yet (``Req.visible_len`` stops before
it): a caller never sees text that a stop string later cuts. Stop strings end a request only
from ``min_new_tokens`` output tokens on, as EOS and stop tokens do.
"""

from __future__ import annotations

from typing import Sequence

from minijax_serve.core.request import FinishReason, Req


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """The longest tail of ``text`` that is a proper prefix of one of ``stops``."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def _plain_fast_tokenizer(tokenizer) -> bool:
    """A transformers fast tokenizer whose ``decode`` is the library's own (no subclass
    rewrites the text) and applies no clean-up."""
    cls = type(tokenizer)
    return (getattr(tokenizer, "backend_tokenizer", None) is not None
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
            and getattr(cls.decode, "__qualname__", "") == "PreTrainedTokenizerBase.decode"
            and getattr(getattr(cls, "_decode", None), "__qualname__", "")
            == "TokenizersBackend._decode")


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = tokenizer.decode
        self._batch = None
        if _plain_fast_tokenizer(tokenizer):
            # the same text: such a tokenizer's decode is its backend's plus an optional
            # clean-up (off here), and the wrapper's argument handling cost ~5 µs a call; its
            # backend decodes a whole step's windows in one call
            self._decode = tokenizer.backend_tokenizer.decode
            self._batch = tokenizer.backend_tokenizer.decode_batch

    def _decode_all(self, windows: list[list[int]], skips: list[bool]) -> list[str]:
        """The text of each window, in one call per value of ``skip_special_tokens`` where the
        tokenizer can."""
        if self._batch is None:
            return [self._decode(w, skip_special_tokens=s) for w, s in zip(windows, skips)]
        texts: list[str] = [""] * len(windows)
        for skip in set(skips):
            rows = [i for i, s in enumerate(skips) if s == skip]
            for i, text in zip(rows, self._batch([windows[i] for i in rows],
                                                 skip_special_tokens=skip)):
                texts[i] = text
        return texts

    def update(self, req: Req) -> None:
        """Append the text of ``req``'s new output tokens to ``req.text`` (all of it once the
        request is finished, but for the EOS or stop token that ended it, unless
        ``include_stop_str_in_output``); finish on a stop string; advance ``req.visible_len``."""
        self.update_all([req])

    def update_all(self, reqs: Sequence[Req]) -> None:
        """:meth:`update` each of ``reqs``, their windows decoded together."""
        windows = []
        for req in reqs:
            n = len(req.prompt_ids)
            end = len(req.output_ids) - (req.stopped_on_token
                                         and not req.params.include_stop_str_in_output)
            prefix, read = req.detok_offsets  # output positions; negative ones are the prompt's
            windows.append((req.token_ids(n + prefix, n + read), req.token_ids(n + prefix, n + end),
                            end))
        skips = [req.params.skip_special_tokens for req in reqs]
        befores = self._decode_all([w[0] for w in windows], skips)
        afters = self._decode_all([w[1] for w in windows], skips)
        for req, (_, _, end), before, after, skip in zip(reqs, windows, befores, afters, skips):
            if req.detok_offsets[0] < 0 and "\ufffd" in before:
                # the prompt ends inside a character: no context
                req.detok_offsets, before = (0, 0), ""
                after = self._decode(req.token_ids(len(req.prompt_ids), len(req.prompt_ids) + end),
                                     skip_special_tokens=skip)
            self._advance(req, before, after, end)

    def _advance(self, req: Req, before: str, after: str, end: int) -> None:
        """Take the text ``after`` adds to ``before`` (the window's texts) if it is final."""
        if req.finished or (len(after) > len(before) and not after.endswith("\ufffd")):
            req.detok_offsets = (req.detok_offsets[1], end)
            old_len = len(req.text)
            req.text += after[len(before):]
            if req.reached_min_new_tokens:
                self._check_stop_strings(req, old_len)
        held = 0 if req.finished else stop_prefix_len(req.text, req.params.stop)
        req.visible_len = len(req.text) - held

    @staticmethod
    def _check_stop_strings(req: Req, old_len: int) -> None:
        """Cut the text at the earliest stop string that the new text completes."""
        found = [(i, len(stop)) for stop in req.params.stop
                 if (i := req.text.find(stop, max(0, old_len - len(stop) + 1))) >= 0]
        if found:
            start, length = min(found)
            keep = req.params.include_stop_str_in_output
            req.text = req.text[:start + length if keep else start]
            req.finish_reason = FinishReason.STOP
