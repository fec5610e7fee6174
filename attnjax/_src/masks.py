"""Boolean attention masks: True = the query may attend to the key.

Implementation behind the public module :mod:`attnjax.masks`.
"""

from __future__ import annotations

from typing import Optional, Union

import jax.numpy as jnp

from attnjax._src import validators

Array = jnp.ndarray


def structural_mask(
  q_positions: Array,
  k_positions: Array,
  *,
  is_causal: bool = False,
  window: Optional[tuple[int, int]] = None,
  q_segment_ids: Optional[Array] = None,
  kv_segment_ids: Optional[Array] = None,
) -> Optional[Array]:
  """The single mask rule: returns ``[B or 1, 1, Tq, Sk]`` booleans, or None.

  Args:
    q_positions: ``[Tq]`` integer positions of the queries.
    k_positions: ``[Sk]`` integer positions of the keys.
    is_causal: keys after the query are masked.
    window: ``(left, right)`` local window, or None.
    q_segment_ids: ``[B, Tq]`` segment ids of the queries (the same slice as
      ``q_positions``), or None.
    kv_segment_ids: ``[B, Sk]`` segment ids of the keys, or None.

  Returns:
    None when nothing is masked, else a rank-4 boolean array.
  """
  qp = q_positions[:, None]
  kp = k_positions[None, :]
  out = kp <= qp if is_causal else None
  if window is not None:
    left, right = window
    local = jnp.logical_and(kp >= qp - left, kp <= qp + right)
    out = local if out is None else jnp.logical_and(out, local)
  if out is not None:
    out = out[None, None]
  if q_segment_ids is not None:
    seg = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    out = seg if out is None else jnp.logical_and(out, seg)
  return out


def causal_mask(T: int, S: int, *, offset: int = 0) -> Array:
  """The causal mask: query ``i`` (at position ``i + offset``) sees keys ``j <= i + offset``.

  Args:
    T: query length.
    S: key length.
    offset: position of query 0 (``S - T`` for ``T`` new queries after ``S - T``
      cached keys).

  Returns:
    Boolean ``[1, 1, T, S]``.
  """
  return structural_mask(jnp.arange(T) + offset, jnp.arange(S), is_causal=True)


def window_mask(T: int, S: int, left: int, right: int = 0, *, offset: int = 0) -> Array:
  """A local window: query ``i``, at ``p = i + offset``, sees keys ``p - left <= j <= p + right``.

  Args:
    T: query length.
    S: key length.
    left: keys allowed before the query's position.
    right: keys allowed after it.
    offset: position of query 0.

  Returns:
    Boolean ``[1, 1, T, S]``.

  Raises:
    ValueError: a negative ``left`` or ``right``.
  """
  window = validators.check_window((left, right))
  return structural_mask(jnp.arange(T) + offset, jnp.arange(S), window=window)


def segment_mask(q_segment_ids: Array, kv_segment_ids: Optional[Array] = None) -> Array:
  """Packed sequences: queries attend only to keys of the same segment.

  Args:
    q_segment_ids: integer ``[B, T]``.
    kv_segment_ids: integer ``[B, S]``, or None for ``q_segment_ids`` (self-attention).

  Returns:
    Boolean ``[B, 1, T, S]``, True where the ids are equal.

  Raises:
    ValueError: ids that are not ``[B, T]`` and ``[B, S]`` with one ``B``.
  """
  q_segment_ids = jnp.asarray(q_segment_ids)
  kv_segment_ids = q_segment_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
  if (
    q_segment_ids.ndim != 2
    or kv_segment_ids.ndim != 2
    or (q_segment_ids.shape[0] != kv_segment_ids.shape[0])
  ):
    raise ValueError(
      f"segment ids must be [B, T] and [B, S] with equal B, got "
      f"{q_segment_ids.shape} and {kv_segment_ids.shape}"
    )
  T, S = q_segment_ids.shape[1], kv_segment_ids.shape[1]
  return structural_mask(
    jnp.arange(T), jnp.arange(S), q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids
  )


def padding_mask(q_lengths: Optional[Array], kv_lengths: Optional[Array], T: int, S: int) -> Array:
  """Padding: only the first ``q_lengths[b]`` queries and ``kv_lengths[b]`` keys are valid.

  Padded queries get rows with no allowed key; attention returns zeros there.

  Args:
    q_lengths: integer ``[B]`` valid queries per sequence, or None (all valid).
    kv_lengths: integer ``[B]`` valid keys per sequence, or None (all valid).
    T: query length.
    S: key length.

  Returns:
    Boolean ``[B, 1, T, S]``.

  Raises:
    ValueError: both lengths None, or lengths that are not ``[B]``.
  """
  if q_lengths is None and kv_lengths is None:
    raise ValueError("padding_mask needs q_lengths or kv_lengths")
  lengths = [x for x in (q_lengths, kv_lengths) if x is not None]
  for x in lengths:
    if jnp.ndim(x) != 1:
      raise ValueError(f"lengths must be [B], got shape {jnp.shape(x)}")
  B = jnp.shape(lengths[0])[0]
  q_ok = (
    jnp.ones((B, T), bool)
    if q_lengths is None
    else jnp.arange(T)[None, :] < jnp.asarray(q_lengths)[:, None]
  )
  kv_ok = (
    jnp.ones((B, S), bool)
    if kv_lengths is None
    else jnp.arange(S)[None, :] < jnp.asarray(kv_lengths)[:, None]
  )
  return jnp.logical_and(q_ok[:, None, :, None], kv_ok[:, None, None, :])


def combine_masks(*masks: Optional[Array]) -> Optional[Array]:
  """Logical AND of masks; None entries are ignored.

  Args:
    *masks: boolean arrays of rank <= 4 (leading axes are added up to rank 4), each
      broadcastable to ``[B, N, T, S]``, or None.

  Returns:
    The boolean intersection, rank 4, or None when every mask is None.

  Raises:
    TypeError: a mask that is not boolean.
    ValueError: a mask of rank above 4.
  """
  out = None
  for m in masks:
    if m is None:
      continue
    m = jnp.asarray(m)
    if m.dtype != jnp.bool_:
      raise TypeError(f"masks must be boolean, got dtype {m.dtype}")
    if m.ndim > 4:
      raise ValueError(f"masks must have rank <= 4, got shape {m.shape}")
    m = jnp.reshape(m, (1,) * (4 - m.ndim) + m.shape)
    out = m if out is None else jnp.logical_and(out, m)
  return out


def make_attention_mask(
  T: int,
  S: int,
  *,
  mask: Optional[Array] = None,
  is_causal: bool = False,
  window: Union[int, tuple[int, int], None] = None,
  q_segment_ids: Optional[Array] = None,
  kv_segment_ids: Optional[Array] = None,
) -> Optional[Array]:
  """The full mask an attention call uses: the explicit mask AND the structure.

  Args:
    T: query length.
    S: key length.
    mask: a boolean mask broadcastable to ``[B, N, T, S]``, or None.
    is_causal: keys after the query are masked.
    window: ``(left, right)``, an int ``w`` meaning ``(w, 0)``, or None.
    q_segment_ids: integer ``[B, T]``, or None.
    kv_segment_ids: integer ``[B, S]``, or None.

  Returns:
    Boolean rank 4, broadcastable to ``[B, N, T, S]``, or None when nothing is masked.

  Raises:
    ValueError: an invalid window.
    TypeError: a mask that is not boolean.
  """
  structure = structural_mask(
    jnp.arange(T),
    jnp.arange(S),
    is_causal=is_causal,
    window=None if window is None else validators.check_window(window),
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
  )
  # The structure is rank 4 and boolean already: only a mask array needs combine_masks.
  return structure if mask is None else combine_masks(mask, structure)


def segment_resets(segment_ids: Optional[Array], batch: int, length: int) -> Array:
  """Where a recurrent state restarts: the segment id differs from the previous token's.

  Position 0 never resets (an ``initial_state`` continues into it).

  Args:
    segment_ids: integer ``[B, T]``, or None (no resets).
    batch: ``B``.
    length: ``T``.

  Returns:
    Boolean ``[B, T]``.
  """
  if segment_ids is None:
    return jnp.zeros((batch, length), bool)
  return jnp.concatenate(
    [jnp.zeros((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
  )
