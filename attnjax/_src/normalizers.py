"""The normalisers: how a row of logits becomes attention weights, defined once each.

Implementation behind the public module :mod:`attnjax.normalizers`. Over 600 lines on purpose:
each normaliser is one class holding every path's view of it (the interface, the built-ins,
the weights-only form) and the registry that validates them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

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
  exp and log only, which every kernel backend lowers; Mosaic has no ``expm1``).

  Its derivative is finite everywhere: outside Kahan's range the ratio is taken of safe
  stand-ins (a ``where`` passes on its unselected branch's NaN times 0, and ``x / max(-log
  u, tiny)`` at ``x = 0`` differentiated to ``0 / tiny^2 = 0 / 0``: the zero logits of
  padded query rows made every key gradient of block_select_attention NaN with softpick).
  """
  u = jnp.exp(-x)
  # Kahan's correction where 1 - u cancels (u > 1/2); above, 1 - u is exact to an ulp, and
  # -log u of a flushed-to-zero e^-x would differentiate to 0 / 0.
  kahan = jnp.logical_and(u > 0.5, u < 1.0)
  ratio = jnp.where(kahan, x, 1.0) / -jnp.log(jnp.where(kahan, u, jnp.exp(-1.0)))
  return jnp.where(u == 1.0, x, (1.0 - u) * ratio)


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


def row_softmax_terms(z: Array, allowed: Array) -> tuple[Array, Array]:
  """``(max, log_sum)`` of each row's allowed logits, ``[..., T, 1]`` each: the row maximum
  and ``log sum_j exp(z_j - max)`` (both 0 on a row with none), the ``row["max"]`` and
  ``row["log_sum"]`` a ``needs_lse`` normaliser reads (kept apart: at large logits
  ``max + log_sum`` in float32 would lose the digits ``z - lse`` needs)."""
  allowed = jnp.broadcast_to(allowed, z.shape)
  zm = jnp.where(allowed, z, -jnp.inf)
  m = _shift(zm)
  total = jnp.sum(jnp.exp(zm - m), axis=-1, keepdims=True)
  return m, jnp.log(jnp.where(total > 0, total, 1.0))


def softmax_terms_init(rows: tuple[int, ...]) -> tuple[Array, Array]:
  """The ``needs_lse`` pre-pass's state over key tiles: running maximum and sum of
  ``exp(z - max)`` (FlashAttention's), rows ``[..., R, 1]``."""
  return jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32)


def softmax_terms_visit(st: tuple[Array, Array], z: Array, allowed: Optional[Array]):
  """Folds one tile of logits into the pre-pass's state (every engine's one definition)."""
  m, l = st
  zm = _masked(z, allowed)
  m_new = jnp.maximum(m, jnp.max(zm, axis=-1, keepdims=True))
  shift = _finite(m_new)
  return m_new, jnp.exp(m - shift) * l + jnp.sum(jnp.exp(zm - shift), axis=-1, keepdims=True)


def softmax_terms_finish(st: tuple[Array, Array]) -> tuple[Array, Array]:
  """``(max, log_sum)`` rows of the pre-pass (both 0 on a row with no key), as
  :func:`attnjax._src.normalizers.row_softmax_terms` gives them for whole rows."""
  m, l = st
  return _finite(m), jnp.log(jnp.where(l > 0, l, 1.0))


def num_allowed(allowed: Array, shape: tuple[int, ...]) -> Array:
  """Number of allowed keys per row, ``[..., T, 1]`` float32, at least 1 (so that ``log n``
  and ``1 / n`` are finite on a row with no key).

  Args:
    allowed: bool mask, broadcastable to ``shape`` (e.g. ``[1, 1, T, S]`` for ``[B, N, T, S]``
      logits).
    shape: the logits' shape ``[..., T, S]``; ``allowed`` is broadcast to it before counting,
      so a mask shared by every head still gives one count per row of each head.
  """
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

# What a normaliser may claim about being softmax, with the value a class that does not state
# it gets. A claim sends a call to a softmax-only kernel (``platform_kernel``: jax.nn, cuDNN,
# splash), merges partial results as softmax (``mergeable``, ``merge_part``), or lets kernels
# skip work (``reads_row_dot`` False); ``softmax_like`` and ``sums_to_one`` are facts callers
# rely on. None is inherited: a subclass gets these values unless its own class body states
# the claim (its constructor may also set it on the instance), so a new normaliser built on
# ``SoftmaxFamily`` under another name never runs as softmax by accident.
CLAIMS: Mapping[str, Any] = {
  "platform_kernel": False,
  "mergeable": False,
  "merge_part": None,
  "softmax_like": False,
  "sums_to_one": False,
  "reads_row_dot": True,
}


class Normalizer:
  """One normaliser: every path's view of it. Subclasses fill in the methods.

  The full (online) interface: :meth:`weights`, :meth:`init`, :meth:`visit`, :meth:`finish`
  and :meth:`tile_backward`, defined together in one class (the registry refuses a class that
  overrides some of them and inherits the others); it runs on every engine, the Pallas
  kernels included. A normaliser written as its weights alone is a :class:`WeightsOnly`.
  The claims of :data:`CLAIMS` are never inherited (see there).

  Attributes:
    name: the ``normalizer=`` string.
    source: where it comes from (for tables).
    needs_counts: the number of allowed keys per row must be known before the
      first tile (kernels run a mask-only pre-pass).
    needs_lse: the softmax log-normaliser of each row (``logsumexp`` of its allowed
      logits) must be known before the first tile: engines run a logits-only pre-pass
      over the key blocks and give it as ``row["max"]`` and ``row["log_sum"]``
      (:func:`attnjax._src.normalizers.row_softmax_terms`; clipped softmax).
    row_dot_of_output: :meth:`tile_backward`'s ``row_dot`` is ``<dO_i, O_i>``; where
      False it is the sum over the row's tiles of :meth:`row_dot_tile` (engines run a
      backward pre-pass over the key blocks).
    shift_floor: the exp shift never goes below this logit (the fixed null
      column of softmax_one, softpick's ``e^0``), or None.
    null_column: a null key takes mass (a fixed one, or ``sink_logits``).
    accepts_sink_logits: learned per-head null logits may be given.
    platform_kernel: ``jax.nn.dot_product_attention`` / cuDNN / splash compute
      exactly this normaliser (without sink logits). A claim: those engines also
      take only the built-in object that makes it (:data:`PLATFORM_KERNELS`).
    softmax_like: weights are ``exp(z - log_normalizer)``; the logsumexp
      statistic is the log-normaliser (the null column included). A claim.
    sums_to_one: every row with a key sums to one. A claim.
    mergeable: partial results over disjoint key sets merge exactly
      (:meth:`merge`); parts are computed with normaliser ``merge_part``. A claim: a merge
      runs for a built-in, or for a normaliser that merges parts of its own only.
    merge_part: the normaliser name parts of a merge are computed with (None: this one).
    reads_row_dot: :meth:`tile_backward` (and :meth:`null_grad`) read ``row_dot``
      ``= <dO_i, O_i>``; where False a kernel may pass None and skip computing it (a
      pass over dO and O). A claim (True unless stated).
    params: learned parameters (:class:`Param`); only weights-only normalisers
      declare them.
  """

  name: str = ""
  source: str = ""
  needs_counts: bool = False
  needs_lse: bool = False
  row_dot_of_output: bool = True
  shift_floor: Optional[float] = None
  null_column: bool = False
  accepts_sink_logits: bool = False
  platform_kernel: bool = False
  softmax_like: bool = False
  sums_to_one: bool = False
  mergeable: bool = False
  merge_part: Optional[str] = None
  reads_row_dot: bool = True
  params: tuple = ()

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    for claim, value in CLAIMS.items():
      if claim not in cls.__dict__:
        setattr(cls, claim, value)

  def __repr__(self) -> str:
    return f"<normalizer {self.name!r}>"

  @property
  def row_passes(self) -> bool:
    """Whether engines must run a pass over a row's key blocks before its tiles.

    That pass finds the log-normaliser first (``needs_lse``), or sums the backward's row
    term over the tiles (not ``row_dot_of_output``). Kernels without those passes refuse
    the normaliser."""
    return self.needs_lse or not self.row_dot_of_output

  @property
  def weights_only(self) -> bool:
    """Written as its weights alone (:class:`WeightsOnly`): no tile interface, so the
    Pallas kernels refuse it and the block-wise engine runs it in two passes."""
    return isinstance(self, WeightsOnly)

  def materialize(
    self,
    z: Array,
    allowed: Array,
    sink_logits: Optional[Array] = None,
    params: Optional[Mapping[str, Array]] = None,
  ) -> tuple[Array, Array]:
    """``(weights, log_normalizer)`` of materialised logits, for every form: the one entry
    the reference engines call (:meth:`weights` here; :meth:`WeightsOnly.materialize`).

    Args:
      z: float32 logits ``[B, N, T, S]``.
      allowed: bool, broadcastable to ``z``.
      sink_logits: ``[1, N, 1, 1]`` learned null logits, or None.
      params: learned parameters by name, each broadcastable to ``[1, N, 1, 1]`` (weights-only
        normalisers only).
    """
    if params:
      raise ValueError(
        f"normalizer {self.name!r} declares no parameters, got normalizer_params {sorted(params)}"
      )
    return self.weights(z, allowed, sink_logits)

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

  def row_inputs(
    self, sink_rows: Optional[Array], counts: Optional[Array], softmax_terms=None
  ) -> dict:
    """The ``row`` dict of a query block (see the module docstring); ``softmax_terms`` the
    rows' ``(max, log_sum)`` of the ``needs_lse`` pre-pass (:func:`attnjax._src.normalizers.row_softmax_terms`)."""
    row = {"floor": self.floor(sink_rows), "counts": counts}
    if self.needs_lse:
      row["max"], row["log_sum"] = softmax_terms
    row.update(self.row_constants(counts))
    return row

  def row_dot_tile(self, z: Array, allowed: Optional[Array], dp: Array, res: dict) -> Array:
    """One tile's part ``[..., R, 1]`` of ``row_dot`` where not ``row_dot_of_output``."""
    raise NotImplementedError(f"normalizer {self.name!r} takes row_dot = <dO_i, O_i>")

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
        Python bool, or a traced bool inside a kernel loop (see ``first_logit``).
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

  Its claims are stated here, so an instance of this class (any name, any null logit) makes
  them and a subclass does not, unless it states them again (:data:`CLAIMS`).
  """

  softmax_like = True
  mergeable = True
  merge_part = "softmax"
  reads_row_dot = True

  def __init__(self, name: str, null_logit: Optional[float], source: str):
    self.name = name
    self.source = source
    self.shift_floor = null_logit
    self.null_column = null_logit is not None
    self.accepts_sink_logits = null_logit is None
    if type(self) is SoftmaxFamily:  # this class's claims, never a subclass's (CLAIMS)
      self.platform_kernel = self.sums_to_one = null_logit is None

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
# Clipped softmax (Bondarenko et al. 2023).


class ClippedSoftmax(Normalizer):
  """``clip((zeta - gamma) softmax(z) + gamma, 0, 1)``: softmax stretched and clipped, so a
  head can give exactly 0 (and exactly 1) with finite logits (Bondarenko et al. 2023).

  ``zeta >= 1`` and ``gamma <= 0`` (``zeta = 1, gamma = 0`` is softmax exactly); or the
  paper's ``gamma = -alpha / T`` with ``T`` the row's allowed keys (``alpha >= 0``). The
  weights need the normalised softmax before the clip, so every engine runs a pre-pass over
  the key blocks for the row's log-normaliser (``needs_lse``: its maximum and
  ``log sum e^(z - max)``), then the tiles: ``w = clip((zeta - gamma) e^(z - lse) + gamma,
  0, 1)``. Backward, with ``p = e^(z - lse)``
  and ``u`` the entries the clip leaves alone (``0 < (zeta - gamma) p + gamma < 1``):
  ``dz_ij = p_ij ((zeta - gamma) u_ij dp_ij - D_i + g_i)``, ``D_i = sum_j (zeta - gamma)
  u_ij p_ij dp_ij`` (a backward pre-pass over the tiles, ``row_dot_tile``) and ``g_i`` the
  logsumexp statistic's cotangent. Where the clip is active the weight's gradient is zero:
  a logit whose weight is clipped to 0 gets no gradient through it (only through the other
  entries of its row's softmax), so a head that has learned to give a key exactly 0 keeps
  doing so without pushing its logits further; the rows sum to at most ``zeta`` and at
  least ``0``, not to one.

  Args:
    name: the ``normalizer=`` string.
    zeta: the stretch's upper end (``>= 1``).
    gamma: its lower end (``<= 0``), or None with ``alpha``.
    alpha: ``gamma = -alpha / n`` per row, ``n`` its allowed keys (the paper's
      ``-alpha / T``), or None with ``gamma``.
  """

  needs_lse = True
  row_dot_of_output = False
  reads_row_dot = True
  source = "Bondarenko et al. 2023"

  def __init__(
    self,
    name: str = "clipped_softmax",
    *,
    zeta: float = 1.0,
    gamma: Optional[float] = None,
    alpha: Optional[float] = None,
  ):
    for key, value in (("zeta", zeta), ("gamma", gamma), ("alpha", alpha)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{key} must be a number, got {type(value).__name__} {value!r}")
    if (gamma is None) == (alpha is None):
      raise ValueError(
        f"clipped softmax takes gamma or alpha (gamma = -alpha / T), exactly one; got "
        f"gamma={gamma!r}, alpha={alpha!r}"
      )
    if not zeta >= 1:
      raise ValueError(
        f"zeta={zeta!r} must be >= 1 (the stretch's upper end: zeta < 1 could never give a "
        f"key its full weight)"
      )
    if gamma is not None and not gamma <= 0:
      raise ValueError(
        f"gamma={gamma!r} must be <= 0 (the stretch's lower end: gamma > 0 would give every "
        f"key a weight of at least gamma; gamma = 0 with zeta = 1 is softmax)"
      )
    if alpha is not None and not alpha >= 0:
      raise ValueError(f"alpha={alpha!r} must be >= 0 (gamma = -alpha / T <= 0)")
    self.name = name
    self.zeta = float(zeta)
    self.gamma = None if gamma is None else float(gamma)
    self.alpha = None if alpha is None else float(alpha)
    self.needs_counts = alpha is not None

  def __repr__(self) -> str:
    low = f"gamma={self.gamma}" if self.alpha is None else f"gamma=-{self.alpha}/T"
    return f"<normalizer {self.name!r}: clipped softmax, zeta={self.zeta}, {low}>"

  def row_constants(self, counts):
    """``gamma`` and the stretch ``zeta - gamma`` of each row (``[..., R, 1]`` or scalars)."""
    if self.alpha is None:
      gamma = jnp.asarray(self.gamma, jnp.float32)
    elif counts is None:
      return {}
    else:
      gamma = -self.alpha / jnp.maximum(counts, 1.0)
    return {"gamma": gamma, "stretch": self.zeta - gamma}

  def _clip(self, p: Array, allowed: Optional[Array], row: dict) -> tuple[Array, Array]:
    """``(w, u)``: the weights of softmax values ``p`` and where the clip leaves them alone."""
    raw = row["stretch"] * p + row["gamma"]
    w = jnp.clip(raw, 0.0, 1.0)
    u = jnp.logical_and(raw > 0.0, raw < 1.0)
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
      u = jnp.logical_and(u, allowed)
    return w, u

  def _p(self, z: Array, allowed: Optional[Array], row: dict) -> Array:
    """The softmax ``e^(z - max - log_sum)`` of the rows' pre-pass terms (0 where masked)."""
    return jnp.exp((_masked(z, allowed) - row["max"]) - row["log_sum"])

  def weights(self, z, allowed, sink_logits=None):
    if sink_logits is not None:
      raise ValueError(f"normalizer {self.name!r} takes no sink_logits")
    row = self.row_constants(num_allowed(allowed, z.shape) if self.needs_counts else None)
    row["max"], row["log_sum"] = row_softmax_terms(z, allowed)
    w, _ = self._clip(self._p(z, allowed, row), jnp.broadcast_to(allowed, z.shape), row)
    return w, row["max"] + row["log_sum"]

  def init(self, rows, acc, stats):
    st = {"acc": jnp.zeros(acc, jnp.float32)}
    if stats:
      st["m"] = jnp.full(rows, -jnp.inf, jnp.float32)
      for key in ("h1", "h2", "w0"):
        st[key] = jnp.zeros(rows, jnp.float32)
    return st

  def visit(self, st, z, allowed, pv, row, stats, first):
    st = dict(st)
    w, _ = self._clip(self._p(z, allowed, row), allowed, row)
    st["acc"] = st["acc"] + pv(w)
    if stats:
      zm = _masked(z, allowed)
      st["m"] = jnp.maximum(st["m"], jnp.max(zm, axis=-1, keepdims=True))
      st["h1"] = st["h1"] + jnp.sum(w, axis=-1, keepdims=True)
      st["h2"] = st["h2"] + jnp.sum(_plogp(w), axis=-1, keepdims=True)
      if first is not False:
        col = jax.lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
        w0 = jnp.sum(jnp.where(col == 0, w, 0.0), axis=-1, keepdims=True)
        st["w0"] = w0 if first is True else jnp.where(first, w0, st["w0"])
    return st

  def finish(self, st, row, stats):
    keys = ("max", "log_sum", "gamma", "stretch")
    res = {k: jnp.broadcast_to(row[k], row["max"].shape) for k in keys}
    if not stats:
      return st["acc"], res, None
    mass = st["h1"]
    safe = jnp.where(mass > 0, mass, 1.0)
    entropy = jnp.log(safe) - st["h2"] / safe
    lse = row["max"] + row["log_sum"]
    rows = _stat_rows(row["counts"], mass, entropy, st["w0"] / safe, st["m"], lse, mass)
    return st["acc"], res, rows

  def row_dot_tile(self, z, allowed, dp, res):
    p = self._p(z, allowed, res)
    _, u = self._clip(p, allowed, res)
    return jnp.sum(jnp.where(u, res["stretch"] * p * dp, 0.0), axis=-1, keepdims=True)

  def tile_backward(self, z, allowed, dp, res, row_dot, d_lse):
    p = self._p(z, allowed, res)
    w, u = self._clip(p, allowed, res)
    inner = jnp.where(u, res["stretch"] * dp, 0.0) - row_dot
    if d_lse is not None:
      inner = inner + d_lse
    return w, p * inner


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
    # e^(z-s) - e^-s = sign z e^(max(z, 0) - s) (1 - e^-|z|): no cancellation near z = 0.
    # On the finite logits: a masked key (a padded one too) enters as 0, whose term is 0; at
    # its -inf logit the terms' derivatives are NaN, which the where below would multiply by 0
    # and still pass on (NaN * 0), as autodiff of this visit does (block_select's tiles).
    zf = z if allowed is None else jnp.where(allowed, z, 0.0)
    centred = jnp.sign(zf) * jnp.exp(jnp.maximum(zf, 0.0) - s_new) * _one_minus_exp_neg(jnp.abs(zf))
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
  reads_row_dot = False  # dz = dp f'(z): no row term (a claim: each subclass states it again)

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
  reads_row_dot = False  # a claim (CLAIMS), stated by each built-in: dz = dp f'(z)
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
  reads_row_dot = False  # a claim (CLAIMS): dz = dp

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
  reads_row_dot = False  # a claim (CLAIMS): dz = dp f'(z)
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
# Weights-only normalisers: the weights of a row, given a few per-row quantities.

# The per-row quantities a weights-only normaliser may read, in the order they are computed.
ROW_QUANTITIES = ("count", "max", "logsumexp")


@dataclasses.dataclass(frozen=True)
class Param:
  """A learned parameter of a :class:`WeightsOnly` normaliser.

  Attributes:
    name: its key in the hooks' ``row`` and in ``normalizer_params=``.
    init: its initial value (the layer's, and a call's that passes none).
    per_head: one value per query head (``[N]``); False: one per layer (a scalar).
  """

  name: str
  init: float = 0.0
  per_head: bool = True

  def shape(self, num_heads: int) -> tuple[int, ...]:
    """The array shape a call passes: ``(num_heads,)`` or ``()``."""
    return (num_heads,) if self.per_head else ()


class WeightsOnly(Normalizer):
  """A normaliser written as its weights alone, given the per-row quantities it declares.

  Subclasses set ``name``, ``row_quantities``, ``params`` and define
  :meth:`weights` (and :meth:`logits`, a rewrite of the logits the quantities are taken of).
  The reference engines materialise it; the block-wise engine runs it in O(T) memory in
  two passes over the key blocks (the declared quantities, then the weights tile by tile)
  whose derivatives come from autodiff; the Pallas kernels, written for the online
  interface, refuse it. The hooks see finite logits: a masked entry holds a finite stand-in
  whose weight is dropped (in value and gradient).

  Attributes:
    row_quantities: the quantities ``row`` holds for :meth:`weights`, each ``[..., R, 1]``:
      ``"count"`` (the row's allowed keys, at least 1; also given to :meth:`logits`),
      ``"max"`` and ``"logsumexp"`` (of the allowed entries of :meth:`logits`' output; 0 on a
      row with no key). All carry their gradients.
    params: learned parameters (:class:`Param`): ``row[name]`` in both hooks, broadcastable
      to the logits (``[1, N, 1, 1]``-like); calls take them as ``normalizer_params``.
  """

  row_quantities: tuple[str, ...] = ()
  params: tuple[Param, ...] = ()

  def logits(self, z: Array, row: dict) -> Array:
    """The logits the quantities and :meth:`weights` see (default: ``z``). Elementwise.

    Args:
      z: float32 logits, ``[..., R, S]`` (all of a row, or one tile of it).
      row: ``"count"`` where declared, and the parameters.
    """
    del row
    return z

  def weights(self, z: Array, allowed: Array, row: dict) -> Array:
    """The weights of :meth:`logits`' output ``z``: elementwise given ``row``, so that the
    block-wise engine can call it on any tile of a row.

    Args:
      z: float32 logits after :meth:`logits`, ``[..., R, S]``.
      allowed: bool, broadcastable to ``z`` (entries where it is False are dropped).
      row: the declared ``row_quantities`` and the parameters.

    Returns:
      The weights, broadcastable to ``z``.
    """
    raise NotImplementedError(f"{type(self).__name__} must define weights(z, allowed, row)")

  # -- the reference engines ----------------------------------------------------

  def param_rows(self, params: Optional[Mapping[str, Array]]) -> dict:
    """The parameters by name (a missing one at its ``init``), float32."""
    params = params or {}
    return {
      p.name: jnp.asarray(params[p.name] if p.name in params else p.init, jnp.float32)
      for p in self.params
    }

  def materialize(self, z, allowed, sink_logits=None, params=None):
    """``(weights, logsumexp of the rewritten logits)``: the quantities over whole rows, then
    :meth:`weights` (see :meth:`Normalizer.materialize`)."""
    if sink_logits is not None:
      raise ValueError(f"normalizer {self.name!r} takes no sink_logits")
    allowed = jnp.broadcast_to(allowed, z.shape)
    row = self.param_rows(params)
    if "count" in self.row_quantities:
      row["count"] = num_allowed(allowed, z.shape)
    zr = self.rewrite(z, allowed, row)
    zm = jnp.where(allowed, zr, -jnp.inf)
    m = jnp.max(zm, axis=-1, keepdims=True)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = _lse(zr, allowed)
    if "max" in self.row_quantities:
      row["max"] = safe
    if "logsumexp" in self.row_quantities:
      row["logsumexp"] = lse
    w = self.masked_weights(zr, allowed, row, jax.lax.stop_gradient(safe))
    return w, lse

  # -- the block-wise engine: pass 1 (quantities), pass 2 (weights) ----------------

  def rewrite(self, z: Array, allowed: Optional[Array], row: dict) -> Array:
    """:meth:`logits` on finite inputs (a masked entry enters as 0), as float32 of ``z``'s
    shape."""
    zf = z if allowed is None else jnp.where(allowed, z, 0.0)
    return jnp.broadcast_to(jnp.asarray(self.logits(zf, dict(row)), jnp.float32), z.shape)

  def masked_weights(self, zr: Array, allowed: Optional[Array], row: dict, filler) -> Array:
    """:meth:`weights` of rewritten logits ``zr`` whose masked entries become ``filler`` (a
    finite stand-in), then 0 where not allowed; float32 of ``zr``'s shape."""
    if allowed is None:
      allowed = jnp.ones((1,) * zr.ndim, bool)
    else:
      zr = jnp.where(allowed, zr, filler)
    w = jnp.asarray(self.weights(zr, allowed, dict(row)), jnp.float32)
    return jnp.where(allowed, jnp.broadcast_to(w, zr.shape), 0.0)

  def quantities_init(self, rows: tuple[int, ...]) -> dict:
    """Pass 1's state: the running maximum ``m`` and the sum ``l`` of ``exp(z - m)``."""
    return {"m": jnp.full(rows, -jnp.inf, jnp.float32), "l": jnp.zeros(rows, jnp.float32)}

  def quantities_visit(self, st: dict, z: Array, allowed: Optional[Array], row: dict) -> dict:
    """Folds one tile of raw logits into pass 1's state (``row``: count and parameters)."""
    zm = _masked(self.rewrite(z, allowed, row), allowed)
    m_new = jnp.maximum(st["m"], jnp.max(zm, axis=-1, keepdims=True))
    shift = jax.lax.stop_gradient(_finite(m_new))
    alpha = jnp.exp(jax.lax.stop_gradient(st["m"]) - shift)
    return {"m": m_new, "l": alpha * st["l"] + jnp.sum(jnp.exp(zm - shift), axis=-1, keepdims=True)}

  def quantities_finish(self, st: dict) -> dict:
    """``{"max", "logsumexp"}`` rows of pass 1 (0 on a row with no key)."""
    shift = jax.lax.stop_gradient(_finite(st["m"]))
    return {
      "max": _finite(st["m"]),
      "logsumexp": shift + jnp.log(jnp.where(st["l"] > 0, st["l"], 1.0)),
    }

  def weights_init(self, rows: tuple[int, ...], acc: tuple[int, ...], stats: bool) -> dict:
    """Pass 2's state: the accumulator ``acc`` and, with statistics, ``|w|``'s sum ``h1``,
    ``sum |w| log |w|`` ``h2``, the row sum ``rs``, the raw logits' maximum ``zmax`` and the
    weight of key 0 ``w0``."""
    st = {"acc": jnp.zeros(acc, jnp.float32)}
    if stats:
      for key in ("h1", "h2", "rs", "w0"):
        st[key] = jnp.zeros(rows, jnp.float32)
      st["zmax"] = jnp.full(rows, -jnp.inf, jnp.float32)
    return st

  def weights_visit(
    self, st: dict, z: Array, allowed: Optional[Array], pv: PV, row: dict, stats: bool, first
  ) -> dict:
    """Folds one tile of raw logits into pass 2's state (``row``: quantities, parameters and
    ``"filler"``, the stand-in of masked entries); ``first``: the tile starts at key 0 (a
    Python bool)."""
    filler = row["filler"]
    hooks = {key: val for key, val in row.items() if key != "filler"}
    w = self.masked_weights(self.rewrite(z, allowed, hooks), allowed, hooks, filler)
    st = dict(st)
    st["acc"] = st["acc"] + pv(w)
    if stats:
      mag = jnp.abs(w)
      st["h1"] = st["h1"] + jnp.sum(mag, axis=-1, keepdims=True)
      st["h2"] = st["h2"] + jnp.sum(_plogp(mag), axis=-1, keepdims=True)
      st["rs"] = st["rs"] + jnp.sum(w, axis=-1, keepdims=True)
      zmax = jnp.max(_masked(z, allowed), axis=-1, keepdims=True)
      st["zmax"] = jnp.maximum(st["zmax"], zmax)
      if first:
        st["w0"] = mag[..., :1]
    return st

  def weights_finish(
    self, st: dict, counts: Optional[Array], lse: Optional[Array], stats: bool
  ) -> tuple[Array, Optional[dict]]:
    """``(out, statistics rows or None)`` of pass 2 (``counts``: the rows' allowed keys,
    ``lse``: the rewritten logits' logsumexp, both with statistics)."""
    if not stats:
      return st["acc"], None
    mass = st["h1"]
    safe = jnp.where(mass > 0, mass, 1.0)
    entropy = jnp.log(safe) - st["h2"] / safe
    rows = _stat_rows(counts, mass, entropy, st["w0"] / safe, st["zmax"], lse, st["rs"])
    return st["acc"], rows


# ---------------------------------------------------------------------------
# The registry.

# The hooks of the online interface: defined together, in one class.
_ONLINE_HOOKS = ("weights", "init", "visit", "finish", "tile_backward")


def _definer(cls: type, attribute: str) -> Optional[type]:
  """The class of ``cls``'s MRO whose body defines ``attribute``."""
  return next((c for c in cls.__mro__ if attribute in c.__dict__), None)


def _check_form(normalizer: Any) -> None:
  """Raises TypeError unless ``normalizer`` is a complete normaliser of one form: a
  :class:`WeightsOnly` that defines ``weights``, or a :class:`Normalizer` whose
  online hooks come from one class (a subclass that overrides ``weights`` alone
  would run its parent's tiles on the block-wise engine and the kernels)."""
  if not isinstance(normalizer, Normalizer):
    raise TypeError(
      f"a normaliser must be an attnjax.normalizers.Normalizer (or WeightsOnly) instance, "
      f"got {type(normalizer).__name__}"
    )
  name = getattr(normalizer, "name", None)
  if not isinstance(name, str) or not name or name != name.strip() or " " in name:
    raise ValueError(f"a normaliser's name must be a non-empty str without spaces, got {name!r}")
  cls = type(normalizer)
  if isinstance(normalizer, WeightsOnly):
    if _definer(cls, "weights") is WeightsOnly:
      raise TypeError(f"{cls.__name__} (normalizer {name!r}) must define weights(z, allowed, row)")
    unknown = [q for q in normalizer.row_quantities if q not in ROW_QUANTITIES]
    if unknown:
      raise ValueError(
        f"normalizer {name!r}: row_quantities {unknown} are not among {list(ROW_QUANTITIES)}"
      )
    params = normalizer.params
    if not isinstance(params, tuple) or not all(isinstance(p, Param) for p in params):
      raise TypeError(f"normalizer {name!r}: params must be a tuple of Param, got {params!r}")
    names = [p.name for p in params]
    clash = sorted({n for n in names if names.count(n) > 1 or n in ROW_QUANTITIES + ("filler",)})
    if clash:
      raise ValueError(f"normalizer {name!r}: parameter names {clash} repeat or shadow a quantity")
    return
  definers = {hook: _definer(cls, hook) for hook in _ONLINE_HOOKS}
  missing = [hook for hook, c in definers.items() if c is Normalizer]
  if missing:
    raise TypeError(
      f"{cls.__name__} (normalizer {name!r}) does not define {missing}: write the whole online "
      f"interface {list(_ONLINE_HOOKS)}, or subclass WeightsOnly and write weights(z, allowed, "
      f"row) alone"
    )
  if len(set(definers.values())) > 1:
    own = [hook for hook, c in definers.items() if c is definers["weights"]]
    inherited = {hook: c.__name__ for hook, c in definers.items() if c is not definers["weights"]}
    raise TypeError(
      f"{cls.__name__} (normalizer {name!r}) defines {own} but inherits {inherited}: the "
      f"online interface {list(_ONLINE_HOOKS)} must describe one normaliser, so define them "
      f"in one class, or subclass WeightsOnly and write weights(z, allowed, row) alone"
    )
  if isinstance(normalizer, Elementwise) and _definer(cls, "weight") is not _definer(
    cls, "weight_grad"
  ):
    raise TypeError(
      f"{cls.__name__} (normalizer {name!r}): weight and weight_grad must be defined together"
    )
  if normalizer.params:
    raise TypeError(
      f"normalizer {name!r}: learned parameters are for weights-only normalisers (WeightsOnly)"
    )


# The built-in normalisers: the objects the platform kernels and the merges accept.
_BUILTINS: dict[str, Normalizer] = {
  n.name: n
  for n in (
    SoftmaxFamily("softmax", None, "Vaswani et al. 2017"),
    SoftmaxFamily("softmax_one", 0.0, 'Miller 2023 ("off by one")'),
    Sigmoid(),
    Softpick(),
    Identity(),
    ReLU(),
    # The paper's BERT setting (Bondarenko et al. 2023, sec. 5): zeta = 1, gamma = -0.025.
    ClippedSoftmax("clipped_softmax", zeta=1.0, gamma=-0.025),
  )
}


class _Registry(dict):
  """The registered normalisers by name: a dict that only :func:`register` and
  :func:`unregister` change (lookups are plain dict lookups)."""

  def _refuse(self, *args, **kwargs):
    raise TypeError(
      "the normaliser registry is read-only: use attnjax.normalizers.register(normalizer) "
      "and unregister(name)"
    )

  __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = _refuse
  __ior__ = _refuse


REGISTRY: Mapping[str, Normalizer] = _Registry(_BUILTINS)
"""The registered normalisers by name: the built-ins, then those of :func:`register` (a live,
read-only dict)."""
# The last normaliser each name held: a jitted call's trace is keyed on the name, so
# registering another object under a name that held one clears jax's caches.
_LAST: dict[str, Normalizer] = dict(_BUILTINS)

# The built-in normalisers' names (those registered with attnjax; :func:`names` are the live ones).
NORMALIZERS = tuple(_BUILTINS)
# Built-in normalisers whose rows sum to one (softmax_one and sink logits sum to <= 1).
SUMS_TO_ONE = tuple(name for name, n in _BUILTINS.items() if n.sums_to_one)
TABLE: dict[str, Callable] = {name: n.weights for name, n in _BUILTINS.items()}


def names() -> tuple[str, ...]:
  """The names of the registered normalisers (the live registry), built-ins first."""
  return tuple(REGISTRY)


def register(normalizer: Normalizer) -> Normalizer:
  """Registers ``normalizer`` under its ``name``, for every function, layer, checkpoint
  override and experiment that takes ``normalizer=``; returns it.

  Registering another object under a name that held one before (after :func:`unregister`)
  clears jax's caches (:func:`jax.clear_caches`): jitted calls key their traces on the
  name, and none may run the old normaliser. Registering the same object again costs nothing,
  so define a normaliser once (at module level) and register it as often as needed.

  Raises:
    ValueError: the name is taken (the message names the normaliser holding it), or the
      normaliser's declarations are invalid.
    TypeError: not a complete normaliser: a :class:`WeightsOnly` that defines ``weights``, or a
      :class:`Normalizer` whose online hooks (``weights``, ``init``, ``visit``, ``finish``,
      ``tile_backward``) come from one class (one that overrides ``weights`` alone would run
      its parent's tiles on the block-wise engine and the kernels).
  """
  _check_form(normalizer)
  name = normalizer.name
  if name in REGISTRY:
    held = REGISTRY[name]
    raise ValueError(
      f"a normaliser named {name!r} is already registered: {held!r} "
      f"({type(held).__module__}.{type(held).__qualname__}); "
      + (
        "built-in names cannot be registered again"
        if name in _BUILTINS
        else f"unregister({name!r}) it first or choose another name"
      )
    )
  last = _LAST.get(name)
  dict.__setitem__(REGISTRY, name, normalizer)
  _LAST[name] = normalizer
  if last is not None and last is not normalizer:
    jax.clear_caches()
  return normalizer


def unregister(name: str) -> Normalizer:
  """Removes the normaliser registered as ``name`` (not a built-in) and returns it.

  A call traced before keeps its trace until the name is registered again (which clears
  jax's caches) or :func:`jax.clear_caches`; a new call of that name raises.
  """
  if name in _BUILTINS:
    raise ValueError(f"normalizer {name!r} is built in and cannot be unregistered")
  if name not in REGISTRY:
    raise ValueError(f"no normaliser named {name!r} is registered (registered: {names()})")
  return dict.pop(REGISTRY, name)


@contextlib.contextmanager
def registered(normalizer: Normalizer) -> Iterator[Normalizer]:
  """``with registered(n):``: ``n`` is registered inside the block only (for tests)."""
  register(normalizer)
  try:
    yield normalizer
  finally:
    if REGISTRY.get(normalizer.name) is normalizer:
      unregister(normalizer.name)


def get(normalizer: str) -> Normalizer:
  """The registered normaliser named ``normalizer``.

  Raises:
    TypeError: not a str.
    ValueError: no such normaliser (the message lists the registered ones and the closest).
  """
  found = REGISTRY.get(normalizer) if isinstance(normalizer, str) else None
  if found is not None:
    return found
  if not isinstance(normalizer, str):
    raise TypeError(
      f"normalizer must be a str naming a registered normaliser, got "
      f"{type(normalizer).__name__} {normalizer!r}"
    )
  close = difflib.get_close_matches(normalizer, list(REGISTRY), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  raise ValueError(
    f"normalizer={normalizer!r} is not one of: "
    + ", ".join(repr(n) for n in REGISTRY)
    + hint
    + "; a normaliser of your own must be registered first (attnjax.normalizers.register)"
  )


# The names of the normalisers jax.nn / cuDNN / splash compute: the built-in objects that claim
# Normalizer.platform_kernel (softmax). Built-in names are never registered again, so the name
# stands for the built-in object; the engines check it, and no claim on another object sends
# it to a softmax-only kernel.
PLATFORM_KERNELS = frozenset(name for name, n in _BUILTINS.items() if n.platform_kernel)


def merge_part(normalizer: str) -> Optional[str]:
  """The normaliser whose partial results a merge of ``normalizer`` combines, or None where
  no merge may run: a built-in ``mergeable`` normaliser's ``merge_part`` (softmax_one merges
  softmax parts); another ``mergeable`` normaliser merges parts of its own only (its
  ``merge_part`` None or its name), never parts of a normaliser it is not."""
  nz = get(normalizer)
  if not nz.mergeable or nz.weights_only:
    return None
  if nz is _BUILTINS.get(normalizer):
    return nz.merge_part
  return nz.name if nz.merge_part in (None, nz.name) else None


def normalize(
  z: Array,
  allowed: Array,
  *,
  normalizer: str,
  sink_logits: Optional[Array] = None,
  params: Optional[Mapping[str, Array]] = None,
) -> tuple[Array, Array]:
  """Applies a registered normaliser to materialised logits: ``(weights, log_normalizer)``.

  ``sink_logits`` is ``[1, N, 1, 1]`` or None; ``params`` the learned parameters of a
  weights-only normaliser by name, each broadcastable to ``[1, N, 1, 1]``.
  """
  return get(normalizer).materialize(z, allowed, sink_logits, params)
