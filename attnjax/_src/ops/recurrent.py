"""What the recurrent families share: one vocabulary of forms (their ops' engines) and one
input preparation.

The linear, gated and delta-rule families each declare an op whose engines are the same
forms, with the same names and meaning: ``"recurrent"``, ``"quadratic"`` (formerly
``"parallel"``), ``"chunked"`` (the default) and ``"reference"`` (one of the three, the
family's ``REFERENCE_FORM``). :func:`prepare` validates a causal stateful call;
:func:`state_op` makes the ops, with :func:`context` (state passing) as their
context-parallel strategy; :func:`check_chunk_size` and :func:`check_context_axis` are
shared checks. Family level: kernels must not import it.
Guides: docs/guides/linear.md ("Forms") and docs/guides/architecture.md.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple, Optional, get_args

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import checks as _checks, empty as _empty, op as _op, masks
from attnjax._src.logits import group_queries
from attnjax._src.parallel.recurrent import state_passing

Array = jnp.ndarray

ImplementationName = Literal["reference", "recurrent", "quadratic", "chunked"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(ImplementationName)
# The forms a name resolves to ("reference" is one of them, per family).
FORMS: tuple[str, ...] = ("recurrent", "quadratic", "chunked")
# Old names of forms, still accepted with a warning: {old: new}.
RENAMED: dict[str, str] = {"parallel": "quadratic"}
DEFAULT_CHUNK_SIZE = 64


def engines(forms: dict[str, _op.Engine], reference: str) -> dict[str, _op.Engine]:
  """A recurrent op's engines: ``"reference"`` (the engine of the ``reference`` form under
  that name), then each of :data:`FORMS` (``forms`` holds one engine per form)."""
  assert set(forms) == set(FORMS), sorted(forms)
  return {
    "reference": _op.Engine("reference", forms[reference].compute, forms[reference].unsupported),
    **{name: forms[name] for name in FORMS},
  }


def check_chunk_size(chunk_size: Any) -> int:
  """``chunk_size`` as a positive int (the chunk length of ``"chunked"``; any ``T`` works)."""
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
    error = TypeError
  elif chunk_size < 1:
    error = ValueError
  else:
    return int(chunk_size)
  raise error(f"chunk_size must be a positive int, got chunk_size={chunk_size!r}")


class Inputs(NamedTuple):
  """A causal stateful call's inputs in the layout every form takes (all float32).

  Attributes:
    q: ``[B, T, K, G, H]`` queries grouped by key/value head, times ``scale`` (``G = 1``
      where the query of a key head is shared by its value heads).
    k: ``[B, T, K, H]`` keys.
    v: ``[B, T, K, Hv]`` values (``[B, T, K G, Hv]``, one per state, with grouped values).
    reset: ``[B, T]`` bool, True where a new segment starts (never at ``t = 0``).
    state: ``[B, K, G, H, Hv]`` the state before the first token (zeros if none given): its
      ``G`` is the call's heads per key head.
    form: the engine the call names (an ``implementation``), or None: auto (``"chunked"``).
    segment_ids: the call's ``[B, T]`` ids, or None (state passing compares them across
      shards: a reset at a shard's first token is not in ``reset``).
    context_axis: the ``shard_map`` axis the sequence is sharded over, or None.
  """

  q: Array
  k: Array
  v: Array
  reset: Array
  state: Array
  form: Optional[str]
  segment_ids: Optional[Array] = None
  context_axis: Optional[str] = None


def prepare(
  name: str,
  q,
  k,
  v,
  *,
  scale,
  initial_state,
  return_state,
  segment_ids,
  implementation,
  chunk_size,
  op: _op.Op,
  context_axis=None,
  grouped_values: bool = False,
) -> Inputs:
  """Validates a causal stateful call over one sequence and returns its :class:`Inputs`.

  Args:
    name: the public function's name, for messages.
    q, k, v: ``[B, T, N, H]``, ``[B, T, K, H]``, ``[B, T, K, Hv]``.
    scale: a static positive float, or None for ``H ** -0.5``.
    initial_state: ``[B, N, H, Hv]`` or None.
    return_state: a bool.
    segment_ids: ``[B, T]`` integers or None.
    implementation: a name of :data:`IMPLEMENTATIONS` (or :data:`RENAMED`) or None.
    chunk_size: a positive int.
    op: the family's op (its engines are the valid names).
    context_axis: None, or the ``shard_map`` axis the sequence is sharded over (the op's
      context strategy, :func:`context`, then runs the call).
    grouped_values: ``v`` may have more heads ``M`` than ``k`` (``M % K == 0``, Qwen3-Next's
      value-head grouping): ``q`` then has ``K`` or ``M`` heads and the call ``max(N, M)``
      heads, each value head ``m`` reading key head ``m // (M // K)``. ``Inputs.v`` keeps
      its ``M`` heads and ``Inputs.q`` its ``N // K`` per key head (1: shared).
  """
  value_heads = _value_heads(name, q, k, v) if grouped_values else None
  checked_v = v if value_heads is None else v[:, :, : k.shape[2]]
  B, T, N, K, H, Hv, seg = _checks.check_one_sequence(name, q, k, checked_v, segment_ids)
  heads = N if value_heads is None else max(N, value_heads)
  form = _op.check_implementation(op, implementation, where=name)
  check_chunk_size(chunk_size)
  if not isinstance(return_state, bool):
    raise TypeError(f"return_state must be a bool, got {return_state!r}")
  scale = _checks.check_positive_float("scale", scale)
  scale = H**-0.5 if scale is None else scale
  state = _checks.check_initial_state(initial_state, (B, heads, H, Hv))
  if state is None:
    state = jnp.zeros((B, heads, H, Hv), jnp.float32)
  f32 = jnp.float32
  return Inputs(
    q=group_queries(q.astype(f32) * scale, K),
    k=k.astype(f32),
    v=v.astype(f32),
    reset=masks.segment_resets(seg, B, T),
    state=jnp.reshape(state, (B, K, heads // K, H, Hv)),
    form=form,
    segment_ids=segment_ids,
    context_axis=check_context_axis(name, context_axis),
  )


def _value_heads(name: str, q, k, v) -> Optional[int]:
  """``M``, the value heads of a call whose ``v`` has more heads than ``k`` (else None),
  checked: ``M % K == 0`` and ``q`` with ``K`` or ``M`` heads."""
  if np.ndim(q) != 4 or np.ndim(k) != 4 or np.ndim(v) != 4:
    return None
  N, K, M = q.shape[2], k.shape[2], v.shape[2]
  if M == K:
    return None
  if M % K:
    raise ValueError(
      f"{name}: v has {M} heads, not a multiple of k's {K} heads (value heads share key "
      f"heads in groups: Hv % Hk == 0), got q {_checks.shape_of(q)}, k {_checks.shape_of(k)}, "
      f"v {_checks.shape_of(v)}"
    )
  if N not in (K, M):
    raise ValueError(
      f"{name}: with {M} value heads over {K} key heads, q must have the key heads ({K}) "
      f"or the value heads ({M}), got q {_checks.shape_of(q)}"
    )
  return M


def check_context_axis(name: str, context_axis: Any) -> Optional[str]:
  """``context_axis`` as a mesh axis of the enclosing ``shard_map`` (a str), or None.

  Raises:
    TypeError: not a str or None.
    ValueError: not an axis of the enclosing ``shard_map``.
  """
  if context_axis is None:
    return None
  if not isinstance(context_axis, str):
    raise TypeError(
      f"context_axis must be a shard_map mesh axis name (a str) or None, got {context_axis!r}"
    )
  try:
    jax.lax.axis_size(context_axis)
  except NameError as e:
    raise ValueError(
      f"context_axis={context_axis!r} is not a mesh axis of the enclosing "
      f"jax.shard_map (call {name} inside shard_map over that axis)"
    ) from e
  return context_axis


def context(call: tuple, implementation: Optional[str], local: Callable[..., Any]):
  """A state-passing op's context strategy (:func:`attnjax.parallel.recurrent.state_passing`):
  this device's ``(out, final state of the whole sequence)`` of a call whose sequence is
  sharded over ``x.context_axis``; ``local`` (the op's per-device computation) runs each of
  its two passes over this device's tokens."""
  x, extra, chunk_size = call
  B, K, G, H, Hv = x.state.shape

  def on_shard(v: Array, state: Array):  # values [B, T, K, W], state [B, N, H, W]
    shard = x._replace(
      v=v, state=jnp.reshape(state, (B, K, G) + state.shape[2:]), context_axis=None
    )
    out, final = local((shard, extra, chunk_size), implementation)
    return out, jnp.reshape(final, (B, K * G) + final.shape[3:])

  out, final = state_passing(
    on_shard,
    x.v,
    num_heads=K * G,
    head_dim=H,
    initial_state=jnp.reshape(x.state, (B, K * G, H, Hv)),
    segment_ids=x.segment_ids,
    return_state=True,
    axis=x.context_axis,
  )
  return out, jnp.reshape(final, (B, K, G, H, Hv))


def by_kv_head(x: Array, num_kv_heads: int) -> Array:
  """A per-query-head input ``[B, T, N, ...]`` as float32 ``[B, T, K, G, ...]``."""
  B, T, N = x.shape[:3]
  return jnp.reshape(x.astype(jnp.float32), (B, T, num_kv_heads, N // num_kv_heads) + x.shape[3:])


def finish(out: Array, final: Array, q: Array, *, return_state: bool):
  """``out [B, T, K, G, Hv]`` as ``[B, T, K G, Hv]`` in ``q``'s dtype, and with ``return_state``
  the final state ``[B, K, G, H, Hv]`` as ``[B, K G, H, Hv]`` (float32)."""
  B, T = q.shape[:2]
  out = jnp.reshape(out, (B, T, -1, out.shape[-1])).astype(q.dtype)
  if return_state:
    return out, jnp.reshape(final, (B, -1) + final.shape[3:])
  return out


def _form_engine(name: str, form: Callable[..., Any], *, chunked: bool = False) -> _op.Engine:
  """The engine of a state-passing ``form(q, k, v, *extra, reset, state)`` (``chunked``: also
  ``chunk_size=``) on the call ``(x: Inputs, extra, chunk_size)``."""

  def compute(x: Inputs, extra: tuple, chunk_size: int):
    args = (x.q, x.k, x.v, *extra, x.reset, x.state)
    return form(*args, chunk_size=chunk_size) if chunked else form(*args)

  return _op.Engine(name, compute, _op.supports_everything)


def state_op(
  name: str,
  *,
  recurrent: Callable[..., Any],
  quadratic: Callable[..., Any],
  chunked: Callable[..., Any],
  reference: str,
) -> _op.Op:
  """The op of a causal state-passing family (gated linear, delta rule), registered.

  Its call is ``(x: Inputs, extra, chunk_size)``, ``extra`` the family's per-step arrays in
  the order its forms take them after ``v``; every engine returns ``(out [B, T, K, G, Hv],
  final state)``. A call over no steps leaves the state as it was (:func:`attnjax._empty.no_steps`);
  a call whose ``x.context_axis`` is set runs :func:`context`.
  """
  forms = {
    "recurrent": _form_engine("recurrent", recurrent),
    "quadratic": _form_engine("quadratic", quadratic),
    "chunked": _form_engine("chunked", chunked, chunked=True),
  }
  return _op.register(
    _op.Op(
      name,
      engines(forms, reference),
      {},
      ("chunked",),
      empty=lambda x, *_: _empty.no_steps(x.v, x.state),
      is_empty=lambda x, *_: x.q.shape[1] == 0,
      context=context,
      context_axis=lambda x, *_: x.context_axis,
      renamed=RENAMED,
    )
  )
