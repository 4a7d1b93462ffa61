# SPDX-License-Identifier: Apache-2.0
"""The engines a full run starts: ``conftest.INVENTORY`` is the one list, the
docs' table is generated from it, and every test file that starts an engine
is named in it."""

import os
import re

import conftest
from helpers import REPO

DOC = os.path.join(REPO, "docs", "guarantees-and-tests.md")
BEGIN = "<!-- engines: generated from tests/conftest.py INVENTORY (tests/test_inventory.py) -->"
END = "<!-- /engines -->"
# What starts a vLLM engine in a test (tests/helpers.py, tests/nodes.py).
STARTS = re.compile(r"\b(?:Server|Nodes)\(|\brun_offline\(")


def engines_table() -> str:
    rows = ["| where (tests/) | vLLM instances | EngineCores | engine-seconds | what |",
            "|---|---:|---:|---:|---|"]
    for e in conftest.INVENTORY:
        rows.append(f"| {e.where} | {e.instances} | {e.engine_cores} | {e.seconds} | {e.what} |")
    inv = conftest.INVENTORY
    rows.append(f"| **a full run** | {sum(e.instances for e in inv)} | "
                f"{sum(e.engine_cores for e in inv)} | {sum(e.seconds for e in inv)} | |")
    for e in conftest.OPT_IN_ENGINES:
        rows.append(f"| {e.where} (opt-in) | {e.instances} | {e.engine_cores} | | {e.what} |")
    rows.append(f"\nEngine-seconds: each engine's start to stop, measured on a {conftest.MEASURED}; "
                "a run prints its own at its end and fails when a full run starts other "
                "engines than this table lists.")
    return "\n".join(rows)


def doc_with_table(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{engines_table()}\n{END}{tail}"


def test_docs_engine_table_is_generated_from_conftest():
    with open(DOC) as f:
        text = f.read()
    want = doc_with_table(text)
    if os.environ.get("SHM_EMBEDS_WRITE_DOCS"):
        with open(DOC, "w") as f:
            f.write(want)
    assert text == want, ("docs/guarantees-and-tests.md drifted from conftest.INVENTORY: "
                          "SHM_EMBEDS_WRITE_DOCS=1 pytest tests/test_inventory.py")


def test_every_test_file_that_starts_an_engine_is_listed():
    named = {e.where.split()[0] for e in (*conftest.INVENTORY, *conftest.OPT_IN_ENGINES)}
    tests = os.path.join(REPO, "tests")
    starting = set()
    for name in os.listdir(tests):
        if not name.startswith(("test_", "conftest")) or not name.endswith(".py"):
            continue
        with open(os.path.join(tests, name)) as f:
            if STARTS.search(f.read()):
                starting.add(name)
    starting.discard("test_inventory.py")
    assert starting <= named, f"engines not in conftest.INVENTORY: {sorted(starting - named)}"


def test_a_run_that_starts_other_engines_than_listed_is_reported():
    """What a full run's end checks (``conftest.pytest_sessionfinish``): each
    entry started as often as listed, and nothing unlisted."""
    lines = [{"where": e.where, "s": 1.0} for e in conftest.INVENTORY for _ in range(e.instances)]
    table, diff = conftest.engine_report(lines)
    assert diff == [] and f"{len(lines):3d} x" in table
    first = conftest.INVENTORY[0]
    _, diff = conftest.engine_report(lines[1:] + [{"where": "test_x.py y", "s": 1.0}])
    assert diff == [f"{first.where}: {first.instances - 1} started, INVENTORY says "
                    f"{first.instances}", "test_x.py y: started, not in INVENTORY"]
