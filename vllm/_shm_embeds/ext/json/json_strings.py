# SPDX-License-Identifier: Apache-2.0
"""The long strings of a JSON body, found in linear time, and its skeleton.

:func:`find_long_strings` (:func:`scan_strings`) gives the spans of the JSON
strings of at least :data:`MIN_STRING_BYTES` plain bytes (a base64 payload: no
quote, no backslash), whatever the escapes elsewhere: a regular expression skips
the rest in C; :func:`build_skeleton` puts a placeholder in each span. An
unterminated string raises :class:`Fallback` (the body goes to vLLM as sent).
The body format is ``ext/json/json_body.py``.

Knows bytes and regular expressions; nothing of tensors, segments, HTTP or vLLM.
"""

from __future__ import annotations

import functools
import mmap
import re

MIN_STRING_BYTES = 1024  # shorter strings stay in the skeleton as they are


class Fallback(Exception):
    """The body goes to the stock app unchanged; ``reason`` names the counter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# One JSON string (escapes included), possessive: linear time, no backtracking.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)


@functools.lru_cache(maxsize=4)
def _skip(min_len: int) -> re.Pattern:
    """Everything up to the next string that starts with ``min_len`` plain
    bytes: text outside strings, strings shorter than that, and strings with
    an escape within their first ``min_len`` bytes (matched in C)."""
    short = rb'"[^"\\]{0,%d}+(?:"|\\.(?:[^"\\]++|\\.)*+")' % (min_len - 1)
    return re.compile(rb'(?:[^"]++|' + short + rb')*+', re.DOTALL)


def scan_strings(raw: bytes | mmap.mmap,
                 min_len: int = MIN_STRING_BYTES) -> tuple[list[tuple[int, int]], int]:
    """:func:`find_long_strings`, and how many steps of Python it took.

    Steps are at most ``len(raw) // min_len + 2``: each but the last passes a
    string of at least ``min_len`` bytes; the rest is matched in C in linear
    time (:func:`_skip`, :data:`_STRING`, ``find``).
    """
    spans: list[tuple[int, int]] = []
    skip = _skip(max(1, min_len)).match
    find = raw.find
    pos, size, steps = 0, len(raw), 0
    while True:
        steps += 1
        pos = skip(raw, pos).end()
        if pos >= size:
            return spans, steps
        end = find(b'"', pos + 1)  # raw[pos] opens a string of min_len plain bytes or more
        if end < 0:
            raise Fallback("unterminated")
        if find(b"\\", pos + 1, end) < 0:
            if end - pos - 1 >= min_len:
                spans.append((pos + 1, end))
            pos = end + 1
            continue
        m = _STRING.match(raw, pos)  # a long string with an escape: not ours
        if m is None:
            raise Fallback("unterminated")
        pos = m.end()


def find_long_strings(raw: bytes | mmap.mmap,
                      min_len: int = MIN_STRING_BYTES) -> list[tuple[int, int]]:
    """``(start, end)`` of the contents of every JSON string of ``raw`` at
    least ``min_len`` bytes long that holds no backslash escape.

    Scans string by string from the start (outside strings a ``"`` always
    opens one in valid JSON), in time linear in ``len(raw)`` whatever the
    escapes (:func:`scan_strings`); on input that is not valid JSON the
    result is meaningless, and ``json.loads`` of the skeleton rejects it.
    Raises:
        Fallback: ``unterminated`` string.
    """
    return scan_strings(raw, min_len)[0]


def build_skeleton(raw: bytes, spans: list[tuple[int, int]], names: list[str]) -> bytes:
    """``raw`` with the contents of each span replaced by the matching name."""
    out, pos = [], 0
    for (a, b), name in zip(spans, names):
        out += [raw[pos:a], name.encode()]
        pos = b
    out.append(raw[pos:])
    return b"".join(out)
