"""Every notebook runs top to bottom on small inputs; none is committed with outputs."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient


NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# The kernels compile many small programs once each: XLA's optimisation passes would cost
# them more than they save (as in the tests' own process: see conftest).
FAST_COMPILES = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def execute(path: pathlib.Path, env: dict) -> nbformat.NotebookNode:
  nb = nbformat.read(path, as_version=4)
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    NotebookClient(
      nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  return nb


@pytest.mark.parametrize(
  "path", [p for p in NOTEBOOKS if p.name.startswith(("01", "02"))], ids=lambda p: p.stem
)
@pytest.mark.slow  # ~20 s each: the docs build (CI) executes every notebook
def test_function_notebooks_execute(path):
  nb = execute(path, {"ATTNJAX_NB_QUICK": "1", **FAST_COMPILES})
  images = sum(
    "image/png" in o.get("data", {})
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
  )
  assert images >= 3, f"{path.name} produced {images} figures"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_are_committed_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")


@pytest.fixture(scope="module")
def tiny_sweep_root(tmp_path_factory, compilation_cache):
  """One tiny LR sweep (2 variants x 2 LRs x 2 seeds, one LR diverges), by the project's sweep."""
  del compilation_cache  # requested for its effect: arms of one variant share programs
  from attnjax._src.train import config as config_lib
  from attnjax._src.train import sweep

  root = tmp_path_factory.mktemp("lr_sweep")
  base = config_lib.base_config()
  base.data.update(dict(name="bigram_backcopy", seq_len=16, batch_size=8, bb_vocab_size=16))
  base.model.update(dict(d_model=16, num_layers=1, num_heads=2, mlp_ratio=2))
  base.train.update(
    dict(
      steps=12,
      log_every=4,
      eval_every=12,
      eval_batches=1,
      probe_every=6,
      probe_batch=8,
      probe_len=16,
      checkpoint_every=0,
      num_devices=1,
      progress=False,
      plots=False,
    )
  )
  pairs = [(v, lr) for v in ("dense", "cosine") for lr in (1e-2, 1e3)]
  arms = sweep.variant_lr_arms(base, str(root), pairs, [0, 1])  # 2 seeds each, stacked
  statuses = [s["status"] for s in sweep.run_sweep(arms, verbose=False)]
  assert statuses == ["finished", "finished", "diverged", "diverged"] * 2, statuses
  return root


@pytest.mark.slow  # ~40 s: the docs build (CI) executes every notebook
def test_run_dir_notebooks_execute(tiny_sweep_root):
  """03 and 04 on the same tiny run root (one test, so the root is trained once per test run),
  named relative to the directory Jupyter was started in ($PWD; the kernel runs in
  notebooks/), as the docs' ``ATTNJAX_RUN_DIR=runs/compare jupyter ...`` does."""
  launched = {"ATTNJAX_RUN_DIR": tiny_sweep_root.name, "PWD": str(tiny_sweep_root.parent)}
  for name in ("03_training_stability.ipynb", "04_attention_sinks.ipynb"):
    path = NOTEBOOKS[0].parent / name
    nb = execute(path, {**launched, **FAST_COMPILES})
    images = sum(
      "image/png" in o.get("data", {})
      for c in nb.cells
      if c.cell_type == "code"
      for o in c.get("outputs", [])
    )
    assert images >= 3, f"{name} produced {images} figures"
    # The report's tables are displayed rendered (IPython's Markdown), not printed as source.
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert any("| variant |" in o.get("data", {}).get("text/markdown", "") for o in outputs), name
    assert not any("| variant |" in o.get("text", "") for o in outputs), name


@pytest.mark.docs  # CI's docs step, beside the site build that executes every notebook
def test_pretrained_notebook_builds_its_own_run_and_executes():
  """05 without ATTNJAX_RUN_DIR: a tiny run of experiments/pretrained.py on a test checkpoint."""
  path = NOTEBOOKS[0].parent / "05_pretrained_sinks.ipynb"
  nb = execute(path, {"ATTNJAX_RUN_DIR": "", **FAST_COMPILES})
  images = sum(
    "image/png" in o.get("data", {})
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
  )
  assert images >= 3, f"{path.name} produced {images} figures"
