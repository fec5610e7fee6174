"""Validators: the argument checks shared by every attention family, kernel and layer.

All checks run at trace time on static shapes, so under ``jax.jit`` a bad call
fails before anything is compiled, with a message naming the argument and the
shapes seen. One validator per kind of argument: :func:`check_positive_int` for every
size and count, :func:`check_mesh_axis` for every ``context_axis``.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shape_of(x: Any) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
  if value not in choices:
    valid = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{name}={value!r} is not one of: {valid}")


def check_implementation(
  name: str,
  value: Optional[str],
  allowed: Sequence[str],
  *,
  deprecated: Optional[Mapping[str, str]] = None,
) -> Optional[str]:
  """Validates an ``implementation`` choice and returns its current name.

  ``None`` (auto) passes through. A name in ``deprecated`` (``{old: new}``) still
  works: it emits a ``DeprecationWarning`` naming the replacement and returns
  ``new``. Called from inside a jitted function, the warning is raised while
  the function is traced, i.e. on the first call with that (static) choice.

  Args:
    name: the argument's name, for messages (``"implementation"``).
    value: the value passed.
    allowed: the current names, the readable ``"reference"`` among them.
    deprecated: old names mapped to the current name they stand for.

  Returns:
    ``value`` itself, its replacement when it is a deprecated name, or None.

  Raises:
    ValueError: ``value`` is neither None, an allowed name nor a deprecated one;
      the message lists the allowed names.
  """
  deprecated = deprecated or {}
  if value is not None and not isinstance(value, str):
    raise TypeError(f"{name} must be a str or None, got {type(value).__name__} {value!r}")
  if value in deprecated:
    new = deprecated[value]
    warnings.warn(
      f"{name}={value!r} is deprecated; use {name}={new!r} (the same computation)",
      DeprecationWarning,
      stacklevel=3,
    )
    return new
  check_choice(name, value, (None, *allowed))
  return value


def check_floating(name: str, x: Any) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")


def check_initial_state(initial_state: Any, shape: tuple[int, ...]) -> Any:
  """A recurrent ``initial_state`` of exactly ``shape`` (``[B, N, H, Hv]``) as float32, or None."""
  if initial_state is None:
    return None
  check_floating("initial_state", initial_state)
  if shape_of(initial_state) != tuple(shape):
    raise ValueError(
      f"initial_state must have shape [B, N, H, Hv] = {tuple(shape)}, got {shape_of(initial_state)}"
    )
  return jnp.asarray(initial_state, jnp.float32)


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int, int]:
  """Checks q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]; returns (B, T, S, N, K, H, Hv)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.ndim(x) != 4:
      letters = "[B, T, N, H]" if name == "q" else "[B, S, K, H]"
      raise ValueError(f"{name} must have rank 4 {letters}, got shape {shape_of(x)}")
    check_floating(name, x)
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  B, T, N, H = q.shape
  Bk, S, K, Hk = k.shape
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k and v must agree on [B, S, K], got k {shape_of(k)} and v {shape_of(v)}")
  if Bk != B:
    raise ValueError(f"q and k batch sizes differ: q {shape_of(q)}, k {shape_of(k)}")
  if Hk != H:
    raise ValueError(f"q and k head dims differ: q {shape_of(q)}, k {shape_of(k)}")
  if H == 0 or v.shape[3] == 0:
    raise ValueError(
      f"head dims must be positive (H of q and k, Hv of v), got q {shape_of(q)}, "
      f"k {shape_of(k)}, v {shape_of(v)}"
    )
  if K == 0 or N % K != 0:
    raise ValueError(
      f"query heads N={N} must be a multiple of key/value heads K={K} "
      f"(q {shape_of(q)}, k {shape_of(k)})"
    )
  return B, T, S, N, K, H, v.shape[3]


def broadcastable_to(name: str, x: Any, target: tuple[int, ...]) -> None:
  shape = shape_of(x)
  if len(shape) > len(target) or any(d != 1 and d != t for d, t in zip(shape[::-1], target[::-1])):
    raise ValueError(f"{name} of shape {shape} is not broadcastable to [B, N, T, S] = {target}")


def as_rank4(name: str, x: Any, target: tuple[int, int, int, int], *, kind: str):
  """Validates a mask or bias and returns it as a rank-4 array (leading 1s)."""
  x = jnp.asarray(x)
  if kind == "mask" and x.dtype != jnp.bool_:
    raise TypeError(f"{name} must be boolean (True = may attend), got dtype {x.dtype}")
  if kind == "bias":
    check_floating(name, x)
  broadcastable_to(name, x, target)
  return jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_window(window: Any, name: str = "window") -> tuple[int, int] | None:
  """A local window as ``(left, right)``: query ``i`` keeps keys ``i - left .. i + right``.

  The one window convention of every family, layer and pattern: a pair
  ``(left, right)``, or an int ``w`` meaning ``(w, 0)``, i.e. keys ``i - w ..
  i`` (``w + 1`` keys, the query's own included). None passes through.
  """
  if window is None:
    return None
  pair = (window, 0) if _is_int(window) else window
  if not isinstance(pair, tuple) or len(pair) != 2 or not all(map(_is_int, pair)):
    raise TypeError(
      f"{name} must be an int w (keys i - w .. i) or a tuple (left, right) of ints, got {window!r}"
    )
  left, right = int(pair[0]), int(pair[1])
  if left < 0 or right < 0:
    raise ValueError(
      f"{name} must be non-negative (an int w >= 0 or (left, right) with both "
      f">= 0), got {name}={window!r}"
    )
  return left, right


def check_segment_ids(segment_ids: Any, B: int, T: int, S: int):
  """Returns (q_segment_ids [B, T], kv_segment_ids [B, S]) or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(
        f"segment_ids must be an array [B, T] or a pair (q [B, T], kv [B, S]), "
        f"got a sequence of length {len(segment_ids)}"
      )
    q_seg, kv_seg = segment_ids
  else:
    if T != S:
      raise ValueError(
        f"a single segment_ids array needs T == S (got T={T}, S={S}); "
        f"pass a pair (q_segment_ids [B, T], kv_segment_ids [B, S])"
      )
    q_seg = kv_seg = segment_ids
  for name, seg, L in (("q segment_ids", q_seg, T), ("kv segment_ids", kv_seg, S)):
    if shape_of(seg) != (B, L):
      raise ValueError(f"{name} must have shape {(B, L)}, got {shape_of(seg)}")
    if not jnp.issubdtype(jnp.result_type(seg), jnp.integer):
      raise TypeError(f"{name} must be integer, got dtype {jnp.result_type(seg)}")
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)


def check_one_sequence(name: str, q, k, v, segment_ids: Any):
  """Checks a causal stateful call over one sequence (keys are the queries' tokens).

  Returns ``(B, T, N, K, H, Hv, segment_ids [B, T] or None)``; used by
  :mod:`attnjax.gated_linear` and :mod:`attnjax.delta_rule`.
  """
  B, T, S, N, K, H, Hv = check_qkv(q, k, v)
  if S != T:
    raise ValueError(
      f"{name} is causal over one sequence and needs as many keys as queries "
      f"(S == T), got q {shape_of(q)} and k {shape_of(k)}"
    )
  if isinstance(segment_ids, (tuple, list)):
    raise TypeError(
      "segment_ids must be one integer array [B, T] (queries and keys are the "
      f"same tokens), got a {type(segment_ids).__name__}"
    )
  seg, _ = check_segment_ids(segment_ids, B, T, T)
  return B, T, N, K, H, Hv, seg


def check_positive_int(
  name: str, value: Any, *, allow_none: bool = False, minimum: int = 1, where: str = ""
) -> Optional[int]:
  """``value`` as a Python int of at least ``minimum`` (a positive int by default).

  Python and numpy integers pass (returned as ``int``); a bool does not.

  Args:
    name: the argument's name, for messages.
    value: the value given.
    allow_none: None passes through.
    minimum: the smallest valid value.
    where: a prefix of the messages (the function or record the argument belongs to).

  Raises:
    TypeError: not an int (or None with ``allow_none``).
    ValueError: an int below ``minimum``.
  """
  if value is None and allow_none:
    return None
  prefix = f"{where}: " if where else ""
  kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(
      f"{prefix}{name} must be {kind}{' or None' if allow_none else ''}, got {name}={value!r} "
      f"({type(value).__name__})"
    )
  if value < minimum:
    raise ValueError(f"{prefix}{name} must be {kind}, got {name}={value!r}")
  return int(value)


def check_mesh_axis(name: str, axis: Any, function: str) -> Optional[str]:
  """``axis`` as a mesh axis of the enclosing ``jax.shard_map`` (a str), or None.

  Args:
    name: the argument's name (``"context_axis"``).
    axis: the value given.
    function: the public function called, for the message.

  Raises:
    TypeError: not a str or None.
    ValueError: not an axis of the enclosing ``shard_map``.
  """
  if axis is None:
    return None
  if not isinstance(axis, str):
    raise TypeError(f"{name} must be a shard_map mesh axis name (a str) or None, got {axis!r}")
  try:
    jax.lax.axis_size(axis)
  except NameError as e:
    raise ValueError(
      f"{name}={axis!r} is not a mesh axis of the enclosing jax.shard_map (call {function} "
      f"inside shard_map over that axis)"
    ) from e
  return axis


def check_positive_float(name: str, x: Any, *, allow_none: bool = True) -> float | None:
  if x is None and allow_none:
    return None
  if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float (static), got {type(x).__name__}")
  if not np.isfinite(x) or x <= 0:
    raise ValueError(f"{name} must be positive and finite, got {x!r}")
  return float(x)


def check_per_head(name: str, x: Any, N: int):
  """A learned per-head quantity: shape [N] (or scalar)."""
  check_floating(name, x)
  shape = shape_of(x)
  if shape not in ((), (N,)):
    raise ValueError(f"{name} must have shape [N] = ({N},) or be a scalar, got {shape}")
  return jnp.broadcast_to(jnp.asarray(x), (N,))
