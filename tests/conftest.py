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

import dataclasses
import os

# Multi-device code is tested on the CPU with 8 host devices; set before jax imports.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The suite compiles ~900 tests' worth of small programs, most once each: XLA's optimisation
# passes cost more than they save there (a clean run took 17 min with them), and no test's
# result depends on them; ATTNJAX_TEST_OPTIMIZED=1 turns them on everywhere (the kernels'
# optimised compiles are also what experiments/bench.py runs).
FAST_COMPILES = os.environ.get("ATTNJAX_TEST_OPTIMIZED", "") in ("", "0")


# The suite runs on the CPU backend even where the 'aot' extra installs jax's CUDA and TPU
# plugins (they only describe compile-only devices here: tests/test_targets.py); GPU and TPU
# runs are experiments/device_check.py's.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Auto-dispatch's kernel-trust rule reads the verdicts of `python -m attnjax.check` from the
# cache directory and ATTNJAX_AUTO_KERNELS: the suite starts from an empty directory of its own and
# the default setting, whatever the machine has recorded or the shell sets.
import tempfile  # noqa: E402

os.environ["ATTNJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnjax-test-cache-")
os.environ.pop("ATTNJAX_AUTO_KERNELS", None)
os.environ.pop("ATTNJAX_KERNELS", None)  # its old name

# After the settings above, which jax and attnjax read when imported; before any backend
# starts. Subprocesses of the tests inherit the flags through the environment.
if FAST_COMPILES:
  from attnjax._src import xla_env

  xla_env.use_fast_cpu_compiles()

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
jax.config.update("jax_disable_most_optimizations", FAST_COMPILES)
# The plugins' environment for describing devices this host does not have, set before jax
# initialises any backend (importing attnjax initialises none).
from attnjax._src import targets as _targets  # noqa: E402

_targets.configure_environment()
_cache = compilation_cache_dir()
if _cache is not None:
  jax.config.update("jax_compilation_cache_dir", _cache)
  # Cache every program: the tests compile many small ones, each in well under a second.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module")
def target_compiles():
  """Settings of a module that compiles for real targets from this host. Compile-only
  executables cannot be read back from jax's persistent cache (no client to load them on), so
  the module compiles without it; jax decides once per process whether it uses the cache, so
  the decision is reset on the way in and out. And the suite's float32 default matmul
  precision is lifted: Pallas TPU kernels read it when lowered and ask Mosaic for float32
  products of bf16 tiles, which it refuses ("Bad lhs type": jax's splash kernel fails to
  compile under jax_default_matmul_precision="highest"; our kernels set their precision)."""
  from jax.experimental.compilation_cache import compilation_cache as jax_cache

  cache = jax.config.jax_enable_compilation_cache
  precision = jax.config.jax_default_matmul_precision
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_default_matmul_precision", None)
  jax_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", cache)
  jax.config.update("jax_default_matmul_precision", precision)
  jax_cache.reset_cache()


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """Runs of one tiny config compile the same programs: let XLA reuse them. The suite's
  persistent cache (above) does that for both xdist workers; where it is off, a cache of the
  requesting module's own."""
  if jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
    yield
    return
  old = (
    jax.config.jax_compilation_cache_dir,
    jax.config.jax_persistent_cache_min_compile_time_secs,
  )
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])


@pytest.fixture
def all_kernels():
  """Auto-dispatch takes attnjax's Pallas kernels wherever they cover a call
  (``attnjax.config.auto_kernels = "all"``, as ``ATTNJAX_AUTO_KERNELS=all``): for the tests of the
  platforms' preference order and of the kernels' compiles, on a host where no kernel was
  checked."""
  import attnjax

  attnjax.config.auto_kernels = "all"
  yield
  attnjax.config.auto_kernels = None


def pytest_runtest_setup(item):
  """``@pytest.mark.targets("cuda" | "tpu")`` marks a compile for a real target without its
  device (left out of the default run; ``-m targets`` runs them): it skips, naming the
  missing extra, where this host cannot compile for that platform (no ``attnjax[aot]``)."""
  for mark in item.iter_markers("targets"):
    for platform in mark.args:
      reason = _targets.missing(platform)
      if reason is not None:
        pytest.skip(f"needs the 'aot' extra: {reason}")


SLOW_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_cases.txt")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """The parametrized cases named in ``tests/slow_cases.txt`` are ``slow``: each of them takes
  only branches that a test of the default run also takes (``tests/select_default_cases.py``
  chose them from a coverage run; every test function keeps a case in the default run).
  ``ATTNJAX_TEST_ALL_CASES=1`` runs them with the rest."""
  del config
  if os.environ.get("ATTNJAX_TEST_ALL_CASES", "") not in ("", "0"):
    return  # the measuring run of tests/select_default_cases.py
  with open(SLOW_CASES, encoding="utf-8") as f:
    listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
  for item in items:
    if item.nodeid in listed:
      item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def sparse_block_plans():
  """Auto-dispatch of the sparse op takes its block plans at every length (it keeps calls
  shorter than ``sparse.BLOCKWISE_MIN_LENGTH`` on the reference, as dense does): for the tests
  of those plans, which run short calls (``pytestmark = pytest.mark.usefixtures(...)``). Jax's
  caches are cleared first: a trace of another module's call would hold the other choice."""
  from attnjax._src.ops.sparse import attention as sparse

  blockwise = dataclasses.replace(sparse.ENGINES["blockwise"], min_length=0)
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(sparse.ENGINES, "blockwise", blockwise)
    jax.clear_caches()
    yield
  jax.clear_caches()
