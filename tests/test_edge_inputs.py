"""Edge inputs over every family and implementation: zero lengths, head dim 0, static options
given as numpy / jax scalars, 0-d arrays or lists, and ints for flags."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import op as _op, patterns
from attnjax._src.kernels import blockwise, pallas_gpu, pallas_tpu

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


def _dense(impl):
  return lambda q, k, v, **kw: attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)


def _qk_norm(impl):
  return lambda q, k, v, **kw: attnjax.qk_norm_attention(q, k, v, implementation=impl, **kw)


def _cosine(impl):
  return lambda q, k, v, **kw: attnjax.cosine_attention(
    q, k, v, temperature=jnp.zeros((N,)), implementation=impl, **kw
  )


def _sparse(impl):
  return lambda q, k, v, **kw: attnjax.sparse_attention(
    q, k, v, pattern=patterns.sliding_window(2), implementation=impl, **kw
  )


def _compressed(impl):
  return lambda q, k, v, **kw: attnjax.compressed_attention(
    q, k, v, **{"stride": 2, **kw}, implementation=impl
  )


def _block_select(impl):
  return lambda q, k, v, **kw: attnjax.block_select_attention(
    q, k, v, **{"block_size": 2, "top_k": 1, **kw}, implementation=impl
  )


def _nsa(impl):
  def call(q, k, v, **kw):
    gates = jnp.full(q.shape[:3] + (3,), 0.5, q.dtype)
    opts = {"block_length": 2, "stride": 1, "selection_block": 2, "num_selected": 1}
    opts.update(num_initial=0, num_local=1, window=1)
    return attnjax.nsa_attention(q, k, v, gates, **{**opts, **kw}, implementation=impl)

  return call


def _dsa(impl):
  def call(q, k, v, **kw):
    B, T = q.shape[:2]
    S = k.shape[1]
    index = (jnp.ones((B, T, 2, 3)), jnp.ones((B, S, 3)), jnp.ones((B, T, 2)))
    return attnjax.dsa_attention(q, k, v, *index, **{"top_k": 2, **kw}, implementation=impl)

  return call


def _linear(impl):
  return lambda q, k, v, **kw: attnjax.linear_attention(
    q, k, v, **{"is_causal": impl == "recurrent", **kw}, implementation=impl
  )


def _gated(impl):
  def call(q, k, v, **kw):
    return attnjax.gated_linear_attention(
      q, k, v, log_decay=-0.1 * jnp.ones(q.shape[:3]), implementation=impl, **kw
    )

  return call


def _delta(impl):
  def call(q, k, v, **kw):
    return attnjax.delta_rule_attention(
      q, k, v, 0.5 * jnp.ones(q.shape[:3]), implementation=impl, **kw
    )

  return call


def _engine(module):
  return lambda q, k, v, **kw: module.attention(q, k, v, interpret=True, **kw)


DENSE_STATIC = (("scale", 0.5), ("softcap", 3.0), ("window", (2, 0)))
RECURRENT_STATIC = (("scale", 0.5), ("chunk_size", 2))

# How each family's public functions are called, by op name (front ends of one op share its
# engines): ``(label, make(implementation) -> fn, {Case field: value or fn(implementation)})``.
# The families and their implementations come from the op registry (attnjax._op.OPS): a
# registered op without an entry here fails test_every_registered_family_has_its_cases.
CALLS: dict[str, list[tuple[str, Callable[[Any], Any], dict[str, Any]]]] = {
  "dense": [
    ("dense", _dense, {}),
    ("qk_norm", _qk_norm, dict(static=DENSE_STATIC + (("eps", 1e-6),))),
    ("cosine", _cosine, dict(static=(("softcap", 3.0), ("window", (2, 0))))),
  ],
  "sparse": [
    ("sparse", _sparse, dict(static=(("scale", 0.5), ("block_size", 2)), flags=("return_stats",)))
  ],
  "compressed": [
    (
      "compressed",
      _compressed,
      dict(static=(("scale", 0.5), ("stride", 2), ("window", (1, 0)), ("block_size", 2))),
    )
  ],
  "block_select": [
    (
      "block_select",
      _block_select,
      dict(
        self_only=True,
        static=(("scale", 0.5), ("block_size", 2), ("top_k", 1)),
        flags=("is_causal", "return_stats", "return_selection"),
      ),
    )
  ],
  "nsa": [
    (
      "nsa",
      _nsa,
      dict(
        self_only=True,
        stats=None,  # NSAStats: each branch's, tested in tests/test_nsa.py
        static=(
          ("scale", 0.5),
          ("block_length", 2),
          ("stride", 1),
          ("selection_block", 2),
          ("num_selected", 2),
          ("window", 2),
        ),
        flags=("return_stats",),
      ),
    )
  ],
  "dsa": [
    (
      "dsa",
      _dsa,
      dict(self_only=True, static=(("scale", 0.5), ("top_k", 3)), flags=("return_stats",)),
    )
  ],
  "linear": [
    (
      "linear",
      _linear,
      dict(
        self_only=lambda i: i == "recurrent",
        state=True,
        static=(("chunk_size", 2),),
        flags=("is_causal", "return_stats", "return_state"),
      ),
    )
  ],
  "gated_linear": [
    (
      "gated",
      _gated,
      dict(
        self_only=True, stats=None, state=True, static=RECURRENT_STATIC, flags=("return_state",)
      ),
    )
  ],
  "delta_rule": [
    (
      "delta",
      _delta,
      dict(
        self_only=True, stats=None, state=True, static=RECURRENT_STATIC, flags=("return_state",)
      ),
    )
  ],
}


def _implementations(op: _op.Op) -> list[Any]:
  """The engines this suite runs: attnjax's own that run on every platform (jax's and the
  platform kernels are tested where they run; the Pallas ones below, checks only), and None."""
  return [n for n, e in op.engines.items() if e.platform is None and e.vouched_by == "attnjax"] + [
    None
  ]


def _family_cases() -> list[Case]:
  cases = []
  for op in _op.OPS.values():
    for label, make, fields in CALLS.get(op.name, ()):
      for i in _implementations(op):
        kw = {f: (v(i) if callable(v) else v) for f, v in fields.items()}
        cases.append(Case(f"{label}-{i}", make(i), **kw))
  return cases


CASES = (
  _family_cases()
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
  """Every op of the registry is called by this suite, with each engine it runs here."""
  assert set(CALLS) == set(_op.OPS), "describe how to call the new family in CALLS"
  names = {c.name for c in CASES}
  for op in _op.OPS.values():
    for label, _, _ in CALLS[op.name]:
      assert {f"{label}-{i}" for i in _implementations(op)} <= names, label
  assert {
    "dense-reference",
    "dense-blockwise",
    "dense-None",
    "sparse-blockwise",
    "linear-quadratic",
    "gated-chunked",
    "delta-recurrent",
  } <= names


def test_zero_length_recurrent_state_passes_through():
  """A recurrent scan over no steps returns the initial state, with its gradient."""
  q, k, v = _qkv(0, 0)
  s0 = jnp.asarray(np.random.default_rng(1).standard_normal((1, N, H, H)), jnp.float32)
  for fn in (_gated, _delta):
    for impl in ("reference", "recurrent", "quadratic", "chunked"):
      out, state = fn(impl)(q, k, v, initial_state=s0, return_state=True)
      assert out.shape == (1, 0, N, H)
      np.testing.assert_array_equal(state, s0)
      g = jax.grad(lambda s: jnp.sum(fn(impl)(q, k, v, initial_state=s, return_state=True)[1]))(s0)
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


STATIC_CASES = [(c, name, value) for c in CASES for name, value in c.static]


@pytest.mark.parametrize(
  "case,name,value", STATIC_CASES, ids=[f"{c.name}-{n}" for c, n, _ in STATIC_CASES]
)
def test_static_option_spellings(case, name, value):
  """numpy / jax scalars, 0-d arrays and lists mean the Python value; a traced value or a
  sequence for a number is an error naming the option."""
  q, k, v = _qkv(4, 4)
  want = case.fn(q, k, v, **{name: value})
  for form in _forms(value):
    got = case.fn(q, k, v, **{name: form})
    np.testing.assert_array_equal(
      jax.tree.leaves(got)[0], jax.tree.leaves(want)[0], err_msg=f"{name}={form!r}"
    )
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
    case.fn(q, k, v, **{flag: np.bool_(True)})  # a numpy bool is a bool


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
  for name in attnjax.options.KEYWORDS:
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
