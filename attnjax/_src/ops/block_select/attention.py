"""Content-selected block-sparse attention (MoBA, Lu et al. 2025; NSA's selection branch).

Implementation behind the public module :mod:`attnjax.block_select`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional, get_args

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import options, validators, empty, logits, op, static, normalizers
from attnjax._src.ops.dense import attention as dense
from attnjax._src.attention_stats import AttentionStats, row_mean

Array = jnp.ndarray

QueryPool = Literal["mean", "first"]
QUERY_POOLS: tuple[str, ...] = get_args(QueryPool)
# The dense keywords block_select_attention takes and forwards (attnjax._src.options.KEYWORDS):
# the selection stands for a mask, window and modifiers, and for bias (no [T, S] logits).
DENSE_KEYWORDS = options.keywords(
  without=(
    "bias",
    "mask",
    "window",
    "score_mod",
    "score_mod_args",
    "mask_mod",
    "mask_mod_args",
    "block_layout",
    "context_axis",
    "context_strategy",
    "context_layout",
  )
)


def _pad_to(x: Array, length: int, axis: int = 1, value=0) -> Array:
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _pooled(x: Array, block_size: int) -> Array:
  """Mean over each block of ``x [B, L, ...]`` -> float32 ``[B, nb, ...]`` (partial last block)."""
  L = x.shape[1]
  nb = -(-L // block_size)
  xp = _pad_to(x.astype(jnp.float32), nb * block_size)
  sums = jnp.sum(jnp.reshape(xp, (x.shape[0], nb, block_size) + x.shape[2:]), axis=2)
  counts = jnp.minimum(L - block_size * jnp.arange(nb), block_size).astype(jnp.float32)
  return sums / jnp.reshape(counts, (1, nb) + (1,) * (x.ndim - 2))


def num_slots(length: int, block_size: int, top_k: int) -> int:
  """Selected blocks per query block besides its own: ``min(top_k, blocks - 1)``.

  Args:
    length: ``T``.
    block_size: tokens per block.
    top_k: blocks asked for.

  Returns:
    The number of selection slots (0 with a single block).
  """
  return max(0, min(top_k, -(-length // block_size) - 1))


def block_scores(q_pooled: Array, k_pooled: Array) -> Array:
  """Block scores: pooled query times mean key, summed over the query heads of a KV group.

  Args:
    q_pooled: ``[B, nq, N, H]`` one pooled query per query block.
    k_pooled: ``[B, nk, K, H]`` the mean key of each key block.

  Returns:
    float32 ``[B, K, nq, nk]``, with no gradient (the selection is discrete).
  """
  B, nq, N, H = q_pooled.shape
  K = k_pooled.shape[2]
  qg = jnp.reshape(q_pooled.astype(jnp.float32), (B, nq, K, N // K, H))
  s = jnp.einsum("bikgh,bjkh->bkij", qg, k_pooled.astype(jnp.float32))
  return jax.lax.stop_gradient(s)


def top_blocks(scores: Array, candidate: Array, top_k: int) -> Array:
  """The best candidate blocks of each query block, in ascending order.

  Args:
    scores: ``[..., nq, nk]``.
    candidate: boolean, broadcastable to ``scores``: which blocks may be chosen.
    top_k: blocks to keep; ``top_k' = min(top_k, nk - 1)`` slots are returned.

  Returns:
    int32 ``[..., nq, top_k']``: block indices, ascending, -1 in slots with no candidate
    left; ties go to the lower block index.
  """
  nk = scores.shape[-1]
  ks = max(0, min(top_k, nk - 1))
  if ks == 0:
    return jnp.zeros(scores.shape[:-1] + (0,), jnp.int32)
  masked = jnp.where(candidate, scores, -jnp.inf)
  best, idx = jax.lax.top_k(masked, ks)
  idx = jnp.where(jnp.isneginf(best), nk, idx.astype(jnp.int32))
  idx = jnp.sort(idx, axis=-1)
  return jnp.where(idx == nk, -1, idx)


def _selection(
  q: Array, k: Array, block_size: int, top_k: int, is_causal: bool, query_pool: str
) -> Array:
  """int32 ``[B, K, nqb, top_k']`` selected key blocks of each query block (-1 = none)."""
  T = q.shape[1]
  nb = -(-T // block_size)
  if query_pool == "mean":
    q_pooled = _pooled(q, block_size)
  else:
    q_pooled = q[:, ::block_size].astype(jnp.float32)
  scores = block_scores(q_pooled, _pooled(k, block_size))
  i, j = jnp.arange(nb)[:, None], jnp.arange(nb)[None, :]
  candidate = j < i if is_causal else j != i
  return top_blocks(scores, candidate[None, None], top_k)


def _select_blocks(
  q: Array,
  k: Array,
  *,
  block_size: int,
  top_k: int,
  is_causal: bool = True,
  query_pool: Optional[QueryPool] = None,
) -> Array:
  """The blocks :func:`.block_select_attention` keeps besides each query block's own.

  Args:
    q: ``[B, T, N, H]``.
    k: ``[B, T, K, H]``.
    block_size: tokens per block.
    top_k: key blocks per query block besides its own.
    is_causal: only strictly earlier key blocks are candidates.
    query_pool: ``"first"`` (a block's first query; the only choice when causal) or
      ``"mean"``; None picks ``"first"`` when causal, else ``"mean"``.

  Returns:
    int32 ``[B, K, ceil(T / block_size), top_k]``: per batch, KV head and query
    block, the selected key block indices in ascending order, -1 in unused
    slots (fewer candidates than ``top_k``).
  """
  query_pool = _check_static(q, k, block_size, top_k, query_pool, is_causal)
  sel = _selection(q, k, block_size, top_k, is_causal, query_pool)
  return _pad_to(sel, top_k, axis=3, value=-1)


select_blocks = static.jit(_select_blocks, ("block_size", "top_k", "is_causal", "query_pool"))


def _check_static(q, k, block_size, top_k, query_pool, is_causal) -> str:
  """Checks the static options; returns the query pool (None: "first" if causal, else "mean")."""
  validators.check_positive_int("block_size", block_size)
  validators.check_positive_int("top_k", top_k, minimum=0)
  if query_pool is None:
    query_pool = "first" if is_causal else "mean"
  validators.check_choice("query_pool", query_pool, QUERY_POOLS)
  if is_causal and query_pool == "mean":
    raise ValueError(
      "query_pool='mean' with is_causal=True: a block's mean query includes its "
      "later queries, so the blocks an early query sees would depend on future "
      "tokens; use query_pool='first' (the default when causal)"
    )
  T, S = validators.shape_of(q)[1], validators.shape_of(k)[1]
  if T != S:
    raise ValueError(
      f"block_select_attention is self-attention: q and k need the same length, "
      f"got q {validators.shape_of(q)} and k {validators.shape_of(k)}"
    )
  return query_pool


def selection_mask(sel: Array, T: int, block_size: int, num_heads: int) -> Array:
  """The dense mask of a selection: the query's block selected the key's block, or they
  are the same block.

  Causality is not applied here (the caller's ``is_causal`` does that).

  Args:
    sel: int32 ``[B, K, blocks, slots]`` from :func:`.select_blocks` (-1 = none).
    T: sequence length.
    block_size: tokens per block.
    num_heads: ``N`` (each KV head's selection serves its ``N // K`` query heads).

  Returns:
    bool ``[B, N, T, T]``.
  """
  B, K, nb, _ = sel.shape
  blocks = jnp.arange(nb)
  chosen = jnp.any(sel[..., None] == blocks[None, None, None, None], axis=3)  # [B, K, nbq, nbk]
  chosen = jnp.logical_or(chosen, jnp.eye(nb, dtype=bool)[None, None])
  pos_block = jnp.arange(T) // block_size
  mask = chosen[:, :, pos_block][:, :, :, pos_block]  # [B, K, T, T]
  return jnp.repeat(mask, num_heads // K, axis=1)


# ---------------------------------------------------------------------------
# Implementations.


def _reference(
  inputs: options.DenseInputs, opts: options.DenseOptions, sel: Array, block_size: int
):
  """The ``"reference"`` engine: the selection's mask through :func:`attnjax.dense.reference`."""
  T, N = inputs.q.shape[1], inputs.q.shape[2]
  mask = selection_mask(sel, T, block_size, N)
  return dense.reference(dataclasses.replace(inputs, mask=mask), opts)


def _row_stats(z, w, allowed, log_norm, key0):
  """Per-row pieces of :func:`attnjax.attention_stats.stats_from_weights` ``[B, N, R]``."""
  allowed = jnp.broadcast_to(allowed, z.shape)
  has_key = jnp.any(allowed, axis=-1)
  mag = jnp.abs(w)
  total = jnp.sum(mag, axis=-1, keepdims=True)
  p = mag / jnp.where(total > 0, total, 1.0)
  normalisable = jnp.logical_and(has_key, total[..., 0] > 0)
  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  lse = log_norm[..., 0]
  return dict(
    has_key=has_key,
    normalisable=normalisable,
    entropy=-jnp.sum(plogp, axis=-1),
    p0=jnp.sum(jnp.where(key0, p, 0.0), axis=-1),
    zmax=jnp.max(jnp.where(allowed, z, -jnp.inf), axis=-1),
    lse=jnp.where(jnp.logical_and(has_key, jnp.isfinite(lse)), lse, 0.0),
    row_sum=jnp.sum(w, axis=-1),
  )


def _reduce_stats(r: dict) -> AttentionStats:
  T = r["lse"].shape[-1]
  later = (jnp.arange(T) >= 1)[None, None, :]
  zmax = jnp.max(r["zmax"], axis=-1)
  return AttentionStats(
    sink_mass=row_mean(r["p0"], jnp.logical_and(r["normalisable"], later)),
    entropy=row_mean(r["entropy"], r["normalisable"]),
    max_logit=jnp.where(jnp.isfinite(zmax), zmax, 0.0),
    logsumexp=r["lse"],
    row_sum=row_mean(r["row_sum"], r["has_key"]),
  )


def _tile_logits(opts: options.DenseOptions, qb: Array, q_sq: Optional[Array], kg: Array) -> Array:
  """Float32 logits ``[B, K, R, L]`` of query rows ``qb [B, K, R, H]`` against ``kg [B, K, L, H]``.

  With ``similarity="dot"`` the scale is already folded into ``qb``; otherwise
  ``q_sq`` holds the rows' squared norms. Then the softcap (``attnjax._src.logits``).
  """
  dots = jnp.einsum("bkrh,bklh->bkrl", qb, kg, preferred_element_type=jnp.float32)
  if q_sq is not None:
    dots = logits.from_dots(
      dots,
      scale=opts.scale,
      similarity=opts.similarity,
      q_sq=q_sq,
      k_sq=jnp.sum(kg * kg, axis=-1)[:, :, None, :],
    )
  return logits.softcap(dots, opts.softcap)


def _own_block_causal(bs: int, G: int, L: int) -> Array:
  """The causal triangle of a gathered tile ``[1, 1, G * bs, L]``: on the own block's columns
  (the last ``bs``; the selected blocks before them are strictly earlier, all allowed)."""
  tri = np.tril(np.ones((bs, bs), bool))
  return jnp.asarray(
    np.concatenate([np.ones((G * bs, L - bs), bool), np.tile(tri, (G, 1))], axis=1)
  )[None, None]


def _tile_allowed(
  blocks: Array, safe: Array, causal: Optional[Array], seg, T: int, Tp: int, bs: int, G: int
):
  """``(allowed, pos, ok)`` of a gathered tile whose key slots are the blocks ``blocks
  [B, K, ns]`` of ``bs`` keys (-1: an empty slot; ``safe`` the same with 0 there): the key
  positions ``pos`` and validity ``ok`` ``[B, K, ns * bs]`` (a real slot, a key before ``T``
  of the ``Tp`` padded ones), and the mask ``[B, K, 1 | G * bs, ns * bs]``: ``ok``, the
  ``causal`` triangle if any, and equal segment ids if ``seg`` (``(q_seg_i [B, bs],
  kv_seg [B, 1, nb, bs])``) is given."""
  B, K, ns = blocks.shape
  L = ns * bs
  pos = jnp.reshape(safe[..., None] * bs + jnp.arange(bs)[None, None, None], (B, K, L))
  ok = jnp.repeat(blocks >= 0, bs, axis=-1)
  if Tp != T:
    ok = jnp.logical_and(ok, pos < T)
  allowed = ok[:, :, None, :]  # [B, K, 1, L]
  if causal is not None:
    allowed = jnp.logical_and(allowed, causal)
  if seg is not None:
    q_seg_i, kv_seg = seg
    nb = kv_seg.shape[2]
    seg_k = jnp.reshape(
      jnp.take_along_axis(jnp.broadcast_to(kv_seg, (B, K, nb, bs)), safe[..., None], axis=2),
      (B, K, 1, 1, L),
    )
    same = q_seg_i[:, None, None, :, None] == seg_k  # [B, K, 1, bs, L]
    same = jnp.reshape(jnp.broadcast_to(same, (B, K, G, bs, L)), (B, K, G * bs, L))
    allowed = jnp.logical_and(allowed, same)
  return allowed, pos, ok


def _online_tile(nz, z: Array, allowed: Array, pv, sink_rows: Optional[Array], Hv: int) -> Array:
  """The normaliser's online form on the one tile ``z [B, K, R, L]`` (``visit`` then
  ``finish``): its output rows ``[B, K, R, Hv]``. Softmax divides the ``[R, Hv]`` rows instead
  of the ``[R, L]`` weights."""
  B, K, R, L = z.shape
  counts = None
  if nz.needs_counts:
    counts = jnp.sum(
      jnp.broadcast_to(allowed, (B, K, R, L)), axis=-1, keepdims=True, dtype=jnp.float32
    )
  # The tile holds every key of its rows: a needs_lse normaliser's log-normaliser is the tile's.
  terms = normalizers.row_softmax_terms(z, allowed) if nz.needs_lse else None
  row = nz.row_inputs(sink_rows, counts, terms)
  st = nz.init((B, K, R, 1), (B, K, R, Hv), False)
  return nz.finish(nz.visit(st, z, allowed, pv, row, False, False), row, False)[0]


def _gathered(inputs: options.DenseInputs, opts: options.DenseOptions, sel: Array, block_size: int):
  """Per query block: gather its selected key/value blocks, run the normaliser on the tile.

  A ``lax.map`` step slices its query block from ``q`` and lays it out as rows
  ``[B, K, G * block_size, H]`` (every query head of a KV group stacked, as
  ``attnjax._src.kernels.blockwise.tiles``, so GQA costs no copies), gathers its ``top_k' + 1``
  key and value blocks (the own block last) per KV head straight from the
  inputs' layout, and writes its output rows in the output's layout, so no
  whole-array transpose is made (on CPU they cost more than the strided
  gathers: fresh memory to fault in each call). The tile's mask is a per-key
  validity (a -1 slot, a padded key), equal segment ids when given and, when
  causal, a constant causal triangle on the own block's columns. Without statistics the tile goes through
  the normaliser's online form for one tile
  (:meth:`~attnjax.normalizers.Normalizer.visit` then ``finish``); with
  statistics (and for a weights-only normaliser), its materialised weights
  (:meth:`~attnjax.normalizers.Normalizer.materialize`).
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  K, Hv = k.shape[2], v.shape[3]
  G = N // K
  bs = block_size
  nb = -(-T // bs)
  Tp = nb * bs
  R = G * bs
  f32 = lambda x: x.astype(jnp.float32)
  dot = opts.similarity == "dot"
  # Nothing is transposed up front (with B=1 these are reshapes): a step's query block
  # [B, bs, K, G, H] is laid out as rows in the step, and its key and value blocks are gathered
  # from [B * nb, bs, K, H] (whole-array copies cost more, mostly as fresh memory to fault in).
  q_blocks = jnp.reshape(_pad_to(f32(q), Tp), (B, nb, bs, N, H))
  k_blocks, v_blocks = (jnp.reshape(_pad_to(f32(x), Tp), (B * nb, bs, K, -1)) for x in (k, v))
  batch_blocks = nb * jnp.arange(B, dtype=jnp.int32)[:, None, None]  # [B, 1, 1]
  heads = jnp.arange(K, dtype=jnp.int32)[None, :, None]  # [1, K, 1]
  own = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32)[:, None, None, None], (nb, B, K, 1))
  slots = jnp.concatenate([jnp.moveaxis(sel, 2, 0), own], axis=3)  # [nb, B, K, ns]; own last
  ns = slots.shape[3]
  L = ns * bs
  causal = _own_block_causal(bs, G, L) if opts.is_causal else None
  q_seg, kv_seg = inputs.q_segment_ids, inputs.kv_segment_ids
  has_seg = q_seg is not None
  if has_seg:
    q_seg = jnp.moveaxis(jnp.reshape(_pad_to(q_seg, Tp, value=-1), (B, nb, bs)), 1, 0)
    kv_seg = jnp.reshape(_pad_to(kv_seg, Tp, value=-2), (B, 1, nb, bs))
  else:
    q_seg = jnp.zeros((nb,), jnp.int32)  # an unused placeholder
  nz = normalizers.get(opts.normalizer)

  def head_rows(x):  # [1, N|1, 1, 1] per head -> rows [1, K|1, R|1, 1]
    if x.shape[1] == 1:
      return jnp.reshape(f32(x), (1, 1, 1, 1))
    return jnp.reshape(
      jnp.broadcast_to(jnp.reshape(f32(x), (1, K, G, 1, 1)), (1, K, G, bs, 1)), (1, K, R, 1)
    )

  sink_rows = None if inputs.sink_logits is None else head_rows(inputs.sink_logits)
  params = {p.name: head_rows(x) for p, x in zip(nz.params, inputs.normalizer_params)}

  def one_block(xs):
    i, blocks, q_seg_i = xs  # [], [B, K, ns], [B, bs]
    qb = jax.lax.dynamic_index_in_dim(q_blocks, i, axis=1, keepdims=False)  # [B, bs, N, H]
    qb = jnp.reshape(
      jnp.transpose(jnp.reshape(qb, (B, bs, K, G, H)), (0, 2, 3, 1, 4)), (B, K, R, H)
    )
    if dot:
      qb = qb * opts.scale
    safe = jnp.maximum(blocks, 0)
    rows = jnp.broadcast_to(safe + batch_blocks, (B, K, ns))
    hs = jnp.broadcast_to(heads, (B, K, ns))
    take = lambda x: jnp.reshape(x[rows, :, hs], (B, K, L, -1))  # [B, K, ns, bs, H] -> rows
    kg, vg = take(k_blocks), take(v_blocks)  # [B, K, L, H]
    z = _tile_logits(opts, qb, None if dot else jnp.sum(qb * qb, axis=-1, keepdims=True), kg)
    seg = (q_seg_i, kv_seg) if has_seg else None
    allowed, pos, ok = _tile_allowed(blocks, safe, causal, seg, T, Tp, bs, G)
    pv = lambda w: jnp.einsum("bkrl,bklh->bkrh", w, vg)
    # [B, K, G * bs, Hv] rows -> [B, bs, N, Hv], the output's layout.
    time_major = lambda o: jnp.reshape(
      jnp.transpose(jnp.reshape(o, (B, K, G, bs, Hv)), (0, 3, 1, 2, 4)), (B, bs, N, Hv)
    )
    if not opts.return_stats and not nz.weights_only:
      return time_major(_online_tile(nz, z, allowed, pv, sink_rows, Hv))
    allowed = jnp.broadcast_to(allowed, (B, K, R, L))
    # The tile holds every key of its rows: a weights-only normaliser's whole rows.
    w, log_norm = nz.materialize(z, allowed, sink_rows, params)
    if not opts.return_stats:
      return time_major(pv(w))
    key0 = jnp.logical_and(pos == 0, ok)[:, :, None, :]
    return time_major(pv(w)), _row_stats(z, w, allowed, log_norm, key0)

  res = jax.lax.map(jax.checkpoint(one_block), (jnp.arange(nb), slots, q_seg))
  out_blocks = res[0] if opts.return_stats else res  # [nb, B, bs, N, Hv]
  out = jnp.reshape(jnp.moveaxis(out_blocks, 0, 1), (B, Tp, N, Hv))[:, :T].astype(q.dtype)
  if not opts.return_stats:
    return out
  # [nb, B, K, G * bs] -> [B, N, T]
  rows = {
    name: jnp.reshape(
      jnp.transpose(jnp.reshape(x, (nb, B, K, G, bs)), (1, 2, 3, 0, 4)), (B, N, Tp)
    )[..., :T]
    for name, x in res[1].items()
  }
  return out, _reduce_stats(rows)


# ---------------------------------------------------------------------------
# The public function.


# The block-select op: its call is ``(inputs, opts, selection, block_size)``; auto-dispatch
# takes the gathered engine everywhere.
ENGINES: dict[str, op.Engine] = {
  e.name: e
  for e in (
    op.Engine("reference", _reference, op.supports_everything),
    op.Engine("gathered", _gathered, op.supports_everything),
  )
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES: dict[str, tuple[str, ...]] = {}
FALLBACK: tuple[str, ...] = ("gathered",)
OP = op.register(
  op.Op(
    "block_select",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=lambda inputs, opts, *_: empty.dense(inputs, opts),
    is_empty=lambda inputs, *_: empty.is_empty(inputs.q, inputs.k),
    samples=lambda: _samples(),
  )
)


def _block_select_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  block_size: int,
  top_k: int,
  is_causal: bool = True,
  query_pool: Optional[QueryPool] = None,
  scale: Optional[float] = None,
  normalizer: str = "softmax",
  normalizer_params: Optional[Mapping[str, Array]] = None,
  sink_logits: Optional[Array] = None,
  softcap: Optional[float] = None,
  segment_ids: Any = None,
  similarity: str = "dot",
  implementation: Optional[ImplementationName] = None,
  return_stats: bool = False,
  return_selection: bool = False,
):
  """Attention over each query block's own block plus its ``top_k`` content-selected key blocks.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, T, K, H]`` (self-attention: the same length as ``q``);
      ``N % K == 0`` (GQA/MQA: a KV group shares one selection).
    v: values ``[B, T, K, Hv]``.
    block_size: positions per block, for queries and keys alike (static);
      ``T`` need not be a multiple of it.
    top_k: key blocks selected per query block besides its own (static, >= 0;
      0 is block-diagonal attention).
    is_causal: candidates are the strictly earlier blocks and the own block is
      causally masked; False: candidates are all other blocks.
    query_pool: ``"first"`` (a block's first query; the default and the only
      choice when causal) or ``"mean"`` (its mean query; the default when not
      causal); see the module docstring.
    scale: logit scale; None means ``H ** -0.5``.
    normalizer: a registered normaliser's name; normalisers
      that count allowed keys count the attended (selected, unmasked) keys.
    normalizer_params: a weights-only normaliser's learned parameters by name (as
      :func:`attnjax.dot_product_attention`).
    sink_logits: ``[N]`` learned null-column logits (softmax only).
    softcap: ``c`` for ``c * tanh(z / c)`` on the scaled logits.
    segment_ids: ``[B, T]`` ids (or a pair of them), intersected with the
      selection; a row left without keys is zero.
    similarity: ``"dot"`` or ``"neg_sq_euclidean"`` (the attention logits; the
      selection always uses dot products).
    implementation: None (auto: ``"gathered"``), ``"reference"`` or ``"gathered"`` (the
      engines of :data:`~attnjax._src.ops.block_select.attention.OP`).
    return_stats: also return :class:`attnjax.AttentionStats` over the attended keys.
    return_selection: also return :func:`.select_blocks`'s int32
      ``[B, K, ceil(T / block_size), top_k]`` selected blocks (-1 = none).

  Returns:
    ``out [B, T, N, Hv]`` in the input dtype; ``(out, stats)``,
    ``(out, selection)`` or ``(out, stats, selection)`` as asked.

  References:
    Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs".
    Yuan et al. 2025, "Native Sparse Attention" (selection shared by a GQA group).
  """
  query_pool = _check_static(q, k, block_size, top_k, query_pool, is_causal)
  implementation = op.check_implementation(OP, implementation, where="block_select_attention")
  inputs, opts = options.validate(q, k, v, **options.forwarded(DENSE_KEYWORDS, locals()))
  if empty.is_empty(q, k):  # T = S = 0: no query block selects anything (OP answers)
    sel = jnp.full((q.shape[0], k.shape[2], 0, top_k), -1, jnp.int32)
  else:
    sel = _selection(q, k, block_size, top_k, is_causal, query_pool)
  res = op.run(OP, (inputs, opts, sel, block_size), implementation)
  if not return_selection:
    return res
  sel = _pad_to(sel, top_k, axis=3, value=-1)
  return (*res, sel) if return_stats else (res, sel)


BLOCK_SELECT_STATIC = (
  "block_size",
  "top_k",
  "query_pool",
  "implementation",
  "return_selection",
) + options.static(DENSE_KEYWORDS)

block_select_attention = static.jit(_block_select_attention, BLOCK_SELECT_STATIC)


def _samples() -> tuple[op.Sample, ...]:
  return (
    op.Sample(
      block_select_attention,
      options=dict(block_size=8, top_k=2),
      self_only=True,
      stats=True,
      flags=("is_causal", "return_stats", "return_selection"),
      static=(("scale", 0.5), ("block_size", 2), ("top_k", 1)),
      choices=(("block_size", (1, 2, 3)), ("top_k", (0, 1, 3))),
      defects=(("block_size", (0,)), ("top_k", (-1, 2.5))),
      dense_keywords=DENSE_KEYWORDS,
      own_defaults={"is_causal": True},
    ),
  )
