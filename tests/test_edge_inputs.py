"""Edge inputs over every family and implementation: zero lengths, head dim 0, static options
given as numpy / jax scalars, 0-d arrays or lists, and ints for flags."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import op as _op, options
from attnjax.kernels import blockwise, pallas_gpu, pallas_tpu

from helpers import rand_qkv

N, K, H = 2, 1, 4


@dataclasses.dataclass(frozen=True)
class Case:
  """One implementation of one family, called as ``fn(q, k, v, **options)``.

  ``self_only``: keys are the queries' tokens (S == T). ``runs``: cheap to run on a
  non-empty call (the interpreted Pallas kernels are not: only their checks are tested). ``stats`` / ``state``: the keyword
  that adds statistics / a final state to the result. ``static``: a valid Python value for
  each static numeric option it takes. ``flags``: its flags.
  """

  name: str
  fn: Callable[..., Any]
  self_only: bool = False
  runs: bool = True
  stats: str | None = "return_stats"
  state: bool = False
  static: tuple[tuple[str, Any], ...] = (("scale", 0.5), ("softcap", 3.0), ("window", (2, 0)))
  flags: tuple[str, ...] = ("is_causal", "return_stats")


def _engine(module):
  return lambda q, k, v, **kw: module.attention(q, k, v, interpret=True, **kw)


DENSE_STATIC = (("scale", 0.5), ("softcap", 3.0), ("window", (2, 0)))


def _implementations(op: _op.Op) -> list[Any]:
  """The engines this suite runs: attnjax's own that run on every platform (jax's and the
  platform kernels are tested where they run; the Pallas ones below, checks only), and None."""
  return [n for n, e in op.engines.items() if e.platform is None and e.vouched_by == "attnjax"] + [
    None
  ]


def _sample_fn(sample: _op.Sample, implementation) -> Callable[..., Any]:
  return lambda q, k, v, **kw: sample.call(q, k, v, implementation=implementation, **kw)


def family_cases(ops=None) -> list[Case]:
  """Every registered op's sample calls (:attr:`attnjax._src.op.Op.samples`), on each engine
  this suite runs: a new family's cases come from its op, with no entry here."""
  cases = []
  for op in (_op.OPS if ops is None else ops).values():
    for sample in op.samples():
      for i in _implementations(op):
        cases.append(
          Case(
            f"{sample.name}-{i}",
            _sample_fn(sample, i),
            self_only=sample.self_only,
            stats="return_stats" if sample.stats else None,
            state=sample.state,
            static=sample.static,
            flags=sample.flags,
          )
        )
  return cases


CASES = (
  family_cases()
  + [
    Case(
      "blockwise.attention",
      lambda q, k, v, **kw: blockwise.attention(q, k, v, **kw),
      static=DENSE_STATIC + (("block_q", 2), ("block_k", 2)),
    )
  ]
  + [
    Case(
      f"{m.__name__.split('.')[-1]}.attention",
      _engine(m),
      runs=False,
      static=(),
      flags=("is_causal", "return_stats", "interpret"),
    )
    for m in (pallas_gpu, pallas_tpu)
  ]
)
IDS = [c.name for c in CASES]


def _qkv(T, S, *, H=H, seed=0):
  return rand_qkv(B=1, T=T, S=S, N=N, K=K, H=H, seed=seed)


def _result(case: Case, q, k, v, **kw):
  """``(out, stats or None, state or None)`` of one call asking for everything it can give."""
  if case.stats:
    kw["return_stats"] = True
  if case.state:
    kw["return_state"] = True
  res = case.fn(q, k, v, **kw)
  if case.stats and case.state:  # linear: ((out, state), stats)
    (out, state), stats = res
    return out, stats, state
  if case.stats:
    return res[0], res[1], None
  if case.state:
    return res[0], None, res[1]
  return res, None, None


def _check_finite(tree):
  for leaf in jax.tree.leaves(tree):
    assert np.all(np.isfinite(np.asarray(leaf))), tree


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_zero_queries(case):
  S = 0 if case.self_only else 3
  q, k, v = _qkv(0, S)
  out, stats, state = _result(case, q, k, v)
  assert out.shape == (1, 0, N, H) and out.dtype == q.dtype
  if stats is not None:
    assert stats.logsumexp is None or stats.logsumexp.shape == (1, N, 0)
    _check_finite(stats)
  if state is not None and S == 0:  # no keys: the state stays zero
    np.testing.assert_array_equal(
      np.concatenate([np.ravel(x) for x in jax.tree.leaves(state)]), 0.0
    )

  def loss(q, k, v):
    out, stats, _ = _result(case, q, k, v)
    extra = 0.0 if stats is None else sum(jnp.sum(x) for x in jax.tree.leaves(stats))
    return jnp.sum(out) + extra

  grads = jax.grad(loss, (0, 1, 2))(q, k, v)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize(
  "case", [c for c in CASES if not c.self_only], ids=[c.name for c in CASES if not c.self_only]
)
def test_zero_keys(case):
  """No keys: every row has no allowed key, so zeros by the shared rule, finite statistics."""
  q, k, v = _qkv(3, 0)
  out, stats, _ = _result(case, q, k, v)
  assert out.shape == (1, 3, N, H)
  np.testing.assert_array_equal(out, 0.0)
  if stats is not None:
    _check_finite(stats)
    np.testing.assert_array_equal(stats.row_sum, 0.0)
  g = jax.grad(lambda q: jnp.sum(_result(case, q, k, v)[0]))(q)
  np.testing.assert_array_equal(g, 0.0)


def test_zero_keys_sink_logits_and_residual():
  """S = 0 with a learned null column and jax.nn's residual: still the empty-row rule."""
  q, k, v = _qkv(3, 0)
  for impl in ("reference", "blockwise", None):
    out, res = attnjax.dot_product_attention(
      q, k, v, sink_logits=jnp.zeros(N), return_residual=True, implementation=impl
    )
    np.testing.assert_array_equal(out, 0.0)
    assert res.shape == (1, 3, N) and np.all(np.isfinite(res))


def test_every_registered_family_has_its_cases():
  """Every op of the registry is called by this suite, with each engine it runs here, from the
  sample calls the op supplies."""
  names = {c.name for c in CASES}
  for op in _op.OPS.values():
    assert op.samples(), f"{op.name} supplies no sample call (Op.samples)"
    for sample in op.samples():
      assert {f"{sample.name}-{i}" for i in _implementations(op)} <= names, sample.name
  assert {
    "dot_product_attention-reference",
    "dot_product_attention-blockwise",
    "dot_product_attention-None",
    "qk_norm_attention-None",
    "cosine_attention-None",
    "sparse_attention-blockwise",
    "linear_attention-quadratic",
    "gated_linear_attention-chunked",
    "delta_rule_attention-recurrent",
  } <= names


def test_zero_length_recurrent_state_passes_through():
  """A recurrent scan over no steps returns the initial state, with its gradient."""
  q, k, v = _qkv(0, 0)
  s0 = jnp.asarray(np.random.default_rng(1).standard_normal((1, N, H, H)), jnp.float32)
  for name in ("gated_linear", "delta_rule"):
    for sample, impl in itertools.product(_op.OPS[name].samples(), _op.OPS[name].implementations):
      fn = _sample_fn(sample, impl)
      out, state = fn(q, k, v, initial_state=s0, return_state=True)
      assert out.shape == (1, 0, N, H)
      np.testing.assert_array_equal(state, s0)
      g = jax.grad(lambda s: jnp.sum(fn(q, k, v, initial_state=s, return_state=True)[1]))(s0)
      np.testing.assert_array_equal(g, 1.0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_head_dim_zero(case):
  q, k, v = _qkv(4, 4, H=0)
  with pytest.raises(ValueError, match="head dims must be positive"):
    case.fn(q, k, v)


def _forms(value):
  """The spellings of a static option's value that must mean the same as ``value``."""
  if isinstance(value, tuple):
    return [list(value), np.asarray(value), jnp.asarray(value), tuple(np.int64(x) for x in value)]
  if isinstance(value, float):
    return [
      np.float32(value),
      np.float64(value),
      jnp.float32(value),
      np.asarray(value),
      jnp.asarray(value),
    ]
  return [np.int32(value), np.int64(value), jnp.int32(value), np.asarray(value)]


def _program(case: Case, q, k, v, **kw) -> str:
  """The program ``case.fn(q, k, v, **kw)`` compiles to, as StableHLO text: two spellings of
  an option that give the same text compute the same thing, without compiling either."""
  return jax.jit(lambda q, k, v: case.fn(q, k, v, **kw)).lower(q, k, v).as_text()


STATIC_CASES = [(c, name, value) for c in CASES for name, value in c.static]


@pytest.mark.parametrize(
  "case,name,value", STATIC_CASES, ids=[f"{c.name}-{n}" for c, n, _ in STATIC_CASES]
)
def test_static_option_spellings(case, name, value):
  """numpy / jax scalars, 0-d arrays and lists mean the Python value (the same program); a
  traced value or a sequence for a number is an error naming the option."""
  q, k, v = _qkv(4, 4)
  want = _program(case, q, k, v, **{name: value})
  for form in _forms(value):
    assert _program(case, q, k, v, **{name: form}) == want, f"{name}={form!r}"
  if not isinstance(value, tuple):
    with pytest.raises((TypeError, ValueError), match=name):
      case.fn(q, k, v, **{name: [value]})
  with pytest.raises(TypeError, match=f"{name} is a static option"):
    jax.jit(lambda x: case.fn(q, k, v, **{name: x}))(value)


FLAG_CASES = [(c, flag) for c in CASES for flag in c.flags]


@pytest.mark.parametrize("case,flag", FLAG_CASES, ids=[f"{c.name}-{f}" for c, f in FLAG_CASES])
def test_flags_take_bools_only(case, flag):
  q, k, v = _qkv(4, 4)
  for bad in (1, 0, np.int32(1), "yes", None):
    with pytest.raises(TypeError, match=flag):
      case.fn(q, k, v, **{flag: bad})
  if case.runs:
    _program(case, q, k, v, **{flag: np.bool_(True)})  # a numpy bool is a bool


@pytest.mark.parametrize("bad", [1, 0, 1.0, "denominators", None])
def test_linear_normalize_takes_its_documented_values(bad):
  q, k, v = _qkv(4, 4)
  with pytest.raises((TypeError, ValueError), match="normalize"):
    attnjax.linear_attention(q, k, v, normalize=bad)


def test_jax_scalar_scale_as_jax_nn():
  """The drop-in takes the scalar scales :func:`jax.nn.dot_product_attention` takes."""
  q, k, v = _qkv(4, 4)
  for scale in (jnp.float32(0.5), np.float32(0.5), jnp.asarray(0.5)):
    want = jax.nn.dot_product_attention(q, k, v, scale=scale)
    got = attnjax.dot_product_attention(q, k, v, scale=scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_blockwise_attention_takes_the_keywords_its_docstring_names():
  q, k, v = _qkv(4, 4)
  doc = inspect.getdoc(blockwise.attention)
  for name in options.KEYWORDS:
    assert f"``{name}``" in doc, name
  for name, value in (
    ("local_window_size", 2),
    ("query_seq_lengths", jnp.array([4])),
    ("return_residual", True),
    ("implementation", "reference"),
  ):
    assert f"``{name}``" in doc, name
    with pytest.raises(TypeError, match=name):
      blockwise.attention(q, k, v, **{name: value})
  want = attnjax.dot_product_attention(
    q, k, v, is_causal=True, window=(1, 0), softcap=2.0, implementation="reference"
  )
  got = blockwise.attention(
    q, k, v, is_causal=True, window=[1, 0], softcap=np.float32(2.0), block_q=np.int64(2), block_k=2
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
