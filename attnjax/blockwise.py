"""Block-wise (FlashAttention-2 style) dense attention: O(T) memory, skipped blocks.

The query axis is cut into blocks of ``block_q`` rows and the key axis into
blocks of ``block_k`` columns. Each query block visits only the key blocks its
:class:`attnjax.layout.BlockLayout` lists, keeping an online normaliser (running maximum and
running sums, rescaled when the maximum grows) so that no ``T x S`` array is
ever formed. The backward pass (``jax.custom_vjp``) recomputes each visited
block from ``q``, ``k``, ``v`` and one float per row saved by the forward pass.

Interface for block-sparse callers (the contract; internals may change)
-----------------------------------------------------------------------

``attention(inputs, opts, *, layout, mask_fn=None)`` is the kernel. It takes the
canonical :class:`attnjax._call.DenseInputs` / ``DenseOptions`` of a call and

- ``layout``: a :class:`attnjax.layout.BlockLayout`, static. For query block ``i`` (rows
  ``i * block_q .. min(T, (i + 1) * block_q)``), ``layout.kv_blocks[i]`` lists
  the key-block indices it visits, padded with ``-1`` to a common length, and
  ``layout.needs_mask[i]`` says, per visit, whether the block is only partly
  allowed by the static structure (then ``mask_fn`` is evaluated on it) or
  wholly allowed (then no mask is evaluated at all). Key blocks not listed
  are never computed. Build one with :meth:`BlockLayout.from_visits`,
  :func:`attnjax.layout.rule_layout` (a pattern's blocks) or
  :func:`attnjax.layout.structural_layout` (causal / window).
- ``mask_fn(q_positions [tq], k_positions [tk]) -> bool [B|1, 1, tq, tk]``
  (or None = all allowed): the static structure inside a partial block,
  called with the integer positions of the block's rows and columns
  (``k_positions`` may be traced: visits run inside a ``lax.fori_loop``, so
  the callback must be written with ``jnp`` operations).
  Default: :func:`attnjax.masks.structural_mask` with the call's
  ``is_causal`` and ``window``.

The kernel itself adds what is data, not structure: the explicit ``mask``
array, ``segment_ids`` (a visited block whose query and key segment ranges
cannot meet is skipped at run time with ``lax.switch``; one where every query
and key share one segment skips the segment comparison) and the padding of
ragged last blocks (there is none: edge blocks are simply shorter).
So ``mask_fn`` must not apply segment ids or the explicit mask again.

Every dense option works here: all normalisers of
:mod:`attnjax.normalizers` (``sigmoid``'s per-row ``-log n`` bias comes from a
mask-only pre-pass that counts the allowed keys), ``sink_logits``,
``softcap``, ``bias`` (sliced per block, never broadcast to ``T x S``),
``similarity``, GQA (query heads of one group share a matmul against their
key head, nothing is repeated), ``T != S``, any lengths, and half-precision
inputs (logits and sums in float32). :class:`AttentionStats` are accumulated
in the same pass; only ``logsumexp`` carries a gradient (the other statistics
are diagnostics and are treated as constants by the backward pass).

References:
  Dao et al. 2022, "FlashAttention"; Dao 2023, "FlashAttention-2";
  Rabe & Staats 2021, "Self-attention does not need O(n^2) memory".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax import _call, masks, normalizers
from attnjax.attention_stats import AttentionStats, _row_mean
from attnjax.layout import BlockLayout, segment_block_relations, structural_layout

Array = jnp.ndarray
MaskFn = Callable[[Array, Array], Optional[Array]]

SOFTMAX_FAMILY = ("softmax", "softmax_one")


def structural_mask_fn(opts) -> Optional[MaskFn]:
  """The default ``mask_fn``: causal / window from ``opts`` by :func:`masks.structural_mask`."""
  if not opts.is_causal and opts.window is None:
    return None
  return functools.partial(masks.structural_mask, is_causal=opts.is_causal, window=opts.window)


# Measured on the 2-core CPU of this project (B=1, N=8, H=64, fp32, causal, interleaved
# best-of-5 against jax.nn in the same run): 512 x 256 blocks ran the T=4096 forward in
# 0.194x jax.nn's time (512 x 512: 0.232x, 1024 x 256: 0.214x) and the T=2048 forward +
# backward in 0.196x (512 x 512: 0.247x, 256 x 256: 0.197x). Large query blocks amortise
# the per-visit overhead; 256-key tiles ([8, 512, 256] fp32, 4 MiB) stay in cache between
# the matmul and the elementwise passes over them.
CPU_BLOCK_Q = 512
CPU_BLOCK_K = 256
GPU_BLOCK_Q = 128
GPU_BLOCK_K = 128


def default_block_sizes(T: int, S: int, backend: Optional[str] = None, *,
                        window: Optional[tuple[int, int]] = None) -> tuple[int, int]:
  """``(block_q, block_k)`` for the platform, never larger than the sequences.

  A narrow window gets blocks of about half its span (at least 128): each
  query block then computes ~1.5x the allowed pairs instead of ~4x with
  512-blocks (measured at window=(256, 0): 128-blocks ran T=16384 in 0.6x the
  time of 512-blocks).
  """
  backend = jax.default_backend() if backend is None else backend
  bq, bk = (CPU_BLOCK_Q, CPU_BLOCK_K) if backend == "cpu" else (GPU_BLOCK_Q, GPU_BLOCK_K)
  if window is not None:
    half_span = (window[0] + window[1] + 1) // 2
    narrow = max(128, 1 << max(0, half_span.bit_length() - 1))  # power of two <= half span
    bq, bk = min(bq, narrow), min(bk, narrow)
  return min(bq, T), min(bk, S)


# ---------------------------------------------------------------------------
# Static description of one call.


@dataclasses.dataclass(frozen=True)
class _Call:
  opts: Any
  layout: BlockLayout
  mask_fn: Optional[MaskFn]
  B: int
  T: int
  S: int
  K: int
  G: int
  H: int
  Hv: int
  has_sink: bool
  has_segments: bool

  @property
  def normalizer(self) -> str:
    return "softmax" if self.has_sink else self.opts.normalizer

  @property
  def stats(self) -> bool:
    return self.opts.return_stats

  @property
  def needs_counts(self) -> bool:
    return self.opts.normalizer == "sigmoid" or self.stats

  @property
  def tracks_max(self) -> bool:
    return self.opts.normalizer in SOFTMAX_FAMILY or self.opts.normalizer == "softpick" or self.stats


def _finite(x: Array) -> Array:
  return jnp.where(jnp.isfinite(x), x, 0.0)


def _grouped5(x: Array, K: int) -> Array:
  """A rank-4 ``[Bx, Nx, Tx, Sx]`` mask/bias as ``[Bx, K|1, G|1, Tx, Sx]``."""
  Bx, Nx, Tx, Sx = x.shape
  if Nx == 1:
    return jnp.reshape(x, (Bx, 1, 1, Tx, Sx))
  return jnp.reshape(x, (Bx, K, Nx // K, Tx, Sx))


def _kslice(x: Array, k0, tk: int, axis: int) -> Array:
  """``tk`` entries from ``k0`` along ``axis``; ``k0`` is an int or, inside a loop, a traced index."""
  if isinstance(k0, int):
    return jax.lax.slice_in_dim(x, k0, k0 + tk, axis=axis)
  return jax.lax.dynamic_slice_in_dim(x, k0, tk, axis=axis)


def _tile(x: Array, q0: int, q1: int, k0, tk: int) -> Array:
  """Slices the ``[.., Tx, Sx]`` tile of a broadcastable 5-d array (size-1 axes kept)."""
  if x.shape[3] != 1:
    x = x[:, :, :, q0:q1]
  return x if x.shape[4] == 1 else _kslice(x, k0, tk, 4)


def _add_tile(acc: Array, tile: Array, starts: tuple) -> Array:
  """``acc[starts : starts + tile.shape] += tile`` (in place under XLA; starts may be traced)."""
  starts = tuple(jnp.asarray(s, jnp.int32) for s in starts)
  current = jax.lax.dynamic_slice(acc, starts, tile.shape)
  return jax.lax.dynamic_update_slice(acc, current + tile, starts)


def _rows(x: Array, G: int, tq: int) -> Array:
  """``[X, Kx, G|1, tq|1, Y]`` -> ``[X, Kx, G * tq | 1, Y]``: the kernel's row axis is (group, time).

  Every matmul of the kernel is a rank-4 batched matmul over ``(B, K)`` with all
  ``G`` query heads of a group stacked along its rows, so GQA costs no copies of
  K or V and XLA's CPU dot needs no layout changes.
  """
  X, Kx, Gx, Tx, Y = x.shape
  if Gx == 1 and Tx == 1:
    return jnp.reshape(x, (X, Kx, 1, Y))
  if G == 1:
    return jnp.reshape(x, (X, Kx, Tx, Y))
  return jnp.reshape(jnp.broadcast_to(x, (X, Kx, G, tq, Y)), (X, Kx, G * tq, Y))


def _unrows(x: Array, G: int) -> Array:
  """``[B, K, G * tq, Y]`` -> ``[B, K, G, tq, Y]``."""
  B, K, R, Y = x.shape
  return jnp.reshape(x, (B, K, G, R // G, Y))


def _and(a: Optional[Array], b: Optional[Array]) -> Optional[Array]:
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


class _Arrays:
  """The call's arrays in the kernel's layout (float32, heads grouped, time axis -2)."""

  def __init__(self, c: _Call, q, k, v, bias, sink, mask, q_seg, kv_seg):
    B, T, K, G = c.B, c.T, c.K, c.G
    q32 = jnp.transpose(jnp.reshape(q.astype(jnp.float32), (B, T, K, G, c.H)), (0, 2, 3, 1, 4))
    self.k = jnp.transpose(k.astype(jnp.float32), (0, 2, 1, 3))  # [B, K, S, H]
    self.v = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))  # [B, K, S, Hv]
    if c.opts.similarity == "dot":
      self.q = q32 * c.opts.scale  # [B, K, G, T, H]; scale folded into q once
      self.q_sq = self.k_sq = None
    else:
      self.q = q32
      self.q_sq = jnp.sum(q32 * q32, axis=-1, keepdims=True)  # [B, K, G, T, 1]
      self.k_sq = jnp.sum(self.k * self.k, axis=-1)[:, :, None, :]  # [B, K, 1, S]
    self.bias = None if bias is None else _grouped5(bias.astype(jnp.float32), K)
    self.mask = None if mask is None else _grouped5(mask, K)
    self.sink = None if sink is None else jnp.reshape(sink.astype(jnp.float32), (1, K, G, 1, 1))
    self.q_seg, self.kv_seg = q_seg, kv_seg

  def q_rows(self, c: _Call, q0: int, q1: int) -> Array:
    return _rows(self.q[:, :, :, q0:q1], c.G, q1 - q0)


def _floor(c: _Call, a: _Arrays, tq: int):
  """Lower bound of the exp shift in rows: the null column's logit (or 0 for softpick)."""
  if c.has_sink:
    return _rows(a.sink, c.G, tq)
  if c.opts.normalizer in ("softmax_one", "softpick"):
    return jnp.zeros((1, 1, 1, 1), jnp.float32)
  return None


def _shift(m: Array, floor) -> Array:
  return _finite(m if floor is None else jnp.maximum(m, floor))


def _logits(c: _Call, a: _Arrays, qb: Array, q0, q1, k0, tk):
  """Float32 logits of one tile ``[B, K, G*tq, tk]`` and the pre-bias capped similarity."""
  kb = _kslice(a.k, k0, tk, 2)
  s = jnp.einsum("bkrh,bksh->bkrs", qb, kb, preferred_element_type=jnp.float32)
  if c.opts.similarity != "dot":
    q_sq = _rows(a.q_sq[:, :, :, q0:q1], c.G, q1 - q0)
    s = -c.opts.scale * (q_sq - 2.0 * s + _kslice(a.k_sq, k0, tk, 3))
  if c.opts.softcap is not None:
    s = c.opts.softcap * jnp.tanh(s / c.opts.softcap)
  capped = s
  if a.bias is not None:
    s = s + _rows(_tile(a.bias, q0, q1, k0, tk), c.G, q1 - q0)
  return s, capped


def _allowed(c: _Call, a: _Arrays, q0, q1, k0, tk, needs_mask: bool, seg_mask: bool):
  """Boolean ``[B|1, K|1, G*tq|1, tk]`` of the tile, or None when all is allowed."""
  out = None  # built as [X, K|1, G|1, tq, tk], then laid out as rows
  tq = q1 - q0
  if needs_mask and c.mask_fn is not None:  # k0 is traced inside the loop over key blocks
    m = c.mask_fn(jnp.arange(q0, q1), k0 + jnp.arange(tk))
    if m is not None:
      out = jnp.reshape(m, (m.shape[0], 1, 1, tq, tk))
  if seg_mask:
    seg = a.q_seg[:, q0:q1, None] == _kslice(a.kv_seg, k0, tk, 1)[:, None, :]
    out = _and(out, jnp.reshape(seg, (c.B, 1, 1, tq, tk)))
  if a.mask is not None:
    out = _and(out, _tile(a.mask, q0, q1, k0, tk))
  return None if out is None else _rows(out, c.G, tq)


def _segment_relations(c: _Call, a: _Arrays):
  table = segment_block_relations(a.q_seg, a.kv_seg, c.layout)
  return lambda i, j: table[i, j]


# A query block's unmasked visits to full-size key blocks run in a lax.fori_loop once there are
# more than this many (keeps the program, and its compile time, O(number of query blocks));
# fewer are unrolled, which lets XLA schedule them freely.
MAX_UNROLLED_FULL_VISITS = 2


def _visit_blocks(c: _Call, relation, i: int, carry, visit):
  """Folds ``visit(carry, k0, tk, needs_mask, seg_mask, first)`` over query block ``i``'s visits.

  When more than ``MAX_UNROLLED_FULL_VISITS`` visits are unmasked, every visit
  to a full-size key block (other than block 0 when statistics are asked for:
  its first column feeds ``sink_mass``) runs in one ``lax.fori_loop`` with a
  traced ``k0`` and a ``lax.cond`` on ``needs_mask`` (unmasked blocks evaluate
  no mask). One loop body per query block keeps the program small and lets
  XLA reuse one set of tile buffers (unrolled visits each got their own).
  Ragged key blocks, and every visit of short rows, are unrolled.
  With segment ids each visit is wrapped in ``lax.switch`` on the run-time
  block relation: a block whose query and key segments cannot meet costs a few
  scalar comparisons (only the chosen branch runs), and a block inside one
  segment pays no segment comparison.
  """
  L = c.layout
  visits = L.visits(i)
  looped = [(j, nm) for j, nm in visits
            if (j != 0 or not c.stats) and L.kv_range(j)[1] - L.kv_range(j)[0] == L.block_k]
  if sum(not nm for _, nm in looped) <= MAX_UNROLLED_FULL_VISITS:
    looped = []
  unrolled = [(j, nm) for j, nm in visits if (j, nm) not in looped]

  def one(carry, j, k0, tk, needs_mask, first):
    def body(seg_mask):
      return visit(carry, k0, tk, needs_mask, seg_mask, first)
    if not c.has_segments:
      return body(False)
    return jax.lax.switch(relation(i, j),
                          [lambda: carry, lambda: body(False), lambda: body(True)])

  if looped:
    kv_blocks = jnp.asarray([j for j, _ in looped], jnp.int32)
    flags = jnp.asarray([nm for _, nm in looped], bool)
    any_masked = any(nm for _, nm in looped)

    def step(n, carry):
      j = kv_blocks[n]
      k0 = j * L.block_k
      if not any_masked:
        return one(carry, j, k0, L.block_k, False, False)
      # One loop body for the masked and the unmasked visits: only the taken branch runs.
      return jax.lax.cond(flags[n], lambda: one(carry, j, k0, L.block_k, True, False),
                          lambda: one(carry, j, k0, L.block_k, False, False))

    carry = jax.lax.fori_loop(0, len(looped), step, carry)
  for j, needs_mask in unrolled:
    k0, k1 = L.kv_range(j)
    carry = one(carry, j, k0, k1 - k0, needs_mask, k0 == 0)
  return carry


# ---------------------------------------------------------------------------
# Mask-only pre-pass: number of allowed keys per row.


def _allowed_counts(c: _Call, a: _Arrays, relation) -> Array:
  """``[B, K, G, T, 1]`` float32 number of allowed keys of each row."""
  L = c.layout
  per_block = []
  for i in range(L.num_q_blocks):
    q0, q1 = L.q_range(i)
    shape = (c.B, c.K, c.G * (q1 - q0), 1)

    def visit(total, k0, tk, needs_mask, seg_mask, first, q0=q0, q1=q1, shape=shape):
      del first
      allowed = _allowed(c, a, q0, q1, k0, tk, needs_mask, seg_mask)
      if allowed is None:
        return total + float(tk)
      return total + jnp.broadcast_to(
          jnp.sum(allowed, axis=-1, keepdims=True, dtype=jnp.float32), shape)

    total = _visit_blocks(c, relation, i, jnp.zeros(shape, jnp.float32), visit)
    per_block.append(_unrows(total, c.G))
  return jnp.concatenate(per_block, axis=3)


# ---------------------------------------------------------------------------
# Forward.


def _init_state(c: _Call, rows: int) -> dict:
  r = (c.B, c.K, rows, 1)
  st = {"acc": jnp.zeros((c.B, c.K, rows, c.Hv), jnp.float32)}
  if c.tracks_max:
    st["m"] = jnp.full(r, -jnp.inf, jnp.float32)
  nz = c.normalizer
  if nz in SOFTMAX_FAMILY:
    st["l"] = jnp.zeros(r, jnp.float32)
  if nz == "softpick":
    st["dn"] = jnp.zeros(r, jnp.float32)
  if c.stats:
    if nz not in SOFTMAX_FAMILY:
      st["l"] = jnp.zeros(r, jnp.float32)  # plain logsumexp for the statistic
    st["h1"] = jnp.zeros(r, jnp.float32)  # sum of |weights| (up to the shift)
    st["h2"] = jnp.zeros(r, jnp.float32)  # sum of w log w (entropy)
    st["z0"] = jnp.full(r, -jnp.inf, jnp.float32)  # logit of key 0 where allowed
    if nz == "none":
      st["rs"] = jnp.zeros(r, jnp.float32)
  return st


def _plogp(w: Array) -> Array:
  return jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0)


def _fwd_visit(c: _Call, a: _Arrays, st: dict, qb, q0, q1, k0, tk, needs_mask, seg_mask,
               first, floor, sig_bias) -> dict:
  z, _ = _logits(c, a, qb, q0, q1, k0, tk)
  allowed = _allowed(c, a, q0, q1, k0, tk, needs_mask, seg_mask)
  zm = z if allowed is None else jnp.where(allowed, z, -jnp.inf)
  vb = _kslice(a.v, k0, tk, 2)
  nz = c.normalizer
  st = dict(st)

  def pv(w):
    return jnp.einsum("bkrs,bksh->bkrh", w, vb, preferred_element_type=jnp.float32)

  if c.tracks_max:
    m_old = st["m"]
    m_new = jnp.maximum(m_old, jnp.max(zm, axis=-1, keepdims=True))
    st["m"] = m_new

  if nz in SOFTMAX_FAMILY:
    s_new = _shift(m_new, floor)
    s_old_raw = m_old if floor is None else jnp.maximum(m_old, floor)
    alpha = jnp.exp(s_old_raw - s_new)
    e = jnp.exp(zm - s_new)
    l_old = st["l"]
    st["l"] = alpha * l_old + jnp.sum(e, axis=-1, keepdims=True)
    st["acc"] = alpha * st["acc"] + pv(e)
    if c.stats:
      st["h2"] = alpha * (st["h2"] + (_finite(s_old_raw) - s_new) * l_old) + jnp.sum(
          e * (z - s_new), axis=-1, keepdims=True)
  elif nz == "softpick":
    s_old, s_new = jnp.maximum(m_old, 0.0), jnp.maximum(m_new, 0.0)
    alpha = jnp.exp(s_old - s_new)
    e = jnp.exp(zm - s_new)
    centred = e - jnp.exp(-s_new)
    if allowed is not None:
      centred = jnp.where(allowed, centred, 0.0)
    u = jnp.maximum(centred, 0.0)
    st["dn"] = alpha * st["dn"] + jnp.sum(jnp.abs(centred), axis=-1, keepdims=True)
    st["acc"] = alpha * st["acc"] + pv(u)
    if c.stats:
      h1_old = st["h1"]
      st["h1"] = alpha * h1_old + jnp.sum(u, axis=-1, keepdims=True)
      st["h2"] = alpha * (st["h2"] + (s_old - s_new) * h1_old) + jnp.sum(
          _plogp(u), axis=-1, keepdims=True)
  elif nz == "sigmoid":
    w = jax.nn.sigmoid(z + sig_bias)
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
    st["acc"] = st["acc"] + pv(w)
    if c.stats:
      st["h1"] = st["h1"] + jnp.sum(w, axis=-1, keepdims=True)
      st["h2"] = st["h2"] + jnp.sum(_plogp(w), axis=-1, keepdims=True)
  else:  # none
    w = z if allowed is None else jnp.where(allowed, z, 0.0)
    st["acc"] = st["acc"] + pv(w)
    if c.stats:
      mag = jnp.abs(w)
      st["h1"] = st["h1"] + jnp.sum(mag, axis=-1, keepdims=True)
      st["h2"] = st["h2"] + jnp.sum(_plogp(mag), axis=-1, keepdims=True)
      st["rs"] = st["rs"] + jnp.sum(w, axis=-1, keepdims=True)

  if c.stats and nz not in SOFTMAX_FAMILY:  # plain logsumexp of the allowed logits
    s_new = _finite(m_new)
    st["l"] = jnp.exp(m_old - s_new) * st["l"] + jnp.sum(
        jnp.exp(zm - s_new), axis=-1, keepdims=True)
  if c.stats and first:
    st["z0"] = zm[..., 0:1]
  return st


def _finish_block(c: _Call, st: dict, floor, sig_bias, counts):
  """Output rows of one query block, its backward residual rows and its statistics rows."""
  nz = c.normalizer
  res = {}
  stats = {}
  if nz in SOFTMAX_FAMILY:
    s = _shift(st["m"], floor)
    denom = st["l"] if floor is None else st["l"] + jnp.exp(floor - s)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = st["acc"] / safe
    res["log_norm"] = s + jnp.log(safe)
    lse = res["log_norm"]
  elif nz == "softpick":
    s = jnp.maximum(st["m"], 0.0)
    denom = st["dn"] + normalizers.SOFTPICK_EPS * jnp.exp(-s)
    out = st["acc"] / denom
    res["log_norm"] = s + jnp.log(denom)
  else:
    out = st["acc"]
  if c.stats:
    has_key = counts > 0
    if nz in SOFTMAX_FAMILY:
      mass = st["l"]
      safe_mass = jnp.where(mass > 0, mass, 1.0)
      p0 = jnp.exp(st["z0"] - s) / safe_mass
      ent = jnp.log(safe_mass) - st["h2"] / safe_mass
      row_sum = mass / safe
    else:
      ms = _finite(st["m"])
      lse = ms + jnp.log(jnp.where(st["l"] > 0, st["l"], 1.0))
      lse = jnp.where(st["l"] > 0, lse, -jnp.inf)
      mass = st["h1"]
      safe_mass = jnp.where(mass > 0, mass, 1.0)
      ent = jnp.log(safe_mass) - st["h2"] / safe_mass
      if nz == "softpick":
        w0 = jnp.maximum(jnp.exp(st["z0"] - s) - jnp.exp(-s), 0.0)
        row_sum = mass / denom
      elif nz == "sigmoid":
        w0 = jnp.where(jnp.isfinite(st["z0"]), jax.nn.sigmoid(_finite(st["z0"]) + sig_bias), 0.0)
        row_sum = mass
      else:
        w0 = jnp.where(jnp.isfinite(st["z0"]), jnp.abs(_finite(st["z0"])), 0.0)
        row_sum = st["rs"]
      p0 = w0 / safe_mass
    lse = jnp.where(jnp.logical_and(has_key, jnp.isfinite(lse)), lse, 0.0)
    res["lse"] = lse
    shape = out.shape[:3] + (1,)
    stats = {key: jnp.broadcast_to(val, shape) for key, val in dict(
        normalisable=jnp.logical_and(has_key, mass > 0), has_key=has_key, entropy=ent, p0=p0,
        row_max=st["m"], lse=lse, row_sum=row_sum).items()}
  return out, res, stats


def _forward(c: _Call, a: _Arrays):
  """Returns ``out [B, K, G, T, Hv]``, residual rows (``[B, K, G, T, 1]``) and statistics."""
  L = c.layout
  G = c.G
  relation = _segment_relations(c, a) if c.has_segments else None
  counts = _allowed_counts(c, a, relation) if c.needs_counts else None
  sig_bias = None
  if c.opts.normalizer == "sigmoid":
    sig_bias = -jnp.log(jnp.maximum(counts, 1.0))
  outs, residuals, stats_rows = [], [], []
  for i in range(L.num_q_blocks):
    q0, q1 = L.q_range(i)
    tq = q1 - q0
    floor = _floor(c, a, tq)
    qb = a.q_rows(c, q0, q1)
    if outs:
      # Query block i starts after block i-1 is done: otherwise XLA may schedule the
      # independent blocks side by side and keep all their tiles alive at once.
      qb, _ = jax.lax.optimization_barrier((qb, outs[-1]))
    sb = None if sig_bias is None else _rows(sig_bias[:, :, :, q0:q1], G, tq)

    def visit(st, k0, tk, needs_mask, seg_mask, first, q0=q0, q1=q1, sb=sb, qb=qb, floor=floor):
      return _fwd_visit(c, a, st, qb, q0, q1, k0, tk, needs_mask, seg_mask, first, floor, sb)

    st = _visit_blocks(c, relation, i, _init_state(c, G * tq), visit)
    cb = None if counts is None else _rows(counts[:, :, :, q0:q1], G, tq)
    out, res, srow = _finish_block(c, st, floor, sb, cb)
    outs.append(_unrows(out, G))
    residuals.append({key: _unrows(val, G) for key, val in res.items()})
    stats_rows.append({key: _unrows(val, G) for key, val in srow.items()})
  out = jnp.concatenate(outs, axis=3)
  res = {key: jnp.concatenate([r[key] for r in residuals], axis=3) for key in residuals[0]}
  if sig_bias is not None:
    res["sig_bias"] = sig_bias
  stats = None
  if c.stats:
    res["has_key"] = counts > 0
    stats = _collect_stats(c, stats_rows)
  return out, res, stats


def _to_bnt(c: _Call, x: Array) -> Array:
  """``[Bx, Kx, Gx, T, 1]`` rows -> ``[B, N, T]``."""
  x = jnp.broadcast_to(x, (c.B, c.K, c.G, c.T, 1))
  return jnp.reshape(x, (c.B, c.K * c.G, c.T))


def _collect_stats(c: _Call, rows: list[dict]) -> tuple:
  cat = {key: _to_bnt(c, jnp.concatenate([r[key] for r in rows], axis=3)) for key in rows[0]}
  later = (jnp.arange(c.T) >= 1)[None, None, :]
  entropy = _row_mean(cat["entropy"], cat["normalisable"])
  sink_mass = _row_mean(cat["p0"], jnp.logical_and(cat["normalisable"], later))
  zmax = jnp.max(cat["row_max"], axis=-1)
  max_logit = jnp.where(jnp.isfinite(zmax), zmax, 0.0)
  row_sum = _row_mean(cat["row_sum"], cat["has_key"])
  return sink_mass, entropy, max_logit, cat["lse"], row_sum


# ---------------------------------------------------------------------------
# Backward: recompute each visited block.


def _backward(c: _Call, a: _Arrays, res: dict, out: Array, d_out: Array, d_lse: Optional[Array]):
  """Gradients ``(dq [B, K, G, T, H], dk [B, K, S, H], dv, dbias, dsink)`` from the residuals."""
  L = c.layout
  G = c.G
  nz = c.normalizer
  relation = _segment_relations(c, a) if c.has_segments else None
  # D_i = <dO_i, O_i>: the softmax-family row term (and softpick's denominator term).
  row_dot = jnp.sum(d_out * out, axis=-1, keepdims=True)  # [B, K, G, T, 1]
  g = None
  if d_lse is not None:
    g = jnp.where(res["has_key"], d_lse, 0.0)

  dk = jnp.zeros((c.B, c.K, c.S, c.H), jnp.float32)
  dv = jnp.zeros((c.B, c.K, c.S, c.Hv), jnp.float32)
  dbias = None if a.bias is None else jnp.zeros(a.bias.shape, jnp.float32)
  dq_blocks = []
  dsink = None

  def rows(x, q0, q1):
    return None if x is None else _rows(x[:, :, :, q0:q1], G, q1 - q0)

  for i in range(L.num_q_blocks):
    q0, q1 = L.q_range(i)
    qb = a.q_rows(c, q0, q1)
    do_b = rows(d_out, q0, q1)
    # One query block at a time (see _forward): its inputs wait for the previous block's updates.
    qb, do_b, dk, dv = jax.lax.optimization_barrier((qb, do_b, dk, dv))
    rd_b = rows(row_dot, q0, q1)
    g_b = rows(g, q0, q1)
    ln_b = rows(res.get("log_norm"), q0, q1)
    lse_b = rows(res["lse"], q0, q1) if (c.stats and nz not in SOFTMAX_FAMILY) else None
    sb = rows(res.get("sig_bias"), q0, q1)
    if c.has_sink:
      w_null = jnp.exp(_floor(c, a, q1 - q0) - ln_b)
      term = _unrows(w_null * ((0.0 if g_b is None else g_b) - rd_b), G)
      dsink = (0.0 if dsink is None else dsink) + jnp.sum(term, axis=(0, 3, 4), keepdims=True)

    def visit(carry, k0, tk, needs_mask, seg_mask, first, q0=q0, q1=q1, qb=qb, do_b=do_b,
              rd_b=rd_b, g_b=g_b, ln_b=ln_b, lse_b=lse_b, sb=sb):
      del first
      dq_b, dk, dv, dbias = carry
      d = _bwd_visit(c, a, qb, q0, q1, k0, tk, needs_mask, seg_mask, do_b, rd_b, g_b, ln_b,
                     lse_b, sb)
      dk = _add_tile(dk, d["dk"], (0, 0, k0, 0))
      dv = _add_tile(dv, d["dv"], (0, 0, k0, 0))
      if dbias is not None:
        dbias = _add_tile(dbias, d["dbias"], (0, 0, 0, q0 if dbias.shape[3] != 1 else 0,
                                              k0 if dbias.shape[4] != 1 else 0))
      return dq_b + d["dq"], dk, dv, dbias

    dq_b = jnp.zeros((c.B, c.K, G * (q1 - q0), c.H), jnp.float32)
    dq_b, dk, dv, dbias = _visit_blocks(c, relation, i, (dq_b, dk, dv, dbias), visit)
    dq_blocks.append(_unrows(dq_b, G))

  dq = jnp.concatenate(dq_blocks, axis=3)
  if c.opts.similarity == "dot":
    dq = dq * c.opts.scale
  return dq, dk, dv, dbias, dsink


def _bwd_visit(c: _Call, a: _Arrays, qb, q0, q1, k0, tk, needs_mask, seg_mask, do_b, rd_b, g_b,
               ln_b, lse_b, sb) -> dict:
  nz = c.normalizer
  z, capped = _logits(c, a, qb, q0, q1, k0, tk)
  allowed = _allowed(c, a, q0, q1, k0, tk, needs_mask, seg_mask)
  zm = z if allowed is None else jnp.where(allowed, z, -jnp.inf)
  kb = _kslice(a.k, k0, tk, 2)
  vb = _kslice(a.v, k0, tk, 2)
  dp = jnp.einsum("bkrh,bksh->bkrs", do_b, vb, preferred_element_type=jnp.float32)

  if nz in SOFTMAX_FAMILY:
    w = jnp.exp(zm - ln_b)
    row = rd_b if g_b is None else rd_b - g_b
    dz = w * (dp - row)
  elif nz == "softpick":
    scaled = jnp.exp(zm - ln_b)  # e^z / (sum |e^z - 1| + eps)
    w = jnp.maximum(scaled - jnp.exp(-ln_b), 0.0)
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
    dz = scaled * (jnp.where(z > 0, dp, 0.0) - rd_b * jnp.sign(z))
  elif nz == "sigmoid":
    w = jax.nn.sigmoid(z + sb)
    if allowed is not None:
      w = jnp.where(allowed, w, 0.0)
    dz = dp * w * (1.0 - w)
  else:
    w = z if allowed is None else jnp.where(allowed, z, 0.0)
    dz = dp if allowed is None else jnp.where(allowed, dp, 0.0)
  if g_b is not None and nz not in SOFTMAX_FAMILY:
    dz = dz + g_b * jnp.exp(zm - lse_b)

  d = {"dv": jnp.einsum("bkrs,bkrh->bksh", w, do_b, preferred_element_type=jnp.float32)}
  if a.bias is not None:
    shape = _tile(a.bias, q0, q1, k0, tk).shape
    dz5 = _unrows(dz, c.G)
    axes = tuple(ax for ax in range(5) if shape[ax] == 1 and dz5.shape[ax] != 1)
    d["dbias"] = jnp.sum(dz5, axis=axes, keepdims=True) if axes else dz5
  ds = dz
  if c.opts.softcap is not None:
    t = capped / c.opts.softcap
    ds = ds * (1.0 - t * t)
  dq = jnp.einsum("bkrs,bksh->bkrh", ds, kb, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkrs,bkrh->bksh", ds, qb, preferred_element_type=jnp.float32)
  if c.opts.similarity != "dot":
    f = -2.0 * c.opts.scale
    dq = f * (qb * jnp.sum(ds, axis=-1, keepdims=True) - dq)
    col = jnp.sum(ds, axis=2)[..., None]  # [B, K, tk, 1]
    dk = f * (kb * col - dk)
  d["dq"], d["dk"] = dq, dk
  return d


# ---------------------------------------------------------------------------
# The kernel with its custom VJP.


def attention(inputs, opts, *, layout: BlockLayout, mask_fn: Optional[MaskFn] = None,
              use_default_mask_fn: bool = True):
  """Block-wise attention of a validated dense call over a static :class:`BlockLayout`.

  Args:
    inputs: :class:`attnjax._call.DenseInputs` (from ``dense.prepare``).
    opts: :class:`attnjax._call.DenseOptions`.
    layout: which key blocks each query block visits (see the module docstring).
    mask_fn: ``(q_positions [tq], k_positions [tk]) -> bool [B|1, 1, tq, tk]`` or None,
      evaluated on visits flagged ``needs_mask``. If None and
      ``use_default_mask_fn``, :func:`structural_mask_fn` of ``opts``.
    use_default_mask_fn: False makes ``mask_fn=None`` mean "no static mask".

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)`` when
    ``opts.return_stats``.
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  if (layout.q_len, layout.kv_len) != (T, S):
    raise ValueError(
        f"layout is for q_len={layout.q_len}, kv_len={layout.kv_len} but the call has "
        f"T={T}, S={S} (q {tuple(q.shape)}, k {tuple(k.shape)})")
  if mask_fn is None and use_default_mask_fn:
    mask_fn = structural_mask_fn(opts)
  G = N // K
  c = _Call(opts=opts, layout=layout, mask_fn=mask_fn, B=B, T=T, S=S, K=K, G=G, H=H, Hv=Hv,
            has_sink=inputs.sink_logits is not None,
            has_segments=inputs.q_segment_ids is not None)

  def to_output(o):
    o = jnp.transpose(o, (0, 3, 1, 2, 4))  # [B, T, K, G, Hv]
    return jnp.reshape(o, (B, T, N, Hv)).astype(q.dtype)

  @jax.custom_vjp
  def core(q, k, v, bias, sink, mask, q_seg, kv_seg):
    return fwd(q, k, v, bias, sink, mask, q_seg, kv_seg)[0]

  def fwd(q, k, v, bias, sink, mask, q_seg, kv_seg):
    a = _Arrays(c, q, k, v, bias, sink, mask, q_seg, kv_seg)
    out, res, stats = _forward(c, a)
    return (to_output(out), stats), (q, k, v, bias, sink, mask, q_seg, kv_seg, out, res)

  def bwd(saved, cts):
    q, k, v, bias, sink, mask, q_seg, kv_seg, out, res = saved
    d_out, d_stats = cts
    a = _Arrays(c, q, k, v, bias, sink, mask, q_seg, kv_seg)
    d_out = jnp.transpose(jnp.reshape(d_out.astype(jnp.float32), (B, T, K, G, Hv)),
                          (0, 2, 3, 1, 4))
    d_lse = None
    if d_stats is not None:
      d_lse = jnp.reshape(d_stats[3].astype(jnp.float32), (B, K, G, T, 1))
    dq, dk, dv, dbias, dsink = _backward(c, a, res, out, d_out, d_lse)
    dq = jnp.reshape(jnp.transpose(dq, (0, 3, 1, 2, 4)), (B, T, N, H)).astype(q.dtype)
    dk = jnp.transpose(dk, (0, 2, 1, 3)).astype(k.dtype)
    dv = jnp.transpose(dv, (0, 2, 1, 3)).astype(v.dtype)
    if dbias is not None:
      dbias = jnp.reshape(dbias, bias.shape).astype(bias.dtype)
    if dsink is not None:
      dsink = jnp.reshape(dsink, sink.shape).astype(sink.dtype)
    return dq, dk, dv, dbias, dsink, None, None, None

  core.defvjp(fwd, bwd)
  out, stats = core(q, k, v, inputs.bias, inputs.sink_logits, inputs.mask,
                    inputs.q_segment_ids, inputs.kv_segment_ids)
  if not opts.return_stats:
    return out
  sink_mass, entropy, max_logit, lse, row_sum = stats
  return out, AttentionStats(sink_mass=sink_mass, entropy=entropy, max_logit=max_logit,
                             logsumexp=lse, row_sum=row_sum)


# ---------------------------------------------------------------------------
# Dense registry entry and a public function with explicit block sizes.


def unsupported(inputs, opts) -> list[str]:
  """Reasons the block-wise path cannot run a call: none, every dense option is block-wise."""
  del inputs, opts
  return []


def blockwise(inputs, opts, *, block_q: Optional[int] = None, block_k: Optional[int] = None):
  """The ``implementation="blockwise"`` entry of :data:`attnjax.dense.IMPLEMENTATIONS`."""
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  dq, dk = default_block_sizes(T, S, window=opts.window)
  block_q = dq if block_q is None else min(block_q, T)
  block_k = dk if block_k is None else min(block_k, S)
  layout = structural_layout(T, S, block_q, block_k, is_causal=opts.is_causal, window=opts.window)
  return attention(inputs, opts, layout=layout)


def _check_block(name: str, value: Optional[int]) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _dot_product_attention(q, k, v, *, block_q: Optional[int] = None,
                           block_k: Optional[int] = None, **kwargs):
  """:func:`attnjax.dot_product_attention` on the block-wise path with chosen block sizes.

  Args:
    q, k, v: as :func:`attnjax.dot_product_attention`.
    block_q: query rows per block (None: :func:`default_block_sizes`).
    block_k: keys per block (None: :func:`default_block_sizes`).
    **kwargs: every other keyword of :func:`attnjax.dot_product_attention`
      except ``implementation``.

  Returns:
    As :func:`attnjax.dot_product_attention`.
  """
  _check_block("block_q", block_q)
  _check_block("block_k", block_k)
  if "implementation" in kwargs:
    raise TypeError("blockwise.dot_product_attention takes no implementation argument")
  inputs, opts = _call.validate(q, k, v, **kwargs)
  return blockwise(inputs, opts, block_q=block_q, block_k=block_k)


dot_product_attention = jax.jit(
    _dot_product_attention,
    static_argnames=("block_q", "block_k", "is_causal", "scale", "normalizer", "softcap",
                     "window", "similarity", "return_stats"))
dot_product_attention.__doc__ = _dot_product_attention.__doc__
