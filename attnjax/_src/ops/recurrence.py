"""What the recurrent families share: one vocabulary of engines and one input preparation.

The linear, gated and delta-rule families each declare an op whose engines have the same
names and meaning (:data:`ENGINE_NAMES`): ``"recurrent"`` (a scan over time),
``"quadratic"`` (formerly ``"parallel"``; the masked quadratic product), ``"chunked"`` (the
default) and ``"reference"`` (one of the three, the family's ``REFERENCE_ENGINE``).
:func:`engines` builds a state-passing family's engines from its three computations;
:func:`prepare` validates a causal stateful call; :func:`state_passing_op` registers the op,
with its empty answer and its context-parallel strategy (:func:`context`, state passing).
Family level: kernels must not import it.
Guides: docs/guides/linear.md ("Engines") and docs/guides/architecture.md.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from attnjax._src import empty, masks, op, validators
from attnjax._src.logits import group_queries
from attnjax._src.parallel.recurrent import state_passing

Array = jnp.ndarray

# The engines of every recurrent family besides "reference" (which names one of them).
ENGINE_NAMES: tuple[str, ...] = ("recurrent", "quadratic", "chunked")
# Old names of engines, still accepted with a warning: {old: new}.
RENAMED: dict[str, str] = {"parallel": "quadratic"}
DEFAULT_CHUNK_SIZE = 64


def with_reference(engines: dict[str, op.Engine], reference: str) -> dict[str, op.Engine]:
  """A recurrent op's engines: ``"reference"`` (the engine named ``reference``, under that
  name), then each of :data:`ENGINE_NAMES` (``engines`` holds one per name)."""
  assert set(engines) == set(ENGINE_NAMES), sorted(engines)
  ref = engines[reference]
  return {
    "reference": op.Engine("reference", ref.compute, ref.unsupported),
    **{name: engines[name] for name in ENGINE_NAMES},
  }


class Inputs(NamedTuple):
  """A causal stateful call's inputs in the layout every engine takes (all float32).

  Attributes:
    q: ``[B, T, K, G, H]`` queries grouped by key/value head, times ``scale`` (``G = 1``
      where the query of a key head is shared by its value heads).
    k: ``[B, T, K, H]`` keys.
    v: ``[B, T, K, Hv]`` values (``[B, T, K G, Hv]``, one per state, with grouped values).
    reset: ``[B, T]`` bool, True where a new segment starts (never at ``t = 0``).
    state: ``[B, K, G, H, Hv]`` the state before the first token (zeros if none given): its
      ``G`` is the call's heads per key head.
    implementation: the engine the call names, or None: auto.
    segment_ids: the call's ``[B, T]`` ids, or None (state passing compares them across
      shards: a reset at a shard's first token is not in ``reset``).
    context_axis: the ``shard_map`` axis the sequence is sharded over, or None.
  """

  q: Array
  k: Array
  v: Array
  reset: Array
  state: Array
  implementation: Optional[str]
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
  family: op.Op,
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
    implementation: a name of the op's engines (or of :data:`RENAMED`) or None.
    chunk_size: a positive int.
    family: the family's op (its engines are the valid names).
    context_axis: None, or the ``shard_map`` axis the sequence is sharded over (the op's
      context strategy, :func:`context`, then runs the call).
    grouped_values: ``v`` may have more heads ``M`` than ``k`` (``M % K == 0``, Qwen3-Next's
      value-head grouping): ``q`` then has ``K`` or ``M`` heads and the call ``max(N, M)``
      heads, each value head ``m`` reading key head ``m // (M // K)``. ``Inputs.v`` keeps
      its ``M`` heads and ``Inputs.q`` its ``N // K`` per key head (1: shared).
  """
  value_heads = _value_heads(name, q, k, v) if grouped_values else None
  checked_v = v if value_heads is None else v[:, :, : k.shape[2]]
  B, T, N, K, H, Hv, seg = validators.check_one_sequence(name, q, k, checked_v, segment_ids)
  heads = N if value_heads is None else max(N, value_heads)
  implementation = op.check_implementation(family, implementation, where=name)
  validators.check_positive_int("chunk_size", chunk_size)
  if not isinstance(return_state, bool):
    raise TypeError(f"return_state must be a bool, got {return_state!r}")
  scale = validators.check_positive_float("scale", scale)
  scale = H**-0.5 if scale is None else scale
  state = validators.check_initial_state(initial_state, (B, heads, H, Hv))
  if state is None:
    state = jnp.zeros((B, heads, H, Hv), jnp.float32)
  f32 = jnp.float32
  return Inputs(
    q=group_queries(q.astype(f32) * scale, K),
    k=k.astype(f32),
    v=v.astype(f32),
    reset=masks.segment_resets(seg, B, T),
    state=jnp.reshape(state, (B, K, heads // K, H, Hv)),
    implementation=implementation,
    segment_ids=segment_ids,
    context_axis=validators.check_mesh_axis("context_axis", context_axis, name),
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
      f"heads in groups: Hv % Hk == 0), got q {validators.shape_of(q)}, "
      f"k {validators.shape_of(k)}, v {validators.shape_of(v)}"
    )
  if N not in (K, M):
    raise ValueError(
      f"{name}: with {M} value heads over {K} key heads, q must have the key heads ({K}) "
      f"or the value heads ({M}), got q {validators.shape_of(q)}"
    )
  return M


def context(call: tuple, implementation: Optional[str], local: Callable[..., Any]):
  """A state-passing op's context strategy (:func:`attnjax._src.parallel.recurrent.state_passing`):
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
  heads = final.shape[1] * final.shape[2]  # K G (no -1: T may be 0)
  out = jnp.reshape(out, (B, T, heads, out.shape[-1])).astype(q.dtype)
  if return_state:
    return out, jnp.reshape(final, (B, heads) + final.shape[3:])
  return out


def engines(
  *,
  recurrent: Callable[..., Any],
  quadratic: Callable[..., Any],
  chunked: Callable[..., Any],
  reference: str,
) -> dict[str, op.Engine]:
  """A state-passing family's engines (gated linear, delta rule), by name.

  Each computation takes ``(q, k, v, *extra, reset, state)`` (``chunked`` also
  ``chunk_size=``) and returns ``(out [B, T, K, G, Hv], final state)``; the engines take the
  op's call ``(x: Inputs, extra, chunk_size)``, ``extra`` the family's per-step arrays in
  the order its computations take them after ``v``. ``reference`` names the one that is the
  family's readable definition.
  """

  def engine(name: str, fn: Callable[..., Any], takes_chunks: bool = False) -> op.Engine:
    def compute(x: Inputs, extra: tuple, chunk_size: int):
      args = (x.q, x.k, x.v, *extra, x.reset, x.state)
      return fn(*args, chunk_size=chunk_size) if takes_chunks else fn(*args)

    return op.Engine(name, compute, op.supports_everything)

  return with_reference(
    {
      "recurrent": engine("recurrent", recurrent),
      "quadratic": engine("quadratic", quadratic),
      "chunked": engine("chunked", chunked, takes_chunks=True),
    },
    reference,
  )


# Auto-dispatch of a state-passing family: the chunked engine on every platform.
PREFERENCES: dict[str, tuple[str, ...]] = {}
FALLBACK: tuple[str, ...] = ("chunked",)


def state_passing_op(name: str, engines, preferences, fallback, samples) -> op.Op:
  """The registered op of a state-passing family: a call over no steps leaves the state as
  it was (:func:`attnjax._src.empty.no_steps`); a call whose ``x.context_axis`` is set runs
  :func:`context`; old engine names are :data:`RENAMED`."""
  return op.register(
    op.Op(
      name,
      engines,
      preferences,
      fallback,
      empty=lambda x, *_: empty.no_steps(x.v, x.state),
      is_empty=lambda x, *_: x.q.shape[1] == 0,
      context=context,
      context_axis=lambda x, *_: x.context_axis,
      renamed=RENAMED,
      samples=samples,
    )
  )


def per_step(q, seed: int) -> np.ndarray:
  """A deterministic float32 ``[B, T, N]`` draw from the shape of ``q`` (a sample's gates)."""
  rng = np.random.default_rng([seed, *q.shape[:3]])
  return rng.standard_normal(q.shape[:3]).astype(np.float32)


def state_passing_sample(function: Callable[..., Any], arrays: Callable[..., Any]) -> op.Sample:
  """A state-passing family's sample call (:class:`attnjax._src.op.Sample`): ``function`` with
  the further arrays ``arrays(q, k, v)`` draws; the options both families take alike."""
  return op.Sample(
    function,
    options=dict(chunk_size=8),
    arrays=arrays,
    self_only=True,
    state=True,
    flags=("return_state",),
    static=(("scale", 0.5), ("chunk_size", 2)),
    choices=(("chunk_size", (1, 2, 3, 64)), ("scale", (0.25, 1.0))),
    defects=(("chunk_size", (0, -3)), ("scale", (-1.0, [0.5]))),
    context=True,
  )
