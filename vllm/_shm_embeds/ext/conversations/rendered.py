# SPDX-License-Identifier: Apache-2.0
"""A kept chat turn's rendered prompt (:class:`Rendered`), and its bytes between
sibling API servers (:func:`pack`, :func:`unpack`: token ids as ``int32``, then each
embeds part's ``(start, rows)`` as two ``int64``). Knows arrays, not vLLM.
May import: nothing of this project.
"""

from __future__ import annotations

import array
import dataclasses

ID = array.array("i").itemsize  # bytes of a token id on the wire (4)
SPAN = 2 * array.array("q").itemsize  # bytes of one part's (start, rows) (16)


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A kept chat turn's prompt: its ``rows`` first ``token_ids`` (vLLM's expanded ids,
    the placeholder id on embeds rows; ``array('i')``, 4 bytes a row, one array for the
    turns of one tip: a grown turn extends its base's) and ``positions`` (``(start,
    rows)`` of each embeds part, in order), as vllm/renderers/hf.py (0.32) passes them
    to ``_build_mixed_prompt_embeds``."""

    token_ids: array.array
    positions: tuple[tuple[int, int], ...]
    rows: int


def pack(r: Rendered) -> bytes:
    """``r``'s first ``rows`` token ids, then its positions."""
    spans = array.array("q", [v for span in r.positions for v in span])
    return r.token_ids[:r.rows].tobytes() + spans.tobytes()


def unpack(blob: bytes, rows: int, parts: int) -> Rendered | None:
    """The :class:`Rendered` of ``rows`` rows and ``parts`` embeds parts :func:`pack`
    made, or None: other sizes, parts out of order, overlapping or past ``rows``."""
    if (type(rows) is not int or type(parts) is not int or rows < 1 or parts < 1
            or len(blob) != rows * ID + parts * SPAN):
        return None
    ids = array.array("i")
    ids.frombytes(blob[:rows * ID])
    flat = array.array("q")
    flat.frombytes(blob[rows * ID:])
    positions, at = [], 0
    for i in range(0, len(flat), 2):
        start, n = flat[i], flat[i + 1]
        if start < at or n < 1 or start + n > rows:
            return None
        positions.append((start, n))
        at = start + n
    return Rendered(ids, tuple(positions), rows)
