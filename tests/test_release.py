"""The release installs: the wheel and the sdist built from this tree import without the repository.

``python -m build`` (or ``pip wheel`` where the ``build`` package is absent) builds the
distributions from a copy of the tree without a checkout's build products (an editable
install's ``attnjax.egg-info`` lists files the package data configuration might not), into
a temporary folder; each is installed with ``--no-deps`` into
a fresh virtual environment whose other packages (jax, flax, ...) come from this
environment's site-packages through a ``.pth`` file (nothing is downloaded but the
build backend). The check runs from a folder outside the repository with no
``PYTHONPATH``, so only the installed copy can be imported: it must be the one in the
new environment, carry ``attnjax.__version__``, and read its package data (the GPU
target descriptions) and the corpus it depends on.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

import attnjax

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHECK = """
import pathlib, sys
import attnjax, attnjax.nn
from attnjax import data, targets
print(attnjax.__version__)
print(pathlib.Path(attnjax.__file__).resolve())
assert "gpu_device_info" in targets.target_config("h200")
assert pathlib.Path(data.shakespeare_dir()).is_dir()
assert not any("attnjax" in p and "site-packages" not in p for p in sys.path if p), sys.path
"""


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
  """Runs ``cmd`` without ``PYTHONPATH`` (a checkout on it would look like an installed attnjax)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)
  assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc


# Left out of the copy the distributions are built from: a checkout's build products, above
# all an editable install's attnjax.egg-info, whose file list would stand in for the package
# data configuration.
BUILD_LEFTOVERS = shutil.ignore_patterns(
  ".git",
  "*.egg-info",
  "build",
  "dist",
  ".venv*",
  "_build",
  "runs",
  "__pycache__",
  ".pytest_cache",
  "_generated",
  "*.pyc",
)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, pathlib.Path]:
  source = tmp_path_factory.mktemp("source") / "attnjax"
  shutil.copytree(ROOT, source, ignore=BUILD_LEFTOVERS)
  out = tmp_path_factory.mktemp("dist")
  if importlib.util.find_spec("build") is not None:
    run([sys.executable, "-m", "build", "--outdir", str(out), str(source)])
  else:
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(source)])
  found = {
    "wheel": sorted(out.glob("attnjax-*.whl")),
    "sdist": sorted(out.glob("attnjax-*.tar.gz")),
  }
  assert found["wheel"], list(out.iterdir())
  return {kind: paths[0] for kind, paths in found.items() if paths}


def install_in_fresh_venv(path: pathlib.Path, dist: pathlib.Path) -> pathlib.Path:
  """A venv without pip holding ``dist``; then its site-packages also sees this environment's
  packages (a .pth, written after the install so that pip does not take this environment's
  attnjax for an installed one)."""
  run([sys.executable, "-m", "venv", "--without-pip", str(path)])
  python = path / "bin" / "python"
  run(
    [
      sys.executable,
      "-m",
      "pip",
      "--python",
      str(python),
      "install",
      "--no-deps",
      "--quiet",
      str(dist),
    ]
  )
  purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
  ours = {
    sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"],
    *site.getsitepackages(),
  }
  (pathlib.Path(purelib.stdout.strip()) / "parent_env.pth").write_text(
    "\n".join(sorted(p for p in ours if os.path.isdir(p))) + "\n"
  )
  return python


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_distribution_installs_and_imports_outside_the_repository(kind, dists, tmp_path):
  if kind not in dists:
    pytest.skip("pip wheel builds no sdist (the 'build' package is not installed)")
  python = install_in_fresh_venv(tmp_path / "venv", dists[kind])
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  proc = run([str(python), "-c", CHECK], cwd=outside)
  version, location = proc.stdout.split()[:2]
  assert version == attnjax.__version__
  assert pathlib.Path(location).is_relative_to((tmp_path / "venv").resolve()), location
