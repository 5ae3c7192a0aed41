"""Incremental detokenization and stop strings.

Each step decodes only a short window of the newest tokens: the text of ``ids[prefix:]`` minus
the text of ``ids[prefix:read]``. Text is held back while it ends in an incomplete UTF-8
character (U+FFFD), so multi-byte characters split over tokens come out whole.
"""

from __future__ import annotations

from minijax_serve.request import FinishReason, Req


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, req: Req) -> None:
        """Append the text of ``req``'s new output tokens to ``req.text``; finish on a stop string."""
        ids, skip = req.output_ids, req.params.skip_special_tokens
        prefix, read = req.detok_offsets
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if not req.finished and (len(after) <= len(before) or after.endswith("\ufffd")):
            return
        req.detok_offsets = (read, len(ids))
        old_len = len(req.text)
        req.text += after[len(before):]
        self._check_stop_strings(req, old_len)

    @staticmethod
    def _check_stop_strings(req: Req, old_len: int) -> None:
        for stop in req.params.stop:
            idx = req.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx >= 0:
                req.text = req.text[:idx]
                req.finish_reason = FinishReason.STOP
                return
