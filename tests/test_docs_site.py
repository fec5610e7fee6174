"""The built site renders in a real browser: the index, the dot_product_attention page and
notebook 04 with its plots, opened in headless Chromium.

The site is built (``sphinx-build -W``, incremental: an unchanged notebook is not executed
again) into ``docs/_build/html``; each page is loaded by Chromium, which writes its DOM
and a screenshot to ``docs/_build/screenshots/`` (look at them). Skipped without Sphinx
(the ``docs`` extra) or without a Chromium binary (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
HTML = ROOT / "docs" / "_build" / "html"
SHOTS = ROOT / "docs" / "_build" / "screenshots"
PAGES = {  # name: (page, texts it must show, screenshot height: the notebook's whole page)
  "index": ("index.html", ["attnjax", "Dense attention and normalisers", "API reference"], 2400),
  "dot_product_attention": (
    "api/_generated/attnjax.dot_product_attention.html",
    ["attnjax.dot_product_attention", "normalizer", "Parameters"],
    2400,
  ),
  "notebook_04": (
    "notebooks/04_attention_sinks.html",
    ["Attention sinks", "First-token attention per layer"],
    14000,
  ),
}


def chromium() -> str | None:
  for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
    if path := shutil.which(name):
      return path
  return None


@pytest.fixture(scope="module")
def site() -> pathlib.Path:
  if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
    pytest.skip("needs the 'docs' extra (sphinx, myst-nb)")
  if chromium() is None:
    pytest.skip("no Chromium binary (apt-get install chromium)")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, "-m", "sphinx", "-W", "-b", "html", str(ROOT / "docs"), str(HTML)],
    capture_output=True,
    text=True,
    env=env,
    timeout=3600,
  )
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  SHOTS.mkdir(parents=True, exist_ok=True)
  return HTML


def browse(url: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [
      chromium(),
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--hide-scrollbars",
      "--virtual-time-budget=5000",
      *args,
      url,
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_renders_in_chromium(site, name):
  path, expected, height = PAGES[name]
  url = (site / path).as_uri()
  dom = browse(url, "--dump-dom").stdout
  (SHOTS / f"{name}.html").write_text(dom)
  for text in expected:
    assert text in dom, f"{path}: {text!r} not in the rendered page"
  shot = SHOTS / f"{name}.png"
  shot.unlink(missing_ok=True)
  browse(url, f"--screenshot={shot}", f"--window-size=1280,{height}")
  assert shot.is_file() and shot.stat().st_size > 20_000, f"no screenshot of {path}"
  if name == "notebook_04":
    images = re.findall(r'<img[^>]+src="([^"]+\.png)"', dom)
    assert len(images) >= 3, f"notebook 04 shows {len(images)} plots"
    assert all((site / "notebooks" / src).is_file() for src in images), images
