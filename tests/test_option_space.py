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

from attnjax._src import op as _op, normalizers

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
  if value is None or isinstance(value, bool) or not isinstance(value, (int, float, tuple)):
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


# The dense options the walk draws for a sample that forwards them (and takes them with dense
# attention's meaning): each a valid value or two, and invalid ones a family must refuse by name.
DENSE_OPTIONS = {
  "scale": ((0.1, 0.5, 2.0), ([0.5, 0.5],)),
  "window": (((0, 0), (3, 1), (9, 2)), (-1, (2, -1), (1, 2, 3))),
  "softcap": ((1.0, 5.0, 50.0), (-1.0, 0.0, float("nan"))),
  "normalizer": (normalizers.NORMALIZERS, ("softmaxx",)),
}
# How often each dense option is drawn when a sample takes it.
DENSE_ODDS = {"scale": 0.5, "window": 0.4, "softcap": 0.3, "normalizer": 0.5}


def _implementations(op: _op.Op) -> tuple[Any, ...]:
  """The engines the walk compares with the reference: attnjax's own that run on every
  platform, and auto-dispatch."""
  return tuple(
    n
    for n, e in op.engines.items()
    if n != "reference" and e.platform is None and e.vouched_by == "attnjax"
  ) + (None,)


def _draw(rng, op: _op.Op, sample: _op.Sample) -> Draw:
  """One call of ``sample``: options drawn from its flags, its choices and the dense options it
  forwards, and perhaps one defect (an invalid option, or a defective array)."""
  mode = _choice(rng, ["valid", "valid", "valid", "option", "array"])
  q, k, v = _arrays(
    rng, self_only=sample.self_only, values="any" if sample.extreme_values else "normal"
  )
  dense = [n for n in DENSE_OPTIONS if n in sample.dense_keywords and n not in sample.own_keywords]
  kw: dict[str, Any] = {}
  defects: dict[str, tuple] = {}
  for flag in sample.flags:
    kw[flag] = bool(rng.random() < 0.5)
    defects[flag] = (1, 0)
  for name in dense:
    valid, invalid = DENSE_OPTIONS[name]
    if rng.random() < DENSE_ODDS[name]:
      kw[name] = _spell(rng, _choice(rng, valid))
    defects[name] = invalid
  for name, values in sample.choices:
    if rng.random() < 0.5:
      kw[name] = _spell(rng, _choice(rng, values))
  defects.update(dict(sample.defects))
  defect = None
  if mode == "option" and defects:
    defect = _choice(rng, sorted(defects))
    kw[defect] = _choice(rng, defects[defect])
  elif mode == "array":
    defect, (q, k, v) = _array_defect(rng, q, k, v)

  def call(implementation, q=q, k=k, v=v):
    return sample.call(q, k, v, implementation=implementation, **kw)

  what = f"{sample.name} q{tuple(np.shape(q))} k{tuple(np.shape(k))} {q.dtype} {kw}"
  return Draw(call, _implementations(op), defect, what)


def samples(ops=None) -> list[tuple[str, str, int]]:
  """``(op name, sample name, index)`` of every registered op's samples: the walk's families."""
  return [
    (op.name, sample.name, i)
    for op in (_op.OPS if ops is None else ops).values()
    for i, sample in enumerate(op.samples())
  ]


def _refuses_by_name(impl, error: Exception) -> bool:
  """A named engine that does not support a valid call says so (``op.run_engine``)."""
  return impl is not None and f"implementation={impl!r} does not support" in str(error)


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
    try:
      got = draw.call(impl)
    except ValueError as e:
      if _refuses_by_name(impl, e):
        continue
      raise
    tol = 3e-2 if "bfloat16" in what else 2e-4  # of each array's scale
    assert_close(got, want, what, rtol=tol, atol=tol, scaled=True)


def _rng(seed: int, family: str):
  """The draw's generator: seeded by the draw's number and a stable hash of the family's name,
  so adding a family changes no other family's draws."""
  return np.random.default_rng([seed, zlib.crc32(family.encode())])


def walk(op_name: str, index: int, seed: int) -> None:
  """Draws and checks one call of the ``index``-th sample of the op ``op_name``."""
  op = _op.OPS[op_name]
  sample = op.samples()[index]
  check_draw(_draw(_rng(seed, sample.name), op, sample))


SAMPLES = samples()
IDS = [name for _, name, _ in SAMPLES]


def test_every_registered_family_is_drawn():
  drawn = {op for op, _, _ in SAMPLES}
  assert drawn >= set(_op.OPS), f"{sorted(set(_op.OPS) - drawn)} supply no sample call"


@pytest.mark.parametrize("seed", range(DRAWS))
@pytest.mark.parametrize("op_name,name,index", SAMPLES, ids=IDS)
def test_option_space(op_name, name, index, seed):
  walk(op_name, index, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DRAWS, SLOW_DRAWS))
@pytest.mark.parametrize("op_name,name,index", SAMPLES, ids=IDS)
def test_option_space_many(op_name, name, index, seed):
  walk(op_name, index, seed)
