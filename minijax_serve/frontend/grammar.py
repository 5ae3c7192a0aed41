"""Structured output: a request's ``json_schema``, ``regex`` or ``ebnf`` as a token mask for each
step it samples, by llguidance (a grammar library vLLM and SGLang also run; the ``structured``
extra).

Each constrained request holds a matcher that has consumed its output tokens so far. At launch
the engine fills a bitmask of one row per sequence (bit ``t % 32`` of word ``t // 32`` set:
token ``t`` allowed; every bit set in the rows of unconstrained sequences) and the sampler
drops every token not allowed; when the step's tokens reach
the host, each matcher consumes its request's token (:meth:`Scheduler.process`), and a request
whose grammar is complete stops. The mask of a step needs the token of the step before it, so
with overlap scheduling a step in flight holding a constrained request is taken once the next
step's model is dispatched, before its sampler: the host waits for it and fills the masks while
the device runs the model.
"""

from __future__ import annotations

import collections
import importlib.util
import threading
from typing import Any, Iterable

import numpy as np

from minijax_serve.core.sampling_params import SamplingParams

CACHED_GRAMMARS = 64  # compiled grammars kept, the least recently used dropped first


def available() -> bool:
    """llguidance is installed (the ``structured`` extra)."""
    return importlib.util.find_spec("llguidance") is not None


def _llguidance(field: str):
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ValueError(f"{field}: structured output needs llguidance: pip install "
                         "'minijax_serve[structured]'") from None
    return llguidance


class GrammarCompiler:
    """Matchers over one tokenizer: the model's vocabulary (ids past the tokenizer's never
    allowed) and its EOS ids.

    Thread-safe (the server checks a request's grammar on a worker thread, the engine's thread
    makes its matcher). The tokenizer is converted for llguidance on first use (about 0.4 s for
    SmolLM2's; a failure is kept and raised again), and the last :data:`CACHED_GRAMMARS` grammars
    compiled are kept, so a grammar checked before it is queued, or sent again (one JSON schema
    for every request), is compiled once and each of its requests gets a copy.
    """

    FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        self._hf_tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        self._tokenizer: Any = None
        self._llg: Any = None
        self._load_error: str | None = None  # the conversion failed: not tried again
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.mask_width = (vocab_size + 31) // 32

    def _load(self, field: str) -> Any:
        """The llguidance module, with the tokenizer converted; ValueError (naming ``field``)
        without llguidance or a tokenizer."""
        llg = _llguidance(field)
        if self._hf_tokenizer is None:
            raise ValueError(f"{field}: structured output needs a tokenizer (the engine was made "
                             "with skip_tokenizer_init=True)")
        with self._lock:
            if self._tokenizer is None and self._load_error is None:
                eos = self._eos
                try:
                    self._tokenizer = llg.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size,
                        eos_token=eos[0] if len(eos) == 1 else eos)
                    self._llg = llg
                except ValueError as e:  # e.g. a tokenizer of more tokens than the vocabulary
                    self._load_error = (f"llguidance cannot take this tokenizer with the model's "
                                        f"vocabulary of {self.vocab_size}: {e}")
            if self._load_error is not None:
                raise ValueError(f"{field}: {self._load_error}")
        return llg

    def matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher of ``params``' grammar; ValueError naming the field if it is bad."""
        key = field, text = params.grammar
        llg = self._load(field)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
        try:
            grammar = llg.grammar_from(self.FORMATS[field], text)
            compiled = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"{field}: {e}") from None
        if compiled.is_error():
            raise ValueError(f"{field}: {compiled.get_error()}")
        # the first mask tells a grammar that admits no string, e.g. {"$ref": "#"}; one whose
        # every string is infinite (a required self-reference) starts well: it ends at
        # max_tokens, llguidance cannot tell it in advance
        llg.numpy.fill_next_token_bitmask(compiled, np.zeros((1, self.mask_width), np.int32), 0)
        if compiled.is_stopped() and not compiled.is_accepting():
            raise ValueError(f"{field}: no output satisfies this grammar (it admits no string)")
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()

    def masks(self, reqs: list, samples: np.ndarray, num_rows: int) -> np.ndarray:
        """[num_rows, mask_width] int32: each sampling constrained request's allowed tokens in
        its row, every token elsewhere (also for a request that finished after the step was
        scheduled: its token will be dropped)."""
        mask = np.full((num_rows, self.mask_width), -1, np.int32)
        for row, (req, sampled) in enumerate(zip(reqs, samples.tolist())):
            if sampled and req.grammar is not None and not req.finished:
                self._llg.numpy.fill_next_token_bitmask(req.grammar, mask, row)
        return mask
