"""Context parallelism (attnjax.parallel): sharded calls equal the unsharded call.

The multi-device cases run in a process of their own
(``tests/context_parallel_cases.py``, on ``--xla_force_host_platform_device_count=8``),
one process for many cases, each compiled once; they compare the output,
every statistic and the gradients of q, k, v, sink logits and ``score_mod``
arguments with the unsharded ``attnjax.dot_product_attention``. The default
run checks a representative subset; ``-m slow`` the cross product. The
static pieces (zigzag order, ring plans, argument errors) run here.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import op as _op
from attnjax import parallel
from attnjax._src.kernels.blockwise import ring
from attnjax._src.parallel import strategies

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOLERANCE = 2e-5  # relative to the reference's largest magnitude (float32, highest precision)


def run_cases(cases: list[dict], timeout: int = 1200) -> list[dict]:
  """Runs ``cases`` in a fresh process on 8 forced host devices; one result per case."""
  flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=str(ROOT),
    XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=8", *flags]),
  )
  cache = os.environ.get(
    "ATTNJAX_TEST_COMPILATION_CACHE", str(ROOT / ".pytest_cache" / "jax-compilation-cache")
  )
  if cache.strip().lower() not in ("", "0", "off", "false", "none"):
    env["ATTNJAX_CP_CACHE"] = cache
  proc = subprocess.run(
    [sys.executable, str(ROOT / "tests" / "context_parallel_cases.py"), json.dumps(cases)],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
    cwd=ROOT,
  )
  results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert proc.returncode == 0 and len(results) == len(cases), (
    f"the case process exited {proc.returncode} after {len(results)} of {len(cases)} "
    f"cases:\n{proc.stderr[-3000:]}"
  )
  return results


def check(results: list[dict]) -> None:
  failures = []
  for r in results:
    expect = r["case"].get("expect")
    if expect is not None:
      if expect not in r.get("error", ""):
        failures.append(f"{r['case']}: expected an error with {expect!r}, got {r}")
      continue
    if "error" in r:
      failures.append(f"{r['case']}: raised {r['error']}")
      continue
    tol = r["case"].get("tol", TOLERANCE)
    bad = {name: e for name, e in r["errors"].items() if not e <= tol}
    if bad:
      failures.append(f"{r['case']}: {bad}")
  assert not failures, "\n".join(failures)


# Every strategy, layout, normaliser and head grouping, and each mask but on one strategy at
# least; sinks and score_mod on each strategy; statistics (with the logsumexp gradient) on
# ring and all_to_all; check_vma=False once. Rings of 2 and 4 devices, the other strategies on
# 2 (a sharded call's compile grows with the axis: 5.5 s of CPU at 2 against 9.0 s at 4 for the
# relu ring, 2.8 s against 5.5 s for all_to_all); of 8: test_multiprocess (a ring across two
# processes) and -m slow.
REPRESENTATIVE = [
  dict(
    strategy="ring",
    P=4,
    T=128,
    normalizer="softmax",
    mask="causal",
    heads="gqa",
    sinks=True,
    score_mod=True,
  ),
  dict(
    strategy="ring", P=4, T=128, normalizer="softpick", mask="causal", layout="zigzag", heads="mha"
  ),
  dict(strategy="ring", P=2, T=128, normalizer="sigmoid", mask="window", heads="gqa"),
  dict(
    strategy="ring", P=2, T=128, normalizer="relu", mask="segments", heads="mqa", layout="zigzag"
  ),
  dict(
    strategy="ring", P=4, T=128, normalizer="none", mask="mask_mod", heads="mha", check_vma=False
  ),
  dict(
    strategy="all_to_all",
    P=2,
    T=128,
    normalizer="softmax",
    mask="bidirectional",
    heads="gqa",
    sinks=True,
    score_mod=True,
    layout="zigzag",
  ),
  dict(
    strategy="all_gather",
    P=2,
    T=128,
    normalizer="softmax_one",
    mask="window",
    heads="gqa",
    score_mod=True,
    stats=False,
    layout="zigzag",
  ),
  # Recurrent families: state passing, with resets (one at a shard boundary), initial state.
  dict(family="gated_linear", P=4, T=64, segments=True, gla=True),
  # KDA (per-channel decay) from an initial state, with resets
  dict(family="delta_rule", P=2, T=64, initial_state=True, gla=True, segments=True),
  # MLA: the absorbed form's ring passes the latent; the expanded form all-gathers.
  dict(family="mla", strategy="ring", P=2, T=64, absorb=True, sinks=True, layout="zigzag"),
  dict(family="mla", strategy="all_gather", P=2, T=64, absorb=False, stats=False),
  # Errors raised while tracing inside shard_map (no compile).
  dict(
    strategy="all_to_all",
    P=8,
    T=64,
    heads="gqa",
    expect="N=4 heads (q (1, 8, 4, 8)) are not divisible by the axis size 8",
  ),
]


def test_representative_cases_equal_the_unsharded_call():
  check(run_cases(REPRESENTATIVE))


def test_linear_attention_equals_the_unsharded_call():
  """Causal (chunked from the state the earlier shards pass) with an initial state on 4
  devices; non-causal (the global K^T V) with FAVOR+, its projection's gradient, on 2;
  statistics (every row against the gathered keys), causal and non-causal, on 2."""
  check(
    run_cases(
      [
        dict(family="linear", P=4, T=64, initial_state=True),
        dict(family="linear", P=2, T=32, causal=False, feature_map="favor", heads="mha"),
        dict(family="linear", P=2, T=32, stats=True),
        dict(family="linear", P=2, T=48, causal=False, stats=True, feature_map="favor"),
      ]
    )
  )


def test_sparse_attention_equals_the_unsharded_call():
  """A sliding window on the ring (the shard pairs out of its reach skipped), with sinks,
  score_mod and GQA; strided on all_to_all under zigzag with a mask_mod."""
  check(
    run_cases(
      [
        dict(
          strategy="ring",
          P=4,
          T=64,
          pattern="sliding_window",
          mask="bidirectional",
          heads="gqa",
          sinks=True,
          score_mod=True,
        ),
        dict(strategy="all_to_all", P=2, T=64, pattern="strided", mask="mask_mod", layout="zigzag"),
        dict(
          strategy="ring",
          P=2,
          T=32,
          pattern="strided",
          implementation="reference",
          expect="context_strategy='ring' runs the block-wise kernel on each pair of shards; "
          "implementation='reference' cannot",
        ),
      ]
    )
  )


def test_the_op_chooses_the_strategy():
  """``context_strategy=None``: the ring for auto-dispatch and the block-wise engine; for a
  named engine the ring cannot run, all-to-all where the axis divides the device's heads,
  else all-gather; a dense call with the reference engine then equals the unsharded call."""
  assert strategies.choose_strategy(None, 4, 2) == "ring"
  assert strategies.choose_strategy("blockwise", 4, 8) == "ring"
  assert strategies.choose_strategy("reference", 4, 2) == "all_to_all"
  assert strategies.choose_strategy("xla", 4, 8) == "all_gather"
  check(run_cases([dict(strategy=None, P=2, T=32, implementation="reference", stats=False)]))


def test_all_gather_statistics_equal_the_unsharded_call():
  """return_stats with all_gather (the block-wise kernel on the local rows, means and max
  over every device's rows, the logsumexp gradient): dense with segments, a normaliser that
  counts keys and zigzag on 2 devices; a sparse Longformer pattern on 8."""
  check(
    run_cases(
      [
        dict(
          strategy="all_gather",
          P=2,
          T=64,
          normalizer="sigmoid",
          mask="segments",
          heads="gqa",
          stats=True,
          layout="zigzag",
        ),
        dict(
          strategy="all_gather",
          P=8,
          T=64,
          pattern="global_window",
          mask="bidirectional",
          heads="mha",
          sinks=True,
          stats=True,
        ),
      ]
    )
  )


def _cross_product() -> list[dict]:
  cases = []
  for strategy, P, normalizer, mask, heads in itertools.product(
    parallel.CONTEXT_STRATEGIES,
    (2, 4, 8),
    attnjax.normalizers.NORMALIZERS,
    ("causal", "causal_zigzag", "window", "segments", "bidirectional", "mask_mod"),
    ("mha", "gqa"),
  ):
    case = dict(
      strategy=strategy,
      P=P,
      T=16 * P,
      normalizer=normalizer,
      heads=heads,
      mask="causal" if mask == "causal_zigzag" else mask,
      layout="zigzag" if mask == "causal_zigzag" else "contiguous",
      stats=True,
      sinks=normalizer == "softmax",
      score_mod=normalizer == "softmax",
    )
    if strategy == "all_to_all" and P == 8:
      case["heads"] = "mha" if heads == "mha" else "gqa"
      case["P"] = 4  # N=4 query heads cannot split over 8 devices
      case["T"] = 64
    cases.append(case)
  return cases


@pytest.mark.slow
def test_recurrent_families_equal_the_unsharded_call_on_2_4_8_devices():
  check(
    run_cases(
      [
        dict(
          family=family,
          P=P,
          T=16 * P,
          segments=segments,
          initial_state=initial,
          gla=family == "gated_linear" and segments,
        )
        for family, P, segments, initial in itertools.product(
          ("gated_linear", "delta_rule"), (2, 4, 8), (False, True), (False, True)
        )
      ],
      timeout=3600,
    )
  )


SPARSE_PATTERNS = (
  "sliding_window",
  "strided",
  "fixed",
  "global_window",
  "bigbird",
  "sinks_window",
  "dilated_window",
  "causal_global",
)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_sparse_attention_equals_the_unsharded_call_on_2_4_8_devices(strategy):
  cases = []
  for n, (pattern, P, mask) in enumerate(
    itertools.product(SPARSE_PATTERNS, (2, 4, 8), ("bidirectional", "segments", "mask_mod"))
  ):
    case = dict(
      strategy=strategy,
      P=P,
      T=16 * P,
      pattern=pattern,
      mask=mask,
      heads=("mha", "gqa")[n % 2],
      normalizer=("softmax", "sigmoid")[n % 3 == 2],
      sinks=n % 3 == 0,
      score_mod=n % 4 == 0,
      stats=True,
      layout="zigzag" if n % 5 == 1 else "contiguous",
    )
    if strategy == "all_to_all" and P == 8:
      case.update(P=4, T=64)  # N=4 query heads cannot split over 8 devices
    cases.append(case)
  check(run_cases(cases, timeout=7200))


@pytest.mark.slow
def test_linear_attention_equals_the_unsharded_call_on_2_4_8_devices():
  cases = []
  for P, causal, implementation, normalize, initial in itertools.product(
    (2, 4, 8),
    (True, False),
    (None, "quadratic", "recurrent"),
    ("denominator", "none", "output_rms"),
    (False, True),
  ):
    if implementation == "recurrent" and not causal:
      continue  # no non-causal recurrent form
    cases.append(
      dict(
        family="linear",
        P=P,
        T=8 * P + 4 * (P == 2),
        causal=causal,
        implementation=implementation,
        normalize=normalize,
        initial_state=initial,
        heads="gqa" if initial else "mha",
        feature_map="favor" if normalize == "output_rms" else "elu_plus_one",
        chunk_size=3,
        stats=normalize == "denominator",
        # the entropy's gradient goes through log w of every pair: float32
        # summation order moves dq by up to ~5e-5 (values agree to ~1e-7)
        tol=1e-4 if normalize == "denominator" else TOLERANCE,
      )
    )
  check(run_cases(cases, timeout=3600))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_cross_product_equals_the_unsharded_call(strategy):
  check(run_cases([c for c in _cross_product() if c["strategy"] == strategy], timeout=7200))


# ---------------------------------------------------------------------------
# Static pieces: no devices needed.


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_zigzag_puts_chunks_p_and_2p_minus_1_minus_p_on_shard_p(P):
  T = 2 * P * 3
  x = jnp.arange(T)[None, :, None] * jnp.ones((2, 1, 5), jnp.int32)
  z = parallel.zigzag(x, P)
  shards = np.asarray(z[0, :, 0]).reshape(P, 6)
  for p in range(P):
    want = np.concatenate([np.arange(3) + 3 * p, np.arange(3) + 3 * (2 * P - 1 - p)])
    np.testing.assert_array_equal(shards[p], want)
    np.testing.assert_array_equal(ring.shard_positions(p, P, 6, "zigzag"), want)
  np.testing.assert_array_equal(parallel.unzigzag(z, P), x)
  np.testing.assert_array_equal(parallel.unzigzag(parallel.zigzag(x, P, axis=-2), P, axis=-2), x)


def test_zigzag_names_the_axis_and_shape_it_cannot_split():
  with pytest.raises(
    ValueError,
    match=r"zigzag: the token axis \(1\) of shape \(1, 6, 2\) has "
    r"length 6, not a multiple of 2 \* axis_size = 4",
  ):
    parallel.zigzag(jnp.zeros((1, 6, 2)), 2)
  with pytest.raises(ValueError, match="axis_size must be a positive int"):
    parallel.unzigzag(jnp.zeros((1, 8)), 0)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_zigzag_balances_causal_tiles_and_contiguous_does_not(P):
  """Under a causal mask every device visits the same number of tiles (within one) with
  zigzag; with contiguous shards the last device visits about 2P - 1 times the first's."""
  T = 512
  zz = ring.plan(
    T, T, P, "zigzag", is_causal=True, window=None, with_stats=False, block_q=64, block_k=64
  )
  tiles = [zz.tiles(p) for p in range(P)]
  assert max(tiles) - min(tiles) <= 1, tiles
  flat = ring.plan(
    T, T, P, "contiguous", is_causal=True, window=None, with_stats=False, block_q=64, block_k=64
  )
  tiles = [flat.tiles(p) for p in range(P)]
  per_block = T // 64
  assert tiles[0] == per_block * (per_block + 1) // 2
  assert tiles[-1] == tiles[0] + (P - 1) * per_block**2
  # Every causal tile of the whole sequence is visited once in either layout.
  whole = (P * per_block) * (P * per_block + 1) // 2
  assert sum(tiles) == whole and sum(zz.tiles(p) for p in range(P)) >= whole


def test_a_window_crosses_only_the_shards_it_reaches():
  P, T, w = 8, 256, 100
  r = ring.plan(
    T, T, P, "contiguous", is_causal=False, window=(w, 0), with_stats=False, block_q=64, block_k=64
  )
  for p in range(P):
    visited = [src for src in range(P) if r.classes[r.table[p][src]][0] is not None]
    assert visited == ([p - 1, p] if p else [0]), (p, visited)


def test_context_keywords_are_checked():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(
    ValueError,
    match="context_strategy='ring_attention' is not one of: None, 'ring', 'all_gather', 'all_to_all'",
  ):
    attnjax.dot_product_attention(q, q, q, context_axis="c", context_strategy="ring_attention")
  with pytest.raises(ValueError, match="context_layout='striped' is not one of"):
    attnjax.dot_product_attention(q, q, q, context_axis="c", context_layout="striped")
  with pytest.raises(ValueError, match="were given without context_axis"):
    attnjax.dot_product_attention(q, q, q, context_strategy="all_to_all")
  with pytest.raises(TypeError, match="context_axis must be a shard_map mesh axis name"):
    attnjax.dot_product_attention(q, q, q, context_axis=3)
  with pytest.raises(ValueError, match="takes no return_residual"):
    attnjax.dot_product_attention(q, q, q, context_axis="c", return_residual=True)


def test_linear_attention_context_axis_is_checked():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(
    ValueError, match="context_axis='c' is not a mesh axis of the enclosing jax.shard_map"
  ):
    attnjax.linear_attention(q, q, q, is_causal=True, context_axis="c")
  with pytest.raises(TypeError, match="context_axis must be a shard_map mesh axis name"):
    attnjax.linear_attention(q, q, q, context_axis=3)


def test_sparse_attention_context_axis_is_checked():
  q = jnp.zeros((1, 8, 2, 4))
  window = attnjax.patterns.sliding_window(2)
  with pytest.raises(
    ValueError, match="context_axis='c' is not a mesh axis of the enclosing jax.shard_map"
  ):
    attnjax.sparse_attention(q, q, q, pattern=window, context_axis="c")
  with pytest.raises(ValueError, match="were given without context_axis"):
    attnjax.sparse_attention(q, q, q, pattern=window, context_strategy="all_gather")


@pytest.mark.parametrize("name", ["gated_linear", "delta_rule"])
def test_recurrent_context_axis_is_checked(name):
  fn = {
    "gated_linear": lambda q, **kw: attnjax.gated_linear_attention(
      q, q, q, log_decay=jnp.zeros(q.shape[:3]), **kw
    ),
    "delta_rule": lambda q, **kw: attnjax.delta_rule_attention(
      q, q, q, jnp.full(q.shape[:3], 0.5), **kw
    ),
  }[name]
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(
    ValueError,
    match=f"context_axis='c' is not a mesh axis of the enclosing "
    f"jax.shard_map \\(call {name}_attention inside",
  ):
    fn(q, context_axis="c")
  with pytest.raises(TypeError, match="context_axis must be a shard_map mesh axis name"):
    fn(q, context_axis=3)


def test_every_context_strategy_is_declared_on_its_op():
  for name in (
    "dense",
    "qk_norm",
    "cosine",
    "sparse",
    "mla",
    "linear",
    "gated_linear",
    "delta_rule",
  ):
    assert _op.OPS[name].context is not None, name
  for op in _op.OPS.values():  # a sample says it takes context_axis where the op has a strategy
    assert any(s.context for s in op.samples()) == (op.context is not None), op.name


def sample_cases(ops=None) -> list[dict]:
  """One case per op with a context-parallel strategy, from its sample call."""
  ops = _op.OPS if ops is None else ops
  return [
    dict(op=name, P=2, T=32)
    for name, op in sorted(ops.items())
    for sample in op.samples()[:1]
    if sample.context
  ]


# The front ends of dense attention, whose strategy no other case runs; the others' samples
# (their families' own cases run above) in -m slow.
FRONT_ENDS = ("qk_norm", "cosine")


def test_the_front_ends_sample_calls_equal_the_unsharded_call():
  check(run_cases([c for c in sample_cases() if c["op"] in FRONT_ENDS]))


@pytest.mark.slow
def test_every_ops_sample_call_equals_the_unsharded_call():
  check(run_cases(sample_cases()))


def test_the_strategies_import_no_family():
  """They get the op's per-device computation from ``_op.run``; they never call back into
  the family module that called them."""
  families = set(_op.OPS)
  for path in (ROOT / "attnjax" / "parallel").glob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = {node.module.split(".")[1] if node.module.count(".") else ""}
        if node.module == "attnjax":
          names = {a.name for a in node.names}
        assert not names & families, (path.name, node.module)
      elif isinstance(node, ast.Import):
        assert (
          not {a.name.split(".")[1] for a in node.names if a.name.startswith("attnjax.")} & families
        ), path.name


def test_run_hands_the_context_strategy_the_ops_own_computation():
  """``local`` is the op's ``run_on_this_platform``: the strategy's shard call runs the op's
  engine (here named and auto), not the strategy again."""
  engine = _op.Engine("double", lambda x, axis: 2 * x, _op.supports_everything)
  seen = []

  def context(call, implementation, local):
    x, axis = call
    seen.append(axis)
    return local((x + 1, None), implementation)

  op = _op.Op(
    "stand_in_context",
    {"double": engine},
    {},
    ("double",),
    context=context,
    context_axis=lambda x, axis: axis,
  )
  for implementation in ("double", None):
    np.testing.assert_array_equal(_op.run(op, (jnp.ones(3), "seq"), implementation), 4.0)
  assert seen == ["seq", "seq"]
