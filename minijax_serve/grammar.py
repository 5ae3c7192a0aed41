"""Structured output: a request's ``json_schema``, ``regex`` or ``ebnf`` as a token mask for each
step it samples, by llguidance (a grammar library vLLM and SGLang also run; the ``structured``
extra).

Each constrained request holds a matcher that has consumed its output tokens so far. At launch
the engine fills a bitmask of one row per sequence (bit ``t % 32`` of word ``t // 32`` set:
token ``t`` allowed; every bit set in the rows of unconstrained sequences) and the sampler
drops every token not allowed; when the step's tokens reach
the host, each matcher consumes its request's token (:meth:`Scheduler.process`), and a request
whose grammar is complete stops. The mask of a step needs the token of the step before it, so
with overlap scheduling a step holding a constrained request is taken before the next launch.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from minijax_serve.sampling_params import SamplingParams


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ValueError("json_schema, regex and ebnf need llguidance: pip install "
                         "'minijax_serve[structured]'") from None
    return llguidance


class GrammarCompiler:
    """Matchers over one tokenizer: the model's vocabulary (ids past the tokenizer's never
    allowed) and its EOS ids."""

    FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        if tokenizer is None:
            raise ValueError("json_schema, regex and ebnf need a tokenizer (the engine was made "
                             "with skip_tokenizer_init=True)")
        self._llg = _llguidance()
        eos = sorted(eos_ids)
        self._tokenizer = self._llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=eos[0] if len(eos) == 1 else eos)
        self.vocab_size = vocab_size
        self.mask_width = (vocab_size + 31) // 32

    def matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher of ``params``' grammar; ValueError naming the field if it is bad."""
        field, text = params.grammar
        try:
            grammar = self._llg.grammar_from(self.FORMATS[field], text)
            matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"{field}: {e}") from None
        if matcher.is_error():
            raise ValueError(f"{field}: {matcher.get_error()}")
        return matcher

    def masks(self, reqs: list, samples: np.ndarray, num_rows: int) -> np.ndarray:
        """[num_rows, mask_width] int32: each sampling constrained request's allowed tokens in
        its row, every token elsewhere."""
        mask = np.full((num_rows, self.mask_width), -1, np.int32)
        for row, (req, sampled) in enumerate(zip(reqs, samples.tolist())):
            if sampled and req.grammar is not None:
                self._llg.numpy.fill_next_token_bitmask(req.grammar, mask, row)
        return mask
