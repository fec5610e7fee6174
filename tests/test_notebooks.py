"""Every notebook runs top to bottom on small inputs; none is committed with outputs."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def execute(path: pathlib.Path, env: dict) -> nbformat.NotebookNode:
  nb = nbformat.read(path, as_version=4)
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  return nb


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name.startswith(("01", "02"))],
                         ids=lambda p: p.stem)
def test_function_notebooks_execute(path):
  nb = execute(path, {"ATTNJAX_NB_QUICK": "1"})
  images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))
  assert images >= 3, f"{path.name} produced {images} figures"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_are_committed_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
