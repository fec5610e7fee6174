"""Every Python example of the guides and the README runs.

A page's ```` ```python ```` blocks run in order in one namespace (a page is one
test, so later blocks use what earlier ones defined), from the repository root, in
this process (compiled functions are shared between pages). A block that cannot run
here (it needs a GPU, a TPU, the ``aot`` extra, a downloaded checkpoint, several
hosts, or minutes of training) is written as ```` ```{code-block} python ```` with
``:class: no-run`` and a ``:caption:`` that says why; it is not run, and its reason is
checked to be there.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(`{3,})(.*)$")


@dataclasses.dataclass
class Block:
  page: str
  line: int  # 1-based line of the opening fence
  code: str
  run: bool
  caption: str = ""


def pages() -> list[pathlib.Path]:
  found = [
    p
    for p in sorted(DOCS.rglob("*.md"))
    if "_build" not in p.parts and "api" not in p.relative_to(DOCS).parts[:1]
  ]
  return [ROOT / "README.md"] + found


def python_blocks(path: pathlib.Path) -> list[Block]:
  """The Python blocks of a MyST page: ```python (run) and ```{code-block} python."""
  lines = path.read_text().splitlines()
  page = str(path.relative_to(ROOT))
  blocks, i = [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    ticks, info = m.group(1), m.group(2).strip()
    start = i
    body = []
    i += 1
    while i < len(lines) and lines[i].rstrip() != ticks:
      body.append(lines[i])
      i += 1
    i += 1
    if info == "python":
      blocks.append(Block(page, start + 1, "\n".join(body), run=True))
    elif re.fullmatch(r"\{code-block\}\s+python", info):
      options = {}
      while body and body[0].startswith(":"):
        key, _, value = body.pop(0)[1:].partition(":")
        options[key.strip()] = value.strip()
      no_run = "no-run" in options.get("class", "").split()
      blocks.append(
        Block(page, start + 1, "\n".join(body), run=not no_run, caption=options.get("caption", ""))
      )
  return blocks


PAGES = [p for p in pages() if any(b.run for b in python_blocks(p))]


def test_the_guides_have_examples():
  runnable = sum(b.run for p in pages() for b in python_blocks(p))
  assert len(PAGES) >= 12 and runnable >= 30, (len(PAGES), runnable)


def test_every_block_that_does_not_run_says_why():
  for path in pages():
    for block in python_blocks(path):
      if not block.run:
        assert len(block.caption) > 20, (
          f"{block.page}:{block.line}: a no-run block needs a :caption: giving the reason"
        )


@pytest.mark.docs  # CI's docs step, once (the examples call what the suite tests on every jax)
@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(path, monkeypatch):
  monkeypatch.chdir(ROOT)
  namespace: dict = {"__name__": f"docs_example_{path.stem}"}
  for block in python_blocks(path):
    if not block.run:
      continue
    try:
      exec(compile(block.code, f"{block.page}:{block.line}", "exec"), namespace)
    except Exception as e:
      raise AssertionError(
        f"the example at {block.page}:{block.line} failed: {type(e).__name__}: {e}"
      ) from e
