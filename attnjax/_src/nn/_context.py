"""The layer's context-parallel path: its attention call inside ``shard_map`` over a ``context`` axis.

Under an ambient mesh with a ``context`` axis of size > 1, a layer's self-attention
training forward runs its family function once per device on that device's shard of the
sequence, with ``context_axis="context"`` (:mod:`attnjax.parallel`): tokens split over
``context``, the batch over the other axes that divide it, heads over ``tensor`` where it
divides the key/value heads, everything else replicated. A call that cannot take this
path runs as before, partitioned by XLA.

Guide: docs/guides/context_parallel.md, section "In the layers".
Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from attnjax._src import sharding

CONTEXT_AXIS = "context"
# Arguments that are never token arrays (their arrays are replicated, their modifiers wrapped).
_MODIFIER_ARGS = ("score_mod_args", "mask_mod_args")


def context_size() -> int:
  """Size of the ambient mesh's ``context`` axis outside any ``shard_map`` (1 = none)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
    return 1
  kind = dict(zip(mesh.axis_names, mesh.axis_types))[CONTEXT_AXIS]
  if kind == jax.sharding.AxisType.Manual:  # already inside a shard_map over it
    return 1
  return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[CONTEXT_AXIS])


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> frozenset:
  try:
    return frozenset(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return frozenset()


def takes_context(fn: Callable) -> bool:
  """Whether ``fn`` (or the function a ``functools.partial`` wraps) takes ``context_axis``."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  return "context_axis" in _parameters(fn)


def _offset_score(z, b, n, i, j, first, *args, user):
  return user(z, b + first[0], n + first[1], i, j, *args)


def _offset_mask(b, n, i, j, first, *args, user):
  return user(b + first[0], n + first[1], i, j, *args)


def sharded(fn: Callable) -> Callable:
  """``fn`` whose calls ``(q, k, v, *args, **kwargs)`` go through ``run``."""

  @functools.wraps(fn)
  def call(q, k, v, *args, **kwargs):
    return run(fn, q, k, v, args, kwargs)

  return call


def run(
  fn: Callable,
  q,
  k,
  v,
  args: tuple = (),
  kwargs: Optional[dict] = None,
  *,
  strategy: Optional[str] = None,
):
  """``fn(q, k, v, *args, **kwargs)``, on the sequence-sharded path when it applies.

  Args:
    fn: a family function (or a ``functools.partial`` of one).
    q, k, v: ``[B, T, N|K, H]`` projections of the whole call.
    args: further positional arrays (the delta rule's ``beta`` ``[B, T, N]``).
    kwargs: keyword arguments; ``mask`` must be None for the sharded path.
    strategy: ``context_strategy`` for functions that take one (None: the op chooses,
      :func:`attnjax._src.parallel.strategies.choose_strategy`).

  Returns:
    What ``fn`` returns (``out``, ``(out, stats)``, ...) for the whole call.
  """
  kwargs = dict(kwargs or {})
  size = context_size()
  base, bound = fn, {}
  while isinstance(base, functools.partial) and not base.args:
    base, bound = base.func, {**base.keywords, **bound}
  full = {**bound, **kwargs}
  if (
    size == 1
    or isinstance(base, functools.partial)
    or not takes_context(base)
    or full.get("mask") is not None
    or full.get("bias") is not None
    or k.shape[1] != q.shape[1]
    or q.shape[1] % size
    or full.get("block_layout") is not None
    or full.get("context_axis") is not None
  ):
    return fn(q, k, v, *args, **kwargs)
  fn, kwargs = base, full
  mesh = jax.sharding.get_abstract_mesh()
  B, T, N = q.shape[:3]
  K = k.shape[2]
  batch_axes, head_axes = sharding.kernel_axes(mesh, B, K)
  b, h = _axes(batch_axes), _axes(head_axes)
  spec = functools.partial(_in_spec, dims=(B, T, N, K), b=b, h=h)

  static, arg_names, mods, mod_args = _split_keywords(kwargs)
  leaves = (
    [q, k, v]
    + list(args)
    + [kwargs[n] for n in arg_names]
    + [mod_args["score_mod"], mod_args["mask_mod"]]
  )
  in_specs = (
    [spec(q), spec(k), spec(v)]
    + [spec(a) for a in args]
    + [jax.tree.map(spec, kwargs[n]) for n in arg_names]
    + [
      jax.tree.map(lambda _: P(), mod_args["score_mod"]),
      jax.tree.map(lambda _: P(), mod_args["mask_mod"]),
    ]
  )
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    leaves = [jax.tree.map(jax.sharding.reshard, x, s) for x, s in zip(leaves, in_specs)]
  if "context_strategy" in _parameters(fn):
    static["context_strategy"] = strategy
  local = functools.partial(
    _local, fn=fn, static=static, arg_names=arg_names, mods=mods, num_args=len(args), b=b, h=h
  )
  whole = jax.eval_shape(lambda: fn(q, k, v, *args, **kwargs))
  out_specs = jax.tree.map(functools.partial(_out_spec, dims=(B, T, N, K), b=b, h=h), whole)
  return jax.shard_map(
    local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False
  )(*leaves)


def _token_spec(shape: tuple, dims: tuple, b, h) -> P:
  """A ``[B, T, N|K|other, ...]`` array: batch over ``b``, tokens over the context axis, heads
  over ``h``."""
  _, _, N, K = dims
  heads = h if len(shape) >= 3 and shape[2] in (N, K) else None
  return P(b, CONTEXT_AXIS, *((heads,) if len(shape) >= 3 else ()), *([None] * (len(shape) - 3)))


def _in_spec(x, *, dims: tuple, b, h):
  """The shard_map input spec of one argument leaf (None for a non-array)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    return None
  B, T, N, _ = dims
  shape = tuple(x.shape)
  if len(shape) >= 2 and shape[:2] == (B, T):
    return _token_spec(shape, dims, b, h)
  if shape in ((N,), (1, N, 1, 1)):  # per-head vectors: sink logits, fixed decays
    return P(h) if len(shape) == 1 else P(None, h, None, None)
  return P()


def _out_spec(x, *, dims: tuple, b, h):
  """The shard_map output spec of one leaf of the whole call's output shapes."""
  B, T, N, K = dims
  shape = tuple(x.shape)
  if len(shape) >= 2 and shape[:2] == (B, T):  # outputs [B, T, N, Hv]
    return _token_spec(shape, dims, b, h)
  if len(shape) >= 2 and shape[0] == B and shape[1] in (N, K):
    # statistics [B, N] (of the whole sequence, on every shard), [B, N, T] (rows), states
    # [B, N, H, Hv] (the whole sequence's, on every shard)
    rows = CONTEXT_AXIS if len(shape) == 3 and shape[2] == T else None
    return P(b, h, *((rows,) if len(shape) >= 3 else ()), *([None] * (len(shape) - 3)))
  return P()


def _split_keywords(kwargs: dict):
  """``(static, arg_names, mods, mod_args)``: the keywords passed through unchanged, the names
  of the array keywords (sharded), the modifiers and their argument tables (replicated)."""
  static = {}
  for n in sorted(kwargs):
    value = kwargs[n]
    if n in _MODIFIER_ARGS or callable(value) or value is None or not _is_arrays(value):
      static[n] = value
  arg_names = [n for n in sorted(kwargs) if n not in static]
  mods = {n: kwargs.get(n) for n in ("score_mod", "mask_mod")}
  mod_args = {n: tuple(kwargs.get(n + "_args") or ()) for n in ("score_mod", "mask_mod")}
  for n in ("score_mod", "mask_mod"):
    static.pop(n, None)
    static.pop(n + "_args", None)
  return static, arg_names, mods, mod_args


def _local(q_, k_, v_, *rest, fn, static, arg_names, mods, num_args: int, b, h):
  """One device's call: ``fn`` on its shards, its modifiers given the shard's first batch row
  and query head (``first``) so that they see the whole call's indices."""
  pos = rest[:num_args]
  named = dict(zip(arg_names, rest[num_args : num_args + len(arg_names)]))
  score_args, mask_args = rest[num_args + len(arg_names) :]
  extra = dict(static, **named)
  first = jnp.stack(
    [
      jax.lax.axis_index(b) * q_.shape[0] if b is not None else jnp.int32(0),
      jax.lax.axis_index(h) * q_.shape[2] if h is not None else jnp.int32(0),
    ]
  ).astype(jnp.int32)
  if mods["score_mod"] is not None:
    extra["score_mod"] = functools.partial(_offset_score, user=mods["score_mod"])
    extra["score_mod_args"] = (first,) + tuple(score_args)
  if mods["mask_mod"] is not None:
    extra["mask_mod"] = functools.partial(_offset_mask, user=mods["mask_mod"])
    extra["mask_mod_args"] = (first,) + tuple(mask_args)
  return fn(q_, k_, v_, *pos, context_axis=CONTEXT_AXIS, **extra)


def _is_arrays(value: Any) -> bool:
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)


def _axes(names):
  if not names:
    return None
  return names[0] if len(names) == 1 else tuple(names)
