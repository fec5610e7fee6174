"""The dense case of :class:`op_base.OpTests`: one test base for the dense attention engines.

Each engine's test file subclasses :class:`DenseEngineTests`, says how to run the engine
(:meth:`DenseEngineTests.run` on :func:`attnjax.dense.prepare`'s output) and declares what it
supports (class attributes: lengths, structures, dtypes, gradients, sink logits, softcap,
statistics). The base then checks values, statistics and gradients against
:func:`attnjax.dense.reference` (through :func:`helpers.check_dense_kernel`):

- ``test_matches_reference`` (default run): softmax (no row counts; sink logits) and sigmoid
  (needs the allowed-key counts of each row) across the structures the engine declares (both
  on the first two, causal and packed segments, where counts meet block skipping; each
  further structure once), the
  options (GQA or MHA, dtypes, statistics, sink logits, softcap) each visited at least once.
  Engines never branch on a normaliser's name: they call the normaliser's ``init`` /
  ``visit`` / ``finish`` / ``row_inputs`` seam, and what changes between normalisers on the
  engine's side is whether it counts keys, which these two cover.
- ``test_every_normaliser_once`` (default run, on engines with ``every_normaliser = True``:
  the block-wise engine): each normaliser through the whole seam once, value and gradient.
- ``test_matches_reference_everywhere`` (``slow``): the cross product of every normaliser,
  structure, GQA / MHA and dtype, with statistics and (where accepted) sink logits.
- ``test_engine_matches_reference`` (``slow``, from :class:`op_base.OpTests`): the engine on
  the op's sample call (causal, GQA, the engine's first dtype), value and gradients; the
  default cases above cover it.

Of the default cases, those whose every branch another default test also takes are ``slow``
(``tests/slow_cases.txt``, chosen by ``tests/select_default_cases.py`` from a coverage run);
``test_every_normaliser_once`` keeps all its cases.

Structures are built from the engine's lengths, so the same causal, window, packed-segment,
bidirectional and modifier structures hit ragged and interior blocks of every engine.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src.ops.dense import attention as dense
from attnjax._src import mods, normalizers
from helpers import check_dense_kernel, rand_qkv
from op_base import OpTests


def decay(z, b, n, i, j):
  """An argument-free score_mod: a distance penalty (ALiBi with one slope)."""
  del b, n
  return z - 0.05 * jnp.abs(i - j).astype(jnp.float32)


def alibi_per_head(z, b, n, i, j, slopes, offsets):
  """ALiBi with a per-(batch, head) offset table: reads b and n, two float tables."""
  return (
    z
    - slopes[n] * jnp.abs(i - j).astype(jnp.float32)
    + offsets[b, n] * (j == 0).astype(jnp.float32)
  )


def packed_segments(T: int, S: int, cuts: tuple[int, int] | None = None):
  """Query and key segment ids of two packed sequences per batch row (B = 2): row ``b``'s
  boundary at ``cuts[b]`` (default 45% and 75% of ``T``), the keys' ids continuing the last
  segment to ``S``."""
  cuts = cuts or (int(0.45 * T), int(0.75 * T))
  q = np.asarray([[0] * c + [1] * (T - c) for c in cuts], np.int32)
  kv = np.asarray([[0] * c + [1] * (S - c) for c in cuts], np.int32)
  return jnp.asarray(q), jnp.asarray(kv)


# name -> builder(T, S) of the mask / modifier options
STRUCTURES: dict[str, Callable[[int, int], dict]] = {
  "causal": lambda T, S: dict(is_causal=True),
  "window": lambda T, S: dict(window=(max(2, T // 3), max(1, T // 7))),
  # causal within each of two packed sequences, the boundary inside a block
  "segments": lambda T, S, cuts=None: dict(is_causal=True, segment_ids=packed_segments(T, S, cuts)),
  "bidirectional": lambda T, S: dict(),
  # a mask_mod (chunks of a third of the keys, causal) and a score_mod, both in the kernel
  "mask_mod": lambda T, S: dict(mask_mod=mods.chunked_mask(max(2, S // 3)), score_mod=decay),
  # modifiers with arguments: per-head slopes and a [B, N] table (their gradients checked),
  # prefix lengths per batch row
  "mod_args": lambda T, S: dict(
    score_mod=alibi_per_head,
    score_mod_args=(
      jnp.asarray(mods.alibi_slopes(4)),
      jnp.asarray(np.random.default_rng(3).standard_normal((2, 4)), jnp.float32),
    ),
    mask_mod=mods.prefix_lm_mask,
    mask_mod_args=(jnp.asarray([T // 7, (3 * T) // 4], jnp.int32),),
  ),
}

DEFAULT_NORMALIZERS = ("softmax", "sigmoid")


class DenseEngineTests(OpTests):
  """Subclass as ``TestMyEngine(DenseEngineTests)``; set ``name`` and override :meth:`run`."""

  op = "dense"
  sample_marks = (pytest.mark.slow,)
  name: str = ""
  T: int = 40
  S: int = 72
  H: int = 16
  # each batch row's segment boundary (None: 45% and 75% of T); an engine puts one on a block
  # edge to see a block pair skipped at run time
  segment_cuts: tuple[int, int] | None = None
  structures: tuple[str, ...] = ("causal", "segments", "window")
  dtypes: tuple[Any, ...] = (jnp.float32, jnp.bfloat16)
  supports_grad: bool = True
  supports_sink: bool = True
  supports_softcap: bool = True
  supports_stats: bool = True
  every_normaliser: bool = False
  # errors relative to the largest reference entry (at least 1), per dtype
  tolerance: dict = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 3e-2}
  stats_tolerance: float | None = None  # None: ``tolerance``

  def run(self, inputs, opts):
    """The engine on ``dense.prepare``'s ``(inputs, opts)``."""
    raise NotImplementedError

  # -- OpTests: the engine on the op's sample call -----------------------------------------
  def engine_names(self) -> tuple[str, ...]:
    return (self.name,)

  def sample_tolerance(self) -> float:
    return self.tolerance[self.dtypes[0]]

  def marks_of_sample(self) -> list:
    # the sample as a case of the engine's own: the marks it takes there
    case = ("softmax", "causal", True, self.dtypes[0], False, False, None)
    return list(self.sample_marks) + self.case_marks(case)

  def sample(self):
    """A causal GQA call in the engine's first dtype; the reference runs in float32 on the
    same (rounded) inputs."""
    up = lambda x: x.astype(jnp.float32)

    def fn(impl, q, k, v):
      if impl == "reference":
        return dense.reference(*dense.prepare(up(q), up(k), up(v), is_causal=True))
      assert impl == self.name, impl
      return self.run(*dense.prepare(q, k, v, is_causal=True))

    return fn, rand_qkv(B=2, T=self.T, S=self.S, N=4, K=2, H=self.H, dtype=self.dtypes[0])

  def case_marks(self, case: tuple) -> list:
    """Extra pytest marks of one case (an engine that runs only some cases here)."""
    del case
    return []

  # -- the cases -------------------------------------------------------------------------
  def default_cases(self) -> list[tuple]:
    """(normaliser, structure, gqa, dtype, stats, sink, softcap): both DEFAULT_NORMALIZERS on
    the engine's first two structures (causal, and packed segments: where the row counts meet
    block skipping), each further structure once with the normalisers alternating; the
    options rotate so each is visited."""
    pairs = [(s, n) for s in self.structures[:2] for n in DEFAULT_NORMALIZERS]
    pairs += [(s, DEFAULT_NORMALIZERS[i % 2]) for i, s in enumerate(self.structures[2:])]
    cases = []
    for i, (structure, normalizer) in enumerate(pairs):
      dtype = self.dtypes[(i // 2) % len(self.dtypes)]
      stats = self.supports_stats and (i // 2 + i) % 2 == 0
      sink = self.supports_sink and normalizer == "softmax" and i % 4 == 0
      softcap = 4.0 if self.supports_softcap and i % 4 in (1, 2) else None
      cases.append((normalizer, structure, i % 3 != 2, dtype, stats, sink, softcap))
    return cases

  def normaliser_cases(self) -> list[tuple]:
    if not self.every_normaliser:
      return []
    return [
      (
        n,
        self.structures[i % len(self.structures)],
        True,
        self.dtypes[0],
        self.supports_stats,
        self.supports_sink and normalizers.REGISTRY[n].accepts_sink_logits,
        None,
      )
      for i, n in enumerate(normalizers.NORMALIZERS)
    ]

  def slow_cases(self) -> list[tuple]:
    return [
      (
        n,
        s,
        gqa,
        dtype,
        self.supports_stats,
        self.supports_sink and normalizers.REGISTRY[n].accepts_sink_logits,
        None,
      )
      for n, s, gqa, dtype in itertools.product(
        normalizers.NORMALIZERS, self.structures, (True, False), self.dtypes
      )
    ]

  def pytest_generate_tests(self, metafunc):
    super().pytest_generate_tests(metafunc)
    cases = {
      "test_matches_reference": self.default_cases,
      "test_every_normaliser_once": self.normaliser_cases,
      "test_matches_reference_everywhere": self.slow_cases,
    }.get(metafunc.function.__name__)
    if cases is None or "case" not in metafunc.fixturenames:
      return
    params = [pytest.param(c, id=_case_id(c), marks=self.case_marks(c)) for c in cases()]
    if not params:
      params = [pytest.param(None, marks=pytest.mark.skip(reason=f"{self.name}: not run here"))]
    metafunc.parametrize("case", params)

  # -- the check -------------------------------------------------------------------------
  def check(self, case: tuple) -> None:
    normalizer, structure, gqa, dtype, stats, sink, softcap = case
    build = STRUCTURES[structure]
    kw = (
      build(self.T, self.S, self.segment_cuts) if structure == "segments" else build(self.T, self.S)
    )
    score_args = kw.pop("score_mod_args", None)
    if score_args is not None and not gqa:  # two query heads
      score_args = (score_args[0][:2], score_args[1][:, :2])
    check_dense_kernel(
      self.run,
      kw,
      normalizer=normalizer,
      T=self.T,
      S=self.S,
      gqa=gqa,
      dtype=dtype,
      stats=stats,
      sink=sink,
      softcap=softcap,
      score_args=score_args,
      name=self.name,
      grad=self.supports_grad,
      tol=self.tolerance[dtype],
      stats_tol=self.stats_tolerance,
      H=self.H,
    )

  def test_matches_reference(self, case):
    self.check(case)

  def test_every_normaliser_once(self, case):
    self.check(case)

  @pytest.mark.slow
  def test_matches_reference_everywhere(self, case):
    self.check(case)


def _case_id(case: tuple) -> str:
  normalizer, structure, gqa, dtype, stats, sink, softcap = case
  parts = [normalizer, structure, "gqa" if gqa else "mha", jnp.dtype(dtype).name]
  parts += [p for p, on in (("stats", stats), ("sink", sink)) if on]
  if softcap is not None:
    parts.append(f"softcap{softcap:g}")
  return "-".join(parts)
