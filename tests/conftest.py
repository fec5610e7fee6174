"""Test configuration: 8 host devices, strict rank promotion, float32 matmuls, a compilation cache.

Strict numpy rank promotion and float32 matmuls as nanodo does. Compiled XLA
programs go to a persistent cache shared by the whole run, the xdist workers
and later runs: ``.pytest_cache/jax-compilation-cache`` in the repository, or
the folder named by ``ATTNJAX_TEST_COMPILATION_CACHE`` (``0`` or ``off``
disables it). Its keys include the program, the jax version, the backend and
the flags, so a changed function is compiled anew; delete the folder to
reclaim disk. A torn read of an entry another worker is writing only makes
jax warn and compile.
"""

from __future__ import annotations

import os

# Multi-device code is tested on the CPU with 8 host devices; set before jax imports.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The suite runs on the CPU backend even where the 'aot' extra installs jax's CUDA and TPU
# plugins (they only describe compile-only devices here: tests/test_targets.py); GPU and TPU
# runs are experiments/device_check.py's.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Auto-dispatch's kernel-trust rule reads the verdicts of `python -m attnjax.check` from the
# cache directory and ATTNJAX_KERNELS: the suite starts from an empty directory of its own and
# the default setting, whatever the machine has recorded or the shell sets.
import tempfile  # noqa: E402

os.environ["ATTNJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnjax-test-cache-")
os.environ.pop("ATTNJAX_KERNELS", None)

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_ENV = "ATTNJAX_TEST_COMPILATION_CACHE"


def compilation_cache_dir() -> str | None:
  """The persistent cache folder of this test run, or None when disabled."""
  value = os.environ.get(CACHE_ENV)
  if value is None:
    return os.path.join(ROOT, ".pytest_cache", "jax-compilation-cache")
  if value.strip().lower() in ("", "0", "off", "false", "none"):
    return None
  return value


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
# The suite compiles ~900 tests' worth of small programs, most once each: XLA's optimisation
# passes cost more than they save there (a clean run took 17 min with them). Modules that need
# optimised numerics ask for ``optimized_compiles``; ATTNJAX_TEST_OPTIMIZED=1 turns them on
# everywhere (the kernels' optimised compiles are also what experiments/bench.py runs).
FAST_COMPILES = os.environ.get("ATTNJAX_TEST_OPTIMIZED", "") in ("", "0")
jax.config.update("jax_disable_most_optimizations", FAST_COMPILES)
# The plugins' environment for describing devices this host does not have, set before jax
# initialises any backend (importing attnjax initialises none).
from attnjax import targets as _targets  # noqa: E402

_targets.configure_environment()
_cache = compilation_cache_dir()
if _cache is not None:
  jax.config.update("jax_compilation_cache_dir", _cache)
  # Cache every program: the tests compile many small ones, each in well under a second.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module")
def optimized_compiles():
  """Modules whose results depend on XLA's optimised numerics request it (a run meant to
  diverge at an absurd learning rate, bit-for-bit resumes): optimisations come back for the
  module. Module-scoped."""
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture
def all_kernels():
  """Auto-dispatch takes attnjax's Pallas kernels wherever they cover a call
  (``attnjax.config.kernels = "all"``, as ``ATTNJAX_KERNELS=all``): for the tests of the
  platforms' preference order and of the kernels' compiles, on a host where no kernel was
  checked."""
  import attnjax
  attnjax.config.kernels = "all"
  yield
  attnjax.config.kernels = None


def pytest_runtest_setup(item):
  """``@pytest.mark.targets("cuda" | "tpu")`` marks a compile for a real target without its
  device (left out of the default run; ``-m targets`` runs them): it skips, naming the
  missing extra, where this host cannot compile for that platform (no ``attnjax[aot]``)."""
  for mark in item.iter_markers("targets"):
    for platform in mark.args:
      reason = _targets.missing(platform)
      if reason is not None:
        pytest.skip(f"needs the 'aot' extra: {reason}")
