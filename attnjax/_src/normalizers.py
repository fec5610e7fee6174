"""The normalisers: how a row of logits becomes attention weights, defined once each.

Implementation behind the public module :mod:`attnjax.normalizers`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

Array = jnp.ndarray
PV = Callable[[Array], Array]

SOFTPICK_EPS = 1e-6


# ---------------------------------------------------------------------------
# Shared pieces.


def _masked(z: Array, allowed: Optional[Array]) -> Array:
  return z if allowed is None else jnp.where(allowed, z, -jnp.inf)


def _finite(x: Array) -> Array:
  return jnp.where(jnp.isfinite(x), x, 0.0)


def _one_minus_exp_neg(x: Array) -> Array:
  """``1 - e^-x`` for ``x >= 0`` (``+inf`` included) to a few ulp, also near 0 where the
  plain difference cancels (Kahan's ``expm1`` identity ``(u - 1) x / log u``, ``u = e^-x``:
  exp and log only, which every kernel backend lowers; Mosaic has no ``expm1``)."""
  u = jnp.exp(-x)
  ratio = x / jnp.maximum(-jnp.log(u), jnp.finfo(jnp.float32).tiny)
  return jnp.where(u == 1.0, x, jnp.where(u == 0.0, 1.0, (1.0 - u) * ratio))


def _plogp(w: Array) -> Array:
  return jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0)


def _shift(z_masked: Array, floor: Optional[Array] = None) -> Array:
  """Row maximum used as an exp shift; finite, and with no gradient."""
  m = jnp.max(z_masked, axis=-1, keepdims=True)
  if floor is not None:
    m = jnp.maximum(m, floor)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return jax.lax.stop_gradient(m)


def _online_shift(m: Array, floor: Optional[Array]) -> Array:
  """The running exp shift of the online state: ``max(m, floor)``, finite."""
  return _finite(m if floor is None else jnp.maximum(m, floor))


def _softmax_with_null(z: Array, allowed: Array, null_logit: Optional[Array]):
  zm = _masked(z, allowed)
  m = _shift(zm, null_logit)
  e = jnp.exp(zm - m)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  if null_logit is not None:
    denom = denom + jnp.exp(null_logit - m)
  safe = jnp.where(denom > 0, denom, 1.0)
  return e / safe, m + jnp.log(safe)


def _lse(z: Array, allowed: Array) -> Array:
  """The log-normaliser of :func:`_softmax_with_null` without a null column (its weights are
  not needed)."""
  zm = jnp.where(allowed, z, -jnp.inf)
  m = _shift(zm)
  denom = jnp.sum(jnp.exp(zm - m), axis=-1, keepdims=True)
  return m + jnp.log(jnp.where(denom > 0, denom, 1.0))


def num_allowed(allowed: Array, shape: tuple[int, ...]) -> Array:
  """Number of allowed keys per row, ``[..., T, 1]`` float32 (at least 1)."""
  n = jnp.sum(jnp.broadcast_to(allowed, shape), axis=-1, keepdims=True, dtype=jnp.float32)
  return jnp.maximum(n, 1.0)


def first_logit(st: dict, zm: Array, first) -> dict:
  """``st["z0"]``: the masked logit of key 0 when the tile starts at key 0.

  ``first`` is a Python bool (the block-wise kernel knows each tile's start) or
  a traced bool (a Pallas kernel body whose key-block index is a loop variable);
  the column is picked with a reduction, not a slice, so the same code lowers
  inside a Triton kernel body.
  """
  if first is False:
    return st
  col = jax.lax.broadcasted_iota(jnp.int32, zm.shape, zm.ndim - 1)
  z0 = jnp.max(jnp.where(col == 0, zm, -jnp.inf), axis=-1, keepdims=True)
  st["z0"] = z0 if first is True else jnp.where(first, z0, st["z0"])
  return st


def _stat_rows(
  counts: Array, mass: Array, entropy: Array, p0: Array, row_max: Array, lse: Array, row_sum: Array
) -> dict:
  """Per-row statistics, reduced to :class:`attnjax.AttentionStats` by the kernel."""
  has_key = counts > 0
  lse = jnp.where(jnp.logical_and(has_key, jnp.isfinite(lse)), lse, 0.0)
  return dict(
    normalisable=jnp.logical_and(has_key, mass > 0),
    has_key=has_key,
    entropy=entropy,
    p0=p0,
    row_max=row_max,
    lse=lse,
    row_sum=row_sum,
  )


# ---------------------------------------------------------------------------
# The interface.


class Normalizer:
  """One normaliser: every path's view of it. Subclasses fill in the methods.

  Attributes:
    name: the ``normalizer=`` string.
    source: where it comes from (for tables).
    needs_counts: the number of allowed keys per row must be known before the
      first tile (kernels run a mask-only pre-pass).
    shift_floor: the exp shift never goes below this logit (the fixed null
      column of softmax_one, softpick's ``e^0``), or None.
    null_column: a null key takes mass (a fixed one, or ``sink_logits``).
    accepts_sink_logits: learned per-head null logits may be given.
    platform_kernel: ``jax.nn.dot_product_attention`` / cuDNN / splash compute
      exactly this normaliser (without sink logits).
    softmax_like: weights are ``exp(z - log_normalizer)``; the logsumexp
      statistic is the log-normaliser (the null column included).
    sums_to_one: every row with a key sums to one.
    mergeable: partial results over disjoint key sets merge exactly
      (:meth:`merge`); parts are computed with normaliser ``merge_part``.
    merge_part: the normaliser name parts of a merge are computed with.
    reads_row_dot: :meth:`tile_backward` (and :meth:`null_grad`) read ``row_dot``
      ``= <dO_i, O_i>``; where False a kernel may pass None and skip computing it (a
      pass over dO and O).
  """

  name: str = ""
  source: str = ""
  needs_counts: bool = False
  shift_floor: Optional[float] = None
  null_column: bool = False
  accepts_sink_logits: bool = False
  platform_kernel: bool = False
  softmax_like: bool = False
  sums_to_one: bool = False
  mergeable: bool = False
  merge_part: Optional[str] = None
  reads_row_dot: bool = True

  def __repr__(self) -> str:
    return f"<normalizer {self.name!r}>"

  # -- materialised ----------------------------------------------------------

  def weights(
    self, z: Array, allowed: Array, sink_logits: Optional[Array] = None
  ) -> tuple[Array, Array]:
    """``(weights [B, N, T, S], log_normalizer [B, N, T, 1])`` from materialised logits.

    Args:
      z: float32 logits ``[B, N, T, S]``.
      allowed: bool, broadcastable to ``z``.
      sink_logits: ``[1, N, 1, 1]`` learned null logits (only where
        ``accepts_sink_logits``), or None.
    """
    raise NotImplementedError

  # -- online accumulation -----------------------------------------------------

  def floor(self, sink_rows: Optional[Array]) -> Optional[Array]:
    """Lower bound of the exp shift per row: the null column's logit, or None."""
    if sink_rows is not None:
      return sink_rows
    if self.shift_floor is None:
      return None
    # A scalar: broadcasts against rows of any rank (the block-wise kernel's [B, K, R, 1] and a
    # Pallas kernel body's [R, 1] alike).
    return jnp.asarray(self.shift_floor, jnp.float32)

  def row_constants(self, counts: Optional[Array]) -> dict:
    """Per-row constants computed once per query block (e.g. sigmoid's ``-log n``)."""
    del counts
    return {}

  def row_inputs(self, sink_rows: Optional[Array], counts: Optional[Array]) -> dict:
    """The ``row`` dict of a query block (see the module docstring)."""
    row = {"floor": self.floor(sink_rows), "counts": counts}
    row.update(self.row_constants(counts))
    return row

  def row_dot_from_tiles(self, dtype) -> bool:
    """Whether a kernel's backward takes ``D_i`` as ``sum_j w_ij dp_ij`` over its recomputed
    tiles in float32 (as the reference's autodiff has it) rather than ``<dO_i, O_i>``.

    In bfloat16 / float16 the forward's ``O`` is no float32 ``sum_j w_ij v_j``: its ``P V``
    product takes the weights rounded to that dtype and it is stored in it, so
    ``<dO_i, O_i>`` is off by about ``2^-9 sum_j w_ij |dp_ij|``. A softmax-like backward
    multiplies ``D_i`` by the weight itself (``dz = w (dp - D)``), which keeps that error
    within the row's own rounding; others may multiply it by far more: softpick's
    ``dz = e^z (dp [z > 0] - D sign z) / (sum |e^z - 1| + eps)``, unbounded near its kink
    (rows seeing one key with a small positive logit had dq off by up to 98%). One rule for
    every kernel that reads ``D_i`` (``reads_row_dot``)."""
    return self.reads_row_dot and not self.softmax_like and jnp.dtype(dtype) != jnp.float32

  def init(self, rows: tuple[int, ...], acc: tuple[int, ...], stats: bool) -> dict:
    """The state before the first tile: ``rows`` ``[..., R, 1]``, ``acc`` ``[..., R, Hv]``."""
    raise NotImplementedError

  def visit(
    self, st: dict, z: Array, allowed: Optional[Array], pv: PV, row: dict, stats: bool, first: bool
  ) -> dict:
    """Folds one tile of logits ``z`` ``[..., R, tk]`` into the state.

    Args:
      st: the state.
      z: float32 logits of the tile.
      allowed: bool broadcastable to ``z``, or None when every pair is allowed.
      pv: ``w [..., R, tk] -> w @ V_tile [..., R, Hv]``.
      row: the query block's row inputs.
      stats: accumulate statistics too.
      first: the tile starts at key 0 (its first column feeds ``sink_mass``); a
        Python bool, or a traced bool inside a kernel loop (see :func:`first_logit`).
    """
    raise NotImplementedError

  def finish(self, st: dict, row: dict, stats: bool) -> tuple[Array, dict, Optional[dict]]:
    """``(out [..., R, Hv], residuals, statistics rows or None)`` of finished rows.

    ``residuals`` are ``[..., R, 1]`` rows :meth:`tile_backward` needs; with
    ``stats`` the statistics rows hold ``normalisable``, ``has_key``,
    ``entropy``, ``p0`` (row-normalised weight of key 0), ``row_max`` (the
    maximum allowed logit, ``-inf`` on a row with no key), ``lse`` (0 on such
    a row) and ``row_sum``.
    """
    raise NotImplementedError

  # -- backward ------------------------------------------------------------------

  def tile_backward(
    self,
    z: Array,
    allowed: Optional[Array],
    dp: Array,
    res: dict,
    row_dot: Array,
    d_lse: Optional[Array],
  ) -> tuple[Array, Array]:
    """``(w, dz)`` of one tile: its weights and the cotangent of its logits.

    Args:
      z: float32 logits of the tile ``[..., R, tk]``.
      allowed: as in :meth:`visit`.
      dp: ``dO V^T`` of the tile ``[..., R, tk]``.
      res: the residual rows from :meth:`finish`.
      row_dot: ``<dO_i, O_i>`` per row ``[..., R, 1]`` (None where not
        ``reads_row_dot``).
      d_lse: cotangent of the logsumexp statistic per row, or None.
    """
    raise NotImplementedError

  def null_grad(self, floor: Array, res: dict, row_dot: Array, d_lse: Optional[Array]) -> Array:
    """Cotangent of a learned null logit per row (only where ``accepts_sink_logits``)."""
    raise NotImplementedError(f"normalizer {self.name!r} has no learned null column")

  # -- merge -------------------------------------------------------------------

  def merge(
    self, parts: Sequence[tuple[Array, Array]], sink_logits: Optional[Array] = None
  ) -> Array:
    """Merges partial results of the same rows over disjoint key sets.

    Args:
      parts: ``(out, lse)`` pairs, each computed with ``merge_part`` over
        its keys; ``lse`` broadcasts against ``out`` (a trailing axis of 1)
        and is ``-inf`` for rows with no key in that part.
      sink_logits: learned null logits broadcastable to ``lse``, or None.

    Returns:
      The output over the union of the keys, float32 (zero for a row with no key).
    """
    raise ValueError(f"normalizer={self.name!r} cannot merge partial results")


# ---------------------------------------------------------------------------
# Softmax and softmax with a null column (softmax_one, sink logits).


class SoftmaxFamily(Normalizer):
  """``exp(z_ij) / (exp(null) + sum_l exp(z_il))``; without a null column, softmax.

  Online: FlashAttention-2's running maximum ``m`` (shift ``max(m, null)``),
  running sum ``l`` and accumulator rescaled by ``exp(s_old - s_new)``; the
  residual is the log-normaliser, and the backward is ``dz = w (dp - D_i + g_i)``
  with ``D_i = <dO_i, O_i>`` and ``g_i`` the logsumexp cotangent.
  """

  softmax_like = True
  mergeable = True
  merge_part = "softmax"

  def __init__(self, name: str, null_logit: Optional[float], source: str):
    self.name = name
    self.source = source
    self.shift_floor = null_logit
    self.null_column = null_logit is not None
    self.accepts_sink_logits = null_logit is None
    self.platform_kernel = null_logit is None
    self.sums_to_one = null_logit is None

  def weights(self, z, allowed, sink_logits=None):
    return _softmax_with_null(z, allowed, self.floor(sink_logits))

  def init(self, rows, acc, stats):
    st = {
      "acc": jnp.zeros(acc, jnp.float32),
      "m": jnp.full(rows, -jnp.inf, jnp.float32),
      "l": jnp.zeros(rows, jnp.float32),
    }
    if stats:
      st["h2"] = jnp.zeros(rows, jnp.float32)  # sum of e * (z - shift) (entropy)
      st["z0"] = jnp.full(rows, -jnp.inf, jnp.float32)  # logit of key 0 where allowed
    return st

  def visit(self, st, z, allowed, pv, row, stats, first):
    floor = row["floor"]
    zm = _masked(z, allowed)
    st = dict(st)
    m_old = st["m"]
    m_new = jnp.maximum(m_old, jnp.max(zm, axis=-1, keepdims=True))
    st["m"] = m_new
    s_new = _online_shift(m_new, floor)
    s_old_raw = m_old if floor is None else jnp.maximum(m_old, floor)
    alpha = jnp.exp(s_old_raw - s_new)
    e = jnp.exp(zm - s_new)
    l_old = st["l"]
    st["l"] = alpha * l_old + jnp.sum(e, axis=-1, keepdims=True)
    st["acc"] = alpha * st["acc"] + pv(e)
    if stats:
      st["h2"] = alpha * (st["h2"] + (_finite(s_old_raw) - s_new) * l_old) + jnp.sum(
        e * (z - s_new), axis=-1, keepdims=True
      )
      first_logit(st, zm, first)
    return st

  def finish(self, st, row, stats):
    floor = row["floor"]
    s = _online_shift(st["m"], floor)
    denom = st["l"] if floor is None else st["l"] + jnp.exp(floor - s)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = st["acc"] / safe
    log_norm = s + jnp.log(safe)
    res = {"log_norm": log_norm}
    if not stats:
      return out, res, None
    mass = st["l"]
    safe_mass = jnp.where(mass > 0, mass, 1.0)
    p0 = jnp.exp(st["z0"] - s) / safe_mass
    entropy = jnp.log(safe_mass) - st["h2"] / safe_mass
    return out, res, _stat_rows(row["counts"], mass, entropy, p0, st["m"], log_norm, mass / safe)

  def tile_backward(self, z, allowed, dp, res, row_dot, d_lse):
    w = jnp.exp(_masked(z, allowed) - res["log_norm"])
    row = row_dot if d_lse is None else row_dot - d_lse
    return w, w * (dp - row)

  def null_grad(self, floor, res, row_dot, d_lse):
    w_null = jnp.exp(floor - res["log_norm"])
    return w_null * ((0.0 if d_lse is None else d_lse) - row_dot)

  def merge(self, parts, sink_logits=None):
    lses = [lse for _, lse in parts]
    m = lses[0]
    for lse in lses[1:]:
      m = jnp.maximum(m, lse)
    m = jax.lax.stop_gradient(_finite(m))
    ws = [jnp.exp(lse - m) for lse in lses]
    denom = ws[0]
    for w in ws[1:]:
      denom = denom + w
    floor = self.floor(sink_logits)
    if floor is not None:
      denom = denom + jnp.exp(floor.astype(jnp.float32) - m)
    total = ws[0] * parts[0][0].astype(jnp.float32)
    for w, (out, _) in zip(ws[1:], parts[1:]):
      total = total + w * out.astype(jnp.float32)
    return total / jnp.where(denom > 0, denom, 1.0)


# ---------------------------------------------------------------------------
# Normalisers whose logsumexp statistic is a separate, plain logsumexp.


class _PlainLse(Normalizer):
  """Shared statistics of normalisers that are not softmax-like.

  With statistics the state also keeps the running maximum ``m`` and plain
  sum ``l`` of ``exp(z)`` (the logsumexp statistic and its gradient), the
  magnitude ``h1 = sum |w|``, ``h2 = sum |w| log |w|`` and the first logit.
  """

  def _stats_init(self, st: dict, rows, stats: bool) -> dict:
    if stats:
      st.setdefault("m", jnp.full(rows, -jnp.inf, jnp.float32))
      st["l"] = jnp.zeros(rows, jnp.float32)  # plain logsumexp for the statistic
      st["h1"] = jnp.zeros(rows, jnp.float32)  # sum of |weights| (up to the shift)
      st["h2"] = jnp.zeros(rows, jnp.float32)  # sum of w log w (entropy)
      st["z0"] = jnp.full(rows, -jnp.inf, jnp.float32)  # logit of key 0 where allowed
    return st

  def _stats_visit(self, st: dict, zm: Array, m_old: Array, m_new: Array, first: bool) -> None:
    s_new = _finite(m_new)
    st["l"] = jnp.exp(m_old - s_new) * st["l"] + jnp.sum(
      jnp.exp(zm - s_new), axis=-1, keepdims=True
    )
    first_logit(st, zm, first)

  def _stats_finish(self, st: dict, row: dict, w0: Array, row_sum: Array, res: dict) -> dict:
    ms = _finite(st["m"])
    lse = ms + jnp.log(jnp.where(st["l"] > 0, st["l"], 1.0))
    lse = jnp.where(st["l"] > 0, lse, -jnp.inf)
    mass = st["h1"]
    safe_mass = jnp.where(mass > 0, mass, 1.0)
    entropy = jnp.log(safe_mass) - st["h2"] / safe_mass
    rows = _stat_rows(row["counts"], mass, entropy, w0 / safe_mass, st["m"], lse, row_sum)
    res["lse"] = rows["lse"]
    return rows

  def _lse_grad(self, dz: Array, z: Array, allowed, res: dict, d_lse) -> Array:
    if d_lse is None:
      return dz
    return dz + d_lse * jnp.exp(_masked(z, allowed) - res["lse"])


class Softpick(_PlainLse):
  """``relu(e^z - 1) / (sum |e^z - 1| + eps)``, multiplied through by ``e^-s``, ``s >= 0``."""

  name = "softpick"
  source = "Zuhri et al. 2025"
  shift_floor = 0.0

  def weights(self, z, allowed, sink_logits=None):
    del sink_logits
    zm = _masked(z, allowed)
    m = _shift(zm, jnp.zeros((1,) * z.ndim, z.dtype))  # any rank: [B, N, T, S], [B, K, G, T, S]
    e = jnp.exp(zm - m)
    one = jnp.exp(-m)
    centred = jnp.where(allowed, e - one, 0.0)
    num = jax.nn.relu(centred)
    denom = jnp.sum(jnp.abs(centred), axis=-1, keepdims=True) + SOFTPICK_EPS * one
    return num / denom, _lse(z, allowed)

  def init(self, rows, acc, stats):
    st = {
      "acc": jnp.zeros(acc, jnp.float32),
      "m": jnp.full(rows, -jnp.inf, jnp.float32),
      "dn": jnp.zeros(rows, jnp.float32),
    }
    return self._stats_init(st, rows, stats)

  def visit(self, st, z, allowed, pv, row, stats, first):
    zm = _masked(z, allowed)
    st = dict(st)
    m_old = st["m"]
    m_new = jnp.maximum(m_old, jnp.max(zm, axis=-1, keepdims=True))
    st["m"] = m_new
    s_old, s_new = jnp.maximum(m_old, self.shift_floor), jnp.maximum(m_new, self.shift_floor)
    alpha = jnp.exp(s_old - s_new)
    # e^(z-s) - e^-s = sign z e^(max(z, 0) - s) (1 - e^-|z|): no cancellation near z = 0
    centred = jnp.sign(zm) * jnp.exp(jnp.maximum(zm, 0.0) - s_new) * _one_minus_exp_neg(jnp.abs(zm))
    if allowed is not None:
      centred = jnp.where(allowed, centred, 0.0)
    u = jnp.maximum(centred, 0.0)
    st["dn"] = alpha * st["dn"] + jnp.sum(jnp.abs(centred), axis=-1, keepdims=True)
    st["acc"] = alpha * st["acc"] + pv(u)
    if stats:
      h1_old = st["h1"]
      st["h1"] = alpha * h1_old + jnp.sum(u, axis=-1, keepdims=True)
      st["h2"] = alpha * (st["h2"] + (s_old - s_new) * h1_old) + jnp.sum(
        _plogp(u), axis=-1, keepdims=True
      )
      self._stats_visit(st, zm, m_old, m_new, first)
    return st

  def finish(self, st, row, stats):
    s = jnp.maximum(st["m"], self.shift_floor)
    denom = st["dn"] + SOFTPICK_EPS * jnp.exp(-s)
    out = st["acc"] / denom
    res = {"log_norm": s + jnp.log(denom)}
    if not stats:
      return out, res, None
    w0 = jnp.maximum(jnp.exp(st["z0"] - s) - jnp.exp(-s), 0.0)
    return out, res, self._stats_finish(st, row, w0, st["h1"] / denom, res)

  def tile_backward(self, z, allowed, dp, res, row_dot, d_lse):
    ln = res["log_norm"]
    scaled = jnp.exp(_masked(z, allowed) - ln)  # e^z / (sum |e^z - 1| + eps)
    # relu(e^z - 1) / (..) = scaled (1 - e^-z) for z > 0: no difference of two ~1/(e^z - 1)
    w = scaled * _one_minus_exp_neg(jnp.maximum(z, 0.0))
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
    dz = scaled * (jnp.where(z > 0, dp, 0.0) - row_dot * jnp.sign(z))
    return w, self._lse_grad(dz, z, allowed, res, d_lse)


class Elementwise(_PlainLse):
  """Weights ``f(z_ij; row constants)`` of each logit on its own: no running normaliser.

  Subclasses give :meth:`weight` and :meth:`weight_grad` (and, with
  ``needs_counts``, :meth:`Normalizer.row_constants` from the allowed-key counts); one tile
  adds ``f(z) @ V`` to the accumulator, and the backward is ``dz = dp f'(z)``.

  Attributes:
    nonnegative: ``f >= 0``, so the statistics need no ``|w|`` and the row sum
      is the magnitude.
    constants: names of the row constants the backward needs (saved as residuals).
  """

  nonnegative: bool = True
  constants: tuple[str, ...] = ()
  reads_row_dot = False  # dz = dp f'(z): no row term

  def weight(self, z: Array, row: dict) -> Array:
    """``f(z)`` elementwise, ``row`` holding the row constants."""
    raise NotImplementedError

  def weight_grad(self, z: Array, w: Array, allowed: Optional[Array], row: dict) -> Array:
    """``f'(z)`` (0 where not allowed), given the masked weights ``w``."""
    raise NotImplementedError

  def weights(self, z, allowed, sink_logits=None):
    del sink_logits
    counts = num_allowed(allowed, z.shape) if self.needs_counts else None
    row = self.row_constants(counts)
    w = jnp.where(allowed, self.weight(jnp.where(allowed, z, 0.0), row), 0.0)
    return w, _lse(z, allowed)

  def init(self, rows, acc, stats):
    st = {"acc": jnp.zeros(acc, jnp.float32)}
    st = self._stats_init(st, rows, stats)
    if stats and not self.nonnegative:
      st["rs"] = jnp.zeros(rows, jnp.float32)
    return st

  def visit(self, st, z, allowed, pv, row, stats, first):
    st = dict(st)
    if stats:
      zm = _masked(z, allowed)
      m_old = st["m"]
      m_new = jnp.maximum(m_old, jnp.max(zm, axis=-1, keepdims=True))
      st["m"] = m_new
    w = self.weight(z, row)
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
    st["acc"] = st["acc"] + pv(w)
    if stats:
      mag = w if self.nonnegative else jnp.abs(w)
      st["h1"] = st["h1"] + jnp.sum(mag, axis=-1, keepdims=True)
      st["h2"] = st["h2"] + jnp.sum(_plogp(mag), axis=-1, keepdims=True)
      if not self.nonnegative:
        st["rs"] = st["rs"] + jnp.sum(w, axis=-1, keepdims=True)
      self._stats_visit(st, zm, m_old, m_new, first)
    return st

  def finish(self, st, row, stats):
    res = {name: row[name] for name in self.constants}
    if not stats:
      return st["acc"], res, None
    w0 = self.weight(_finite(st["z0"]), row)
    w0 = jnp.where(jnp.isfinite(st["z0"]), w0 if self.nonnegative else jnp.abs(w0), 0.0)
    row_sum = st["h1"] if self.nonnegative else st["rs"]
    return st["acc"], res, self._stats_finish(st, row, w0, row_sum, res)

  def tile_backward(self, z, allowed, dp, res, row_dot, d_lse):
    del row_dot
    w = self.weight(z, res)
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
    dz = dp * self.weight_grad(z, w, allowed, res)
    return w, self._lse_grad(dz, z, allowed, res, d_lse)


class Sigmoid(Elementwise):
  """``sigmoid(z + b_i)`` with ``b_i = -log n_i``, ``n_i`` the allowed keys of row ``i``."""

  name = "sigmoid"
  source = "Ramapuram et al. 2024"
  needs_counts = True
  constants = ("bias",)

  def row_constants(self, counts):
    if counts is None:
      return {}
    return {"bias": -jnp.log(jnp.maximum(counts, 1.0))}

  def weight(self, z, row):
    return jax.nn.sigmoid(z + row["bias"])

  def weight_grad(self, z, w, allowed, row):
    del z, allowed, row
    return w * (1.0 - w)  # w is 0 where not allowed


class Identity(Elementwise):
  """The raw scores ``z_ij`` (no normaliser)."""

  name = "none"
  source = "-"
  nonnegative = False

  def weight(self, z, row):
    del row
    return z

  def weight_grad(self, z, w, allowed, row):
    del z, w, row
    return 1.0 if allowed is None else allowed.astype(jnp.float32)


class ReLU(Elementwise):
  """``relu(z_ij) / n_i``: ReLU attention (Wortsman et al. 2023).

  The paper divides by the sequence length ``L``. Here ``n_i`` is the number of
  keys row ``i`` may attend (as sigmoid's ``-log n_i``): ``S`` for an unmasked
  row, as in the paper, and under causal, window, segment, padding or pattern
  masks the row's own allowed keys (causal row ``i``: ``i + 1``), the same in
  every path (reference, block-wise, sparse, decode with a KV cache). Rows
  need not sum to one.
  """

  name = "relu"
  source = "Wortsman et al. 2023"
  needs_counts = True
  constants = ("inv_n",)

  def row_constants(self, counts):
    if counts is None:
      return {}
    return {"inv_n": 1.0 / jnp.maximum(counts, 1.0)}

  def weight(self, z, row):
    return jax.nn.relu(z) * row["inv_n"]

  def weight_grad(self, z, w, allowed, row):
    del w
    d = jnp.where(z > 0, row["inv_n"], 0.0)
    return d if allowed is None else jnp.where(allowed, d, 0.0)


# ---------------------------------------------------------------------------
# The registry.


def _register(*normalizers: Normalizer) -> dict[str, Normalizer]:
  return {n.name: n for n in normalizers}


REGISTRY: dict[str, Normalizer] = _register(
  SoftmaxFamily("softmax", None, "Vaswani et al. 2017"),
  SoftmaxFamily("softmax_one", 0.0, 'Miller 2023 ("off by one")'),
  Sigmoid(),
  Softpick(),
  Identity(),
  ReLU(),
)

NORMALIZERS = tuple(REGISTRY)
# Normalisers whose rows sum to one (softmax_one and sink logits sum to <= 1).
SUMS_TO_ONE = tuple(name for name, n in REGISTRY.items() if n.sums_to_one)
TABLE: dict[str, Callable] = {name: n.weights for name, n in REGISTRY.items()}


def get(normalizer: str) -> Normalizer:
  """The registered normaliser named ``normalizer`` (ValueError naming the choices)."""
  if normalizer not in REGISTRY:
    raise ValueError(
      f"normalizer={normalizer!r} is not one of: " + ", ".join(repr(n) for n in NORMALIZERS)
    )
  return REGISTRY[normalizer]


def normalize(
  z: Array, allowed: Array, *, normalizer: str, sink_logits: Optional[Array] = None
) -> tuple[Array, Array]:
  """Applies a registered normaliser. ``sink_logits`` is ``[1, N, 1, 1]`` or None."""
  return get(normalizer).weights(z, allowed, sink_logits)
