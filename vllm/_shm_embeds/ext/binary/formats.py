# SPDX-License-Identifier: Apache-2.0
"""The API server's body formats: the one registry (``gate.BodyGate`` offers a
request to them in order; the first that claims it takes it).

The binary format is this extension's; another extension adds one by
providing a ``body_formats`` entry (``extensions.Extension.provides``): a dict
with this class's fields, ``target`` relative to that extension's folder.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from vllm._shm_embeds import extensions


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """One body format.

    Attributes:
        name: as in logs and ``BodyFormat.name``.
        target: ``"<module>:<class>"`` of ``package``, loaded when the gate is built.
        group: the ``sites`` group whose sites it needs (its placeholders
            resolved, its metrics): off when that group is.
        enabled: whether the configuration turns it on.
        what: a line for the start-up log.
        order: the gate offers a body to lower orders first.
        package: the extension package that holds ``target``.
    """

    name: str
    target: str
    group: str
    enabled: Callable[[], bool]
    what: str
    order: int = 0
    package: str = __name__.rpartition(".")[0]

    def load(self):
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(f"{self.package}.{module}"), cls)()


def formats() -> tuple[Format, ...]:
    """Every format, in the order the gate offers bodies to them."""
    found = [Format(name="binary", target="binary:BinaryFormat", group="binary", order=10,
                    enabled=lambda: True,
                    what="binary prompt_embeds bodies (application/octet-stream, "
                         "Inference-Header-Content-Length)")]
    for ext, entry in extensions.provided("body_formats"):
        found.append(Format(package=extensions.package_of(ext), **entry))
    return tuple(sorted(found, key=lambda f: f.order))
