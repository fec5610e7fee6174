"""A seeded randomized walk over the option space of every family.

Each draw picks shapes (lengths 0 and 1 included, block sizes that do not divide them),
dtypes, values (huge ones included) and options (spelled as Python, numpy or jax values)
for one family, then perhaps one defect: a wrong rank, mismatched heads or batch, mixed or
integer dtypes, a negative window, a non-positive size, an unknown choice, an int for a
flag, a sequence for a number. A draw is then classified:

- valid: every implementation returns what ``implementation="reference"`` returns (the
  output, the statistics or state when asked), or, where the reference refuses the call
  with a ``ValueError`` / ``TypeError``, refuses it with the same message;
- invalid: every implementation raises ``ValueError`` or ``TypeError`` whose message names
  the defect's argument.

A few draws per family run by default; ``-m slow`` runs many more.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import op as _op, normalizers, patterns
from attnjax._src.ops.linear import attention as linear

from helpers import assert_close, rand_qkv

DRAWS = 4
SLOW_DRAWS = 40


@dataclasses.dataclass
class Draw:
  """One call of a family: ``call(implementation)`` runs it; ``defect`` names the argument a
  valid implementation must name in its error (None: a valid call)."""

  call: Callable[[Any], Any]
  implementations: tuple[Any, ...]
  defect: Optional[str] = None
  what: str = ""


def _choice(rng, options):
  return options[int(rng.integers(len(options)))]


def _spell(rng, value):
  """``value`` as Python, numpy or jax (a list for a pair)."""
  if value is None or isinstance(value, bool):
    return value
  if isinstance(value, tuple):
    return _choice(rng, [value, list(value), np.asarray(value)])
  if isinstance(value, float):
    return _choice(rng, [value, np.float32(value), jnp.float32(value), np.asarray(value)])
  return _choice(rng, [value, np.int64(value), jnp.int32(value)])


def _arrays(rng, *, self_only: bool, values: str = "normal"):
  B = _choice(rng, [1, 2])
  T = _choice(rng, [0, 1, 3, 8])
  S = T if self_only else _choice(rng, [0, 1, 5, 8])
  K = _choice(rng, [1, 2])
  N = K * _choice(rng, [1, 2])
  H = _choice(rng, [4, 8])
  dtype = _choice(rng, [jnp.float32, jnp.float32, jnp.bfloat16])
  scales = (1.0, 1.0, 1.0)
  if values == "huge" or (values == "any" and rng.random() < 0.2):
    scales = (30.0, 30.0, 1e4)
  q, k, v = rand_qkv(
    B=B, T=T, S=S, N=N, K=K, H=H, seed=int(rng.integers(1 << 30)), dtype=dtype, scales=scales
  )
  if values == "any" and T > 0 and S > 0 and rng.random() < 0.15:
    # A NaN in one input: it may spread (as in the reference), never differ between paths.
    which = int(rng.integers(3))
    x = (q, k, v)[which].at[0, 0, 0, 0].set(jnp.nan)
    q, k, v = [x if i == which else y for i, y in enumerate((q, k, v))]
  return q, k, v


ARRAY_DEFECTS = (
  ("q", lambda q, k, v: (q[0], k, v)),
  ("k", lambda q, k, v: (q, k[..., None], v)),
  ("q", lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32))),
  ("dtype", lambda q, k, v: (q, k.astype(jnp.float16), v)),
  ("head", lambda q, k, v: (q, jnp.concatenate([k, k], -1), v)),
  ("batch", lambda q, k, v: (q, jnp.concatenate([k, k], 0), jnp.concatenate([v, v], 0))),
  ("heads", lambda q, k, v: (jnp.concatenate([q, q[:, :, :1]], 2), k, v)),
)


def _array_defect(rng, q, k, v):
  name, make = _choice(rng, ARRAY_DEFECTS)
  if name == "heads" and k.shape[2] == 1:  # any N is a multiple of one kv head
    k, v = jnp.concatenate([k, k], 2), jnp.concatenate([v, v], 2)
    q = jnp.concatenate([q, q], 2)
  return name, make(q, k, v)


def _dense_options(
  rng,
  kw: dict,
  defective: bool,
  *,
  scale=True,
  causal=True,
  window=True,
  softcap=True,
  normalizer=True,
  stats=True,
):
  """Draws dense options into ``kw``; returns the defect's name, or None."""
  if causal:
    kw["is_causal"] = bool(rng.random() < 0.5)
  if scale and rng.random() < 0.5:
    kw["scale"] = _spell(rng, float(_choice(rng, [0.1, 0.5, 2.0])))
  if window and rng.random() < 0.4:
    kw["window"] = _spell(rng, (int(rng.integers(0, 10)), int(rng.integers(0, 3))))
  if softcap and rng.random() < 0.3:
    kw["softcap"] = _spell(rng, float(_choice(rng, [1.0, 5.0, 50.0])))
  if normalizer and rng.random() < 0.5:
    kw["normalizer"] = _choice(rng, normalizers.NORMALIZERS)
  if stats:
    kw["return_stats"] = bool(rng.random() < 0.4)
  defects = [
    name
    for name, on in (
      ("is_causal", causal),
      ("scale", scale),
      ("window", window),
      ("softcap", softcap),
      ("normalizer", normalizer),
      ("return_stats", stats),
    )
    if on
  ]
  if not defective:
    return None
  name = _choice(rng, defects)
  kw[name] = {
    "is_causal": 1,
    "return_stats": 0,
    "scale": [0.5, 0.5],
    "window": _choice(rng, [-1, (2, -1), (1, 2, 3)]),
    "softcap": _choice(rng, [-1.0, 0.0, float("nan")]),
    "normalizer": "softmaxx",
  }[name]
  return name


def _draw(rng, family: str) -> Draw:
  mode = _choice(rng, ["valid", "valid", "valid", "option", "array"])
  defective = mode == "option"
  own = defective and rng.random() < 0.4  # a family's own option, not a dense one
  self_only = family in ("block_select", "gated", "delta", "nsa", "dsa")
  q, k, v = _arrays(
    rng, self_only=self_only, values="any" if family in ("dense", "qk_norm", "sparse") else "normal"
  )
  kw: dict[str, Any] = {}
  defect = None
  extra: dict[str, Any] = {}
  if family == "dense":
    fn, impls = attnjax.dot_product_attention, ("blockwise", None)
    defect = _dense_options(rng, kw, defective)
  elif family == "qk_norm":
    fn, impls = attnjax.qk_norm_attention, ("blockwise", None)
    kw["norm"] = _choice(rng, ["l2", "rms", "layer"])
    defect = _dense_options(rng, kw, defective)
  elif family == "cosine":
    fn, impls = attnjax.cosine_attention, ("blockwise", None)
    extra["temperature"] = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32)
    defect = _dense_options(rng, kw, defective, scale=False)
  elif family == "sparse":
    fn, impls = attnjax.sparse_attention, ("blockwise", None)
    kw["pattern"] = _choice(
      rng,
      [
        patterns.causal(),
        patterns.sliding_window(2),
        patterns.sliding_window(3, 1),
        patterns.strided(2),
        patterns.sinks_window(1, 2),
      ],
    )
    kw["block_size"] = _spell(rng, _choice(rng, [1, 2, 3, 4]))
    defect = _dense_options(rng, kw, defective and not own, causal=False, window=False)
    if own:
      defect, kw["block_size"] = "block_size", _choice(rng, [0, -2, 2.0])
  elif family == "compressed":
    fn, impls = attnjax.compressed_attention, ("blockwise", None)
    kw["stride"] = _spell(rng, _choice(rng, [1, 2, 3]))
    kw["pool"] = _choice(rng, ["mean", "max"])
    kw["block_size"] = _spell(rng, _choice(rng, [2, 3, 128]))
    defect = _dense_options(rng, kw, defective and not own, window=False)
    if rng.random() < 0.4:
      kw["window"] = _spell(rng, int(rng.integers(0, 4)))
    if own:
      defect, kw["stride"] = "stride", _choice(rng, [0, -1, 1.5])
  elif family == "block_select":
    fn, impls = attnjax.block_select_attention, ("gathered", None)
    kw["block_size"] = _spell(rng, _choice(rng, [1, 2, 3]))
    kw["top_k"] = _spell(rng, _choice(rng, [0, 1, 3]))
    defect = _dense_options(rng, kw, defective and not own, window=False)
    if own:
      defect = _choice(rng, ["block_size", "top_k"])
      kw[defect] = _choice(rng, [-1, 2.5]) if defect == "top_k" else 0
  elif family == "nsa":
    fn, impls = attnjax.nsa_attention, ("blockwise", None)
    B, T, N, _ = q.shape
    extra["gates"] = jnp.asarray(rng.uniform(0.0, 1.0, (B, T, N, 3)), q.dtype)
    d = _choice(rng, [1, 2])
    kw["stride"] = _spell(rng, d)
    kw["block_length"] = _spell(rng, d * _choice(rng, [1, 2]))
    ls = d * _choice(rng, [1, 2])
    kw["selection_block"] = _spell(rng, ls)
    blocks = max(1, -(-T // ls))
    kw["num_initial"] = _choice(rng, [0, 1])
    kw["num_local"] = _choice(rng, [0, 1])
    lo = max(1, kw["num_initial"] + kw["num_local"])
    kw["num_selected"] = _spell(rng, int(rng.integers(lo, max(lo, blocks) + 1)))
    kw["window"] = _spell(rng, int(rng.integers(1, 5)))
    if rng.random() < 0.5:
      kw["normalizer"] = _choice(rng, normalizers.NORMALIZERS)
    kw["return_stats"] = bool(rng.random() < 0.4)
    if defective:
      defect = _choice(rng, ["stride", "window", "num_selected", "normalizer"])
      kw[defect] = {"stride": 2 * d * 4, "window": 0, "num_selected": 0, "normalizer": "softmaxx"}[
        defect
      ]
  elif family == "dsa":
    fn, impls = attnjax.dsa_attention, ("blockwise", None)
    B, T = q.shape[:2]
    NI = _choice(rng, [1, 2])
    extra["index_q"] = jnp.asarray(rng.standard_normal((B, T, NI, 4)), q.dtype)
    extra["index_k"] = jnp.asarray(rng.standard_normal((B, k.shape[1], 4)), q.dtype)
    extra["index_weights"] = jnp.asarray(rng.standard_normal((B, T, NI)), q.dtype)
    kw["top_k"] = _spell(rng, _choice(rng, [1, 2, 5, 100]))
    defect = _dense_options(
      rng, kw, defective and not own, causal=False, window=False, softcap=False
    )
    if own:
      defect = _choice(rng, ["top_k", "index_weights"])
      if defect == "top_k":
        kw["top_k"] = _choice(rng, [0, -1, 2.5])
      else:
        extra["index_weights"] = extra["index_weights"][..., :1].repeat(NI + 1, axis=-1)
  elif family == "linear":
    fn, impls = attnjax.linear_attention, ("quadratic", "chunked", None)
    kw["is_causal"] = bool(rng.random() < 0.5)
    if kw["is_causal"] and q.shape[1] == k.shape[1]:
      impls += ("recurrent",)
    kw["normalize"] = _choice(rng, linear.NORMALIZE + (True, False))
    kw["chunk_size"] = _spell(rng, _choice(rng, [1, 2, 3, 64]))
    kw["return_state"] = bool(rng.random() < 0.5)
    kw["return_stats"] = bool(rng.random() < 0.3)
    if defective:
      defect = _choice(rng, ["normalize", "chunk_size", "return_state", "is_causal"])
      kw[defect] = {
        "normalize": _choice(rng, [1, 0, "denom"]),
        "chunk_size": 0,
        "return_state": 1,
        "is_causal": 0,
      }[defect]
  elif family in ("gated", "delta"):
    B, T, N, H = q.shape
    k = k / jnp.maximum(
      jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True), 1e-6
    ).astype(k.dtype)
    impls = ("recurrent", "quadratic", "chunked", None)
    decay_shape = (B, T, N, H) if family == "gated" and rng.random() < 0.5 else (B, T, N)
    log_decay = -jnp.asarray(rng.uniform(0.01, 1.0, decay_shape), jnp.float32)
    if family == "gated":
      fn = attnjax.gated_linear_attention
      extra["log_decay"] = log_decay
    else:
      fn = attnjax.delta_rule_attention
      extra["beta"] = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, N)), jnp.float32)
      extra["log_decay"] = log_decay if rng.random() < 0.5 else None
    kw["chunk_size"] = _spell(rng, _choice(rng, [1, 2, 3, 64]))
    kw["return_state"] = bool(rng.random() < 0.5)
    if rng.random() < 0.5:
      kw["scale"] = _spell(rng, float(_choice(rng, [0.25, 1.0])))
    if defective:
      defect = _choice(rng, ["chunk_size", "return_state", "scale"])
      kw[defect] = {
        "chunk_size": _choice(rng, [0, -3]),
        "return_state": 1,
        "scale": _choice(rng, [-1.0, [0.5]]),
      }[defect]
  else:
    raise KeyError(f"_draw does not know the family {family!r}")
  if mode == "array":
    defect, (q, k, v) = _array_defect(rng, q, k, v)

  def call(implementation, q=q, k=k, v=v):
    if family == "delta":
      return fn(
        q, k, v, extra["beta"], log_decay=extra["log_decay"], implementation=implementation, **kw
      )
    if family == "nsa":
      return fn(q, k, v, extra["gates"], implementation=implementation, **kw)
    if family == "dsa":
      index = (extra["index_q"], extra["index_k"], extra["index_weights"])
      return fn(q, k, v, *index, implementation=implementation, **kw)
    return fn(q, k, v, implementation=implementation, **extra, **kw)

  what = f"{family} q{tuple(np.shape(q))} k{tuple(np.shape(k))} {q.dtype} {kw}"
  return Draw(call, impls, defect, what)


# The calls _draw knows, by op name (front ends of one op share its engines). The families come
# from the op registry (attnjax._op.OPS): a registered op without an entry here fails
# test_every_registered_family_is_drawn.
DRAWN = {
  "dense": ("dense", "qk_norm", "cosine"),
  "sparse": ("sparse",),
  "compressed": ("compressed",),
  "block_select": ("block_select",),
  "nsa": ("nsa",),
  "dsa": ("dsa",),
  "linear": ("linear",),
  "gated_linear": ("gated",),
  "delta_rule": ("delta",),
}
FAMILIES = tuple(label for op in _op.OPS for label in DRAWN.get(op, ()))


def _rng(seed: int, family: str):
  """The draw's generator: seeded by the draw's number and a stable hash of the family's name,
  so adding a family changes no other family's draws."""
  return np.random.default_rng([seed, zlib.crc32(family.encode())])


def check_draw(draw: Draw):
  if draw.defect is not None:
    for impl in ("reference",) + draw.implementations:
      with pytest.raises((ValueError, TypeError)) as info:
        draw.call(impl)
      assert draw.defect in str(info.value), (
        f"{draw.what}: {info.value!r} does not name {draw.defect}"
      )
    return
  try:
    want = draw.call("reference")
  except (ValueError, TypeError) as refusal:
    for impl in draw.implementations:
      with pytest.raises(type(refusal)) as info:
        draw.call(impl)
      assert str(info.value) == str(refusal), draw.what
    return
  for impl in draw.implementations:
    what = f"{impl}: {draw.what}"
    tol = 3e-2 if "bfloat16" in what else 2e-4  # of each array's scale
    assert_close(draw.call(impl), want, what, rtol=tol, atol=tol, scaled=True)


def test_every_registered_family_is_drawn():
  assert set(DRAWN) == set(_op.OPS), "teach _draw the new family and name it in DRAWN"


@pytest.mark.parametrize("seed", range(DRAWS))
@pytest.mark.parametrize("family", FAMILIES)
def test_option_space(family, seed):
  check_draw(_draw(_rng(seed, family), family))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DRAWS, SLOW_DRAWS))
@pytest.mark.parametrize("family", FAMILIES)
def test_option_space_many(family, seed):
  check_draw(_draw(_rng(seed, family), family))
