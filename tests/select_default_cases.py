"""Chooses the parametrized test cases that leave the default run: ``tests/slow_cases.txt``.

Every test function keeps at least one case in the default run. Beyond that, a case moves to
``slow`` only when each branch (an arc between two lines) it takes in ``attnjax/`` and
``experiments/`` is also taken by a test that stays: no code path loses its only default
test. The slowest cases are considered first. Tests whose work runs in another process
(which the coverage run does not see) and the listed whole-file exceptions are kept.

Regenerate after adding or changing parametrized tests::

  pip install coverage pytest-cov
  ATTNJAX_TEST_ALL_CASES=1 python -m pytest -n 2 --cov=attnjax --cov=experiments \
      --cov-branch --cov-context=test --cov-report= --durations=0 | tee durations.log
  python tests/select_default_cases.py .coverage durations.log > tests/slow_cases.txt

(``ATTNJAX_TEST_ALL_CASES=1`` runs the cases already listed too, so they can come back.)
Cases that are ``slow`` in the source (cross products) are not measured and not listed.
"""

from __future__ import annotations

import collections
import re
import sqlite3
import sys

# Their work runs in subprocesses (or is a page, a notebook, a published example): each case
# is its own check whatever the coverage of this process says.
KEEP_FILES = (
  "tests/test_context_parallel.py",
  "tests/test_multiprocess.py",
  "tests/test_notebooks.py",
  "tests/test_cli.py",
  "tests/test_traces.py",
  "tests/test_imports.py",
  "tests/test_docs_examples.py",
  "tests/test_docs_api.py",
  "tests/test_trust.py",
  "tests/test_release.py",
  "tests/test_docs_site.py",
  "tests/test_readme.py",
  "tests/test_packaging.py",
  "tests/test_private_names.py",
)
# Test functions whose every case is a documented part of the default run: the block-wise
# engine takes every normaliser through the normaliser seam once (tests/engine_base.py).
KEEP_FUNCTIONS = ("tests/test_blockwise.py::TestBlockwise::test_every_normaliser_once",)
SOURCES = ("/attnjax/", "/experiments/")
# Cases cheaper than this (setup + call + teardown in the measuring run) stay: moving them
# would save little and thin the default run's inputs.
MIN_SECONDS = 0.5


def arcs_by_test(path: str) -> dict[str, set]:
  """nodeid -> the arcs its setup, call and teardown took in the measured sources."""
  db = sqlite3.connect(path)
  files = {i: p for i, p in db.execute("select id, path from file")}
  contexts = {i: c.rsplit("|", 1)[0] for i, c in db.execute("select id, context from context")}
  out: dict[str, set] = collections.defaultdict(set)
  for file_id, context_id, a, b in db.execute("select file_id, context_id, fromno, tono from arc"):
    if any(s in files[file_id] for s in SOURCES) and contexts.get(context_id):
      out[contexts[context_id]].add((file_id, a, b))
  return out


def durations(path: str) -> dict[str, float]:
  """nodeid -> seconds (setup + call + teardown) from pytest's ``--durations=0`` lines."""
  out: dict[str, float] = collections.defaultdict(float)
  for line in open(path, encoding="utf-8", errors="replace"):
    m = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
    if m:
      out[m.group(2)] += float(m.group(1))
  return out


def select(arcs: dict[str, set], seconds: dict[str, float]) -> list[str]:
  """The node ids that move to ``slow``: slowest first, each only if its function keeps a
  case, it costs at least ``MIN_SECONDS`` and no arc it takes would be left untested."""
  groups: dict[str, list[str]] = collections.defaultdict(list)
  for nodeid in arcs:
    if "[" in nodeid and not nodeid.startswith(KEEP_FILES + KEEP_FUNCTIONS):
      groups[nodeid.split("[", 1)[0]].append(nodeid)
  count = collections.Counter(arc for test in arcs.values() for arc in test)
  kept = {g: len(ids) for g, ids in groups.items()}
  candidates = sorted(
    (n for ids in groups.values() for n in ids), key=lambda n: -seconds.get(n, 0.0)
  )
  moved = []
  for nodeid in candidates:
    group = nodeid.split("[", 1)[0]
    if (
      seconds.get(nodeid, 0.0) < MIN_SECONDS
      or kept[group] == 1
      or any(count[a] == 1 for a in arcs[nodeid])
    ):
      continue
    for a in arcs[nodeid]:
      count[a] -= 1
    kept[group] -= 1
    moved.append(nodeid)
  return sorted(moved)


def main(argv: list[str]) -> None:
  coverage_file, durations_log = argv
  arcs, seconds = arcs_by_test(coverage_file), durations(durations_log)
  moved = select(arcs, seconds)
  total = sum(seconds.values())
  saved = sum(seconds.get(n, 0.0) for n in moved)
  print(
    f"# {len(moved)} cases whose every branch another default test takes "
    f"({saved:.0f} s of {total:.0f} s in the run that measured them); "
    f"regenerate with tests/select_default_cases.py"
  )
  for nodeid in moved:
    print(nodeid)


if __name__ == "__main__":
  main(sys.argv[1:])
