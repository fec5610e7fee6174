"""Ring attention: the block-wise kernel over a sequence sharded across devices.

Inside ``jax.shard_map`` each device keeps its queries and passes its key/value shard
(and key segment ids) round the ring with ``lax.ppermute``, ``P`` times, folding each
into its rows' online state (:func:`attnjax.kernels.blockwise.kernel.accumulate`). Which
blocks a step visits is classified statically per (query shard, key shard) pair
(:func:`shard_positions`); the backward runs the ring again, dk/dv travelling with their
shard. Layouts: ``"contiguous"`` or ``"zigzag"``. Memory per device is O(T / P).
Guides: docs/guides/kernels.md ("Ring attention", under the block-wise engine) and
docs/guides/context_parallel.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import masks, normalizers
from attnjax._src.attention_stats import AttentionStats, stats_from_rows
from attnjax._src.kernels import autodiff
from attnjax._src.kernels.blockwise.kernel import _backward as kernel_backward
from attnjax._src.kernels.blockwise.kernel import (
  _cotangent_like,
  accumulate,
  count_allowed,
  default_block_sizes,
  index_use,
)
from attnjax._src.kernels.blockwise.tiles import TilePlan, Arrays
from attnjax._src.kernels.linear_map import as_aval, varying_axes
from attnjax._src.layout import BlockLayout, mask_mod_block_table

Array = jnp.ndarray


def shard_positions(shard, axis_size: int, length: int, layout: str):
  """Global positions ``[length]`` of the tokens shard ``shard`` holds (int32).

  ``shard`` is a Python int (numpy result) or a traced index (``lax.axis_index``).
  """
  xp = np if isinstance(shard, (int, np.integer)) else jnp
  if layout == "contiguous":
    return (shard * length + xp.arange(length)).astype(xp.int32)
  half = length // 2
  first = shard * half + xp.arange(half)
  second = (2 * axis_size - 1 - shard) * half + xp.arange(half)
  return xp.concatenate([first, second]).astype(xp.int32)


def varying(x, axis: str):
  """``x`` typed as varying over manual axis ``axis`` (a no-op where it already is)."""
  if isinstance(x, np.ndarray) or axis in varying_axes(as_aval(x)):
    return x
  return jax.lax.pcast(x, (axis,), to="varying")


def _rotate(x, axis: str, size: int):
  """Each device's ``x`` to the next device along ``axis`` (``p -> p + 1 mod P``)."""
  return jax.lax.ppermute(x, axis, perm=[(i, (i + 1) % size) for i in range(size)])


# ---------------------------------------------------------------------------
# Static classification of the (query shard, key shard) pairs.


def _pair_visits(
  gq: np.ndarray, gk: np.ndarray, block_q: int, block_k: int, is_causal: bool, window
) -> tuple[list, tuple]:
  """``(visits, signature)`` of a pair: per query block ``[(key_block, needs_mask)]``, and the
  offset of every partly masked block (its mask depends on nothing else: blocks never cross
  a chunk, so positions inside one are consecutive)."""
  T, S = len(gq), len(gk)
  lo = np.full(T, np.iinfo(np.int64).min // 2, np.int64)
  hi = np.full(T, np.iinfo(np.int64).max // 2, np.int64)
  gq64 = gq.astype(np.int64)
  if is_causal:
    hi = np.minimum(hi, gq64)
  if window is not None:
    lo = np.maximum(lo, gq64 - window[0])
    hi = np.minimum(hi, gq64 + window[1])
  nq, nk = -(-T // block_q), -(-S // block_k)
  k_lo = gk[np.arange(nk) * block_k].astype(np.int64)
  k_hi = gk[np.minimum(S, (np.arange(nk) + 1) * block_k) - 1].astype(np.int64)
  visits, signature = [], []
  for i in range(nq):
    r_lo, r_hi = (
      lo[i * block_q : (i + 1) * block_q, None],
      hi[i * block_q : (i + 1) * block_q, None],
    )
    touches = np.any((r_lo <= k_hi[None]) & (r_hi >= k_lo[None]) & (r_lo <= r_hi), axis=0)
    full = np.all((r_lo <= k_lo[None]) & (r_hi >= k_hi[None]), axis=0)
    row = [(int(j), not bool(full[j])) for j in np.nonzero(touches)[0]]
    signature += [(i, j, int(gq[i * block_q]) - int(gk[j * block_k])) for j, nm in row if nm]
    visits.append(row)
  return visits, tuple(signature)


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """The static plan of a ring call: block sizes, the classes of shard pairs and their table.

  ``classes[c]`` is ``(layout or None, representative (p, src), holds_key0)``;
  None: nothing to visit (the step is skipped). ``table[p][src]`` is the class
  of device ``p``'s step with the keys of shard ``src``.
  """

  axis_size: int
  layout: str
  block_q: int
  block_k: int
  classes: tuple
  table: tuple

  def tiles(self, p: int) -> int:
    """Tiles (query block x key block visits) device ``p`` computes over the ring."""
    return sum(
      0 if self.classes[c][0] is None else self.classes[c][0].num_pairs for c in self.table[p]
    )


def plan(
  T: int,
  S: int,
  axis_size: int,
  layout: str,
  *,
  is_causal: bool,
  window,
  with_stats: bool,
  block_q: Optional[int] = None,
  block_k: Optional[int] = None,
) -> RingPlan:
  """Classifies the ``P x P`` shard pairs of a ring call with local lengths ``T == S``."""
  P = axis_size
  if T != S:
    raise ValueError(
      f"a context-parallel call shards queries and keys alike: local query "
      f"length T={T} and key length S={S} must be equal"
    )
  if layout == "zigzag" and T % 2:
    raise ValueError(
      f"context_layout='zigzag' needs an even local length (two chunks per "
      f"shard), got T={T} per shard"
    )
  dq, dk = default_block_sizes(T, S, window=window)
  bq, bk = dq if block_q is None else min(block_q, T), dk if block_k is None else min(block_k, S)
  if layout == "zigzag":  # a block never crosses a chunk
    bq, bk = math.gcd(bq, T // 2), math.gcd(bk, T // 2)
  positions = [shard_positions(s, P, T, layout) for s in range(P)]
  index, classes, table = {}, [], []
  for p in range(P):
    row = []
    for src in range(P):
      visits, signature = _pair_visits(positions[p], positions[src], bq, bk, is_causal, window)
      empty = not any(visits)
      holds_key0 = with_stats and src == int(np.argmin([pos[0] for pos in positions]))
      key = None if empty else (tuple(map(tuple, visits)), signature, holds_key0)
      if key not in index:
        index[key] = len(classes)
        layout_c = None if empty else BlockLayout.from_visits(T, S, bq, bk, visits)
        classes.append((layout_c, (p, src), holds_key0))
      row.append(index[key])
    table.append(tuple(row))
  return RingPlan(P, layout, bq, bk, tuple(classes), tuple(table))


# ---------------------------------------------------------------------------
# The ring.


@dataclasses.dataclass(frozen=True)
class _Call:
  """Static description of one ring call (shapes, options, plan, mesh axis)."""

  opts: object
  ring: RingPlan
  axis: str
  B: int
  T: int
  K: int
  G: int
  H: int
  Hv: int
  has_sink: bool
  has_segments: bool

  def tile_plan(self, c: int, has_sink: bool) -> TilePlan:
    layout, (p, src), holds_key0 = self.ring.classes[c]
    opts = self.opts
    mask_fn = None
    if opts.is_causal or opts.window is not None:
      gq = shard_positions(p, self.ring.axis_size, self.T, self.ring.layout)
      gk = shard_positions(src, self.ring.axis_size, self.T, self.ring.layout)

      def mask_fn(qi, kj, gq=gq, gk=gk):
        return masks.structural_mask(
          jnp.asarray(gq)[qi], jnp.asarray(gk)[kj], is_causal=opts.is_causal, window=opts.window
        )

    return TilePlan(
      opts=opts,
      layout=layout,
      mask_fn=mask_fn,
      B=self.B,
      T=self.T,
      S=self.T,
      K=self.K,
      G=self.G,
      H=self.H,
      Hv=self.Hv,
      has_sink=has_sink,
      has_segments=self.has_segments,
      mod_table=opts.mask_mod is not None,
      holds_key0=holds_key0,
    )

  def arrays(self, c: TilePlan, q, k, v, sink, q_seg, kv_seg, score_args, mask_args, gq, gk):
    opts = self.opts
    with_mods = opts.score_mod is not None or opts.mask_mod is not None
    positions = (gq, gk) if with_mods else None
    mod_any = None
    if c.mod_table:
      used_b, used_n = index_use(opts.mask_mod, mask_args)
      mod_any = mask_mod_block_table(
        opts.mask_mod,
        mask_args,
        c.layout,
        self.B if used_b else 1,
        self.K * self.G if used_n else 1,
        positions=(gq, gk),
      )
    return Arrays(
      c, q, k, v, None, sink, None, q_seg, kv_seg, score_args, mask_args, positions, mod_any
    )


def _steps(call: _Call, carry, kv, body):
  """Runs ``body(c, src, carry, kv) -> (carry, kv)`` for the ``P`` ring steps (``c`` the
  class of the step, chosen by a ``lax.switch``; a skipped class changes nothing),
  passing ``kv`` to the next device after each; returns the final ``(carry, kv)`` (after
  ``P`` passes every shard's ``kv`` is home again)."""
  P, axis = call.ring.axis_size, call.axis
  p = jax.lax.axis_index(axis)
  table = jnp.asarray(np.asarray(call.ring.table, np.int32))

  def branch(c):
    if call.ring.classes[c][0] is None:
      return lambda carry, kv, src: (carry, kv)
    return lambda carry, kv, src: body(c, src, carry, kv)

  branches = [branch(c) for c in range(len(call.ring.classes))]

  def step(s, state):
    carry, kv = state
    src = (p - s) % P
    if len(branches) == 1:
      carry, kv = branches[0](carry, kv, src)
    else:
      carry, kv = jax.lax.switch(table[p, src], branches, carry, kv, src)
    return carry, jax.tree.map(lambda x: _rotate(x, axis, P), kv)

  return jax.lax.fori_loop(0, P, step, (carry, kv))


def _positions(call: _Call, shard):
  return shard_positions(shard, call.ring.axis_size, call.T, call.ring.layout)


def _counts(call: _Call, q, k, v, q_seg, kv_seg, mask_args) -> Array:
  """``[B, K, G, T, 1]``: each local row's allowed keys over the whole sequence (a ring that
  passes only the key segment ids)."""
  gq = _positions(call, jax.lax.axis_index(call.axis))

  def body(c, src, total, kv):
    plan_c = call.tile_plan(c, False)
    a = call.arrays(
      plan_c, q, k, v, None, q_seg, kv["seg"], (), mask_args, gq, _positions(call, src)
    )
    return total + count_allowed(plan_c, a), kv

  total = varying(jnp.zeros((call.B, call.K, call.G, call.T, 1), jnp.float32), call.axis)
  return _steps(call, total, {"seg": kv_seg}, body)[0]


def _forward(call: _Call, x, nondiff):
  """``((out [B, T, N, Hv], statistics or None), (output rows, residual rows))``."""
  q, k, v, sink, score_args = x
  q_seg, kv_seg, mask_args = nondiff
  opts, axis = call.opts, call.axis
  nz = normalizers.get(opts.normalizer)
  stats = opts.return_stats
  gq = _positions(call, jax.lax.axis_index(axis))
  B, K, G, T, Hv = call.B, call.K, call.G, call.T, call.Hv
  counts = None
  if nz.needs_counts or stats:
    counts = _counts(call, q, k, v, q_seg, kv_seg, mask_args)
  sink_rows = None if sink is None else jnp.reshape(sink.astype(jnp.float32), (1, K, G, 1, 1))

  def body(c, src, state, kv):
    plan_c = call.tile_plan(c, call.has_sink)
    a = call.arrays(
      plan_c,
      q,
      kv["k"],
      kv["v"],
      sink,
      q_seg,
      kv["seg"],
      score_args,
      mask_args,
      gq,
      _positions(call, src),
    )
    return accumulate(plan_c, a, counts, state), kv

  state = nz.init((B, K, G, T, 1), (B, K, G, T, Hv), stats)
  state = jax.tree.map(lambda s: varying(s, axis), state)
  state = _steps(call, state, {"k": k, "v": v, "seg": kv_seg}, body)[0]
  out, res, srow = nz.finish(state, nz.row_inputs(sink_rows, counts), stats)
  out_bt = jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (B, T, K * G, Hv)).astype(q.dtype)
  if not stats:
    return (out_bt, None), (out, res)
  res["has_key"] = counts > 0
  stats = _collect_stats(call, srow, gq)
  # The backward's ring waits for the statistics' sums, which nothing else orders before it.
  _, (out, res) = jax.lax.optimization_barrier((stats, (out, res)))
  return (out_bt, stats), (out, res)


def _collect_stats(call: _Call, rows: dict, gq: Array) -> tuple:
  """The statistics of the whole sequence: row means summed over the axis, max over it."""
  B, N, T = call.B, call.K * call.G, call.T
  cat = {
    key: jnp.reshape(jnp.broadcast_to(val, (B, call.K, call.G, T, 1)), (B, N, T))
    for key, val in rows.items()
  }
  return stats_from_rows(cat, gq, call.axis, empty_logsumexp=call.opts.empty_row_logsumexp)


def _backward(call: _Call, x, nondiff, saved, cts):
  """The ring again from the saved rows: ``dq`` stays, ``dk`` / ``dv`` travel with their keys."""
  q, k, v, sink, score_args = x
  q_seg, kv_seg, mask_args = nondiff
  out, res = saved
  d_out, d_stats = cts
  opts, axis = call.opts, call.axis
  B, K, G, T, H, Hv = call.B, call.K, call.G, call.T, call.H, call.Hv
  gq = _positions(call, jax.lax.axis_index(axis))
  d_out = jnp.transpose(jnp.reshape(d_out.astype(jnp.float32), (B, T, K, G, Hv)), (0, 2, 3, 1, 4))
  d_lse = None
  if d_stats is not None and opts.return_stats:
    d_lse = jnp.reshape(d_stats[3].astype(jnp.float32), (B, K, G, T, 1))

  def body(c, src, carry, kv):
    plan_c = call.tile_plan(c, False)  # the null column's gradient is taken once, below
    a = call.arrays(
      plan_c,
      q,
      kv["k"],
      kv["v"],
      None,
      q_seg,
      kv["seg"],
      score_args,
      mask_args,
      gq,
      _positions(call, src),
    )
    dq, dk, dv, _, _, dargs = kernel_backward(plan_c, a, res, out, d_out, d_lse)
    carry = {"dq": carry["dq"] + dq, "dargs": tuple(x + y for x, y in zip(carry["dargs"], dargs))}
    return carry, dict(kv, dk=kv["dk"] + dk, dv=kv["dv"] + dv)

  zeros = lambda shape: varying(jnp.zeros(shape, jnp.float32), axis)
  kv = {"k": k, "v": v, "seg": kv_seg, "dk": zeros((B, K, T, H)), "dv": zeros((B, K, T, Hv))}
  carry = {"dq": zeros((B, K, G, T, H)), "dargs": tuple(zeros(jnp.shape(s)) for s in score_args)}
  carry, kv = _steps(call, carry, kv, body)
  dsink = None
  if sink is not None:
    nz = normalizers.get(opts.normalizer)
    row_dot = jnp.sum(d_out * out, axis=-1, keepdims=True)
    g = None if d_lse is None else jnp.where(res["has_key"], d_lse, 0.0)
    floor = jnp.reshape(sink.astype(jnp.float32), (1, K, G, 1, 1))
    term = nz.null_grad(
      floor, {key: val for key, val in res.items() if key != "has_key"}, row_dot, g
    )
    dsink = jnp.reshape(jnp.sum(term, axis=(0, 3, 4)), sink.shape).astype(sink.dtype)
    # After the ring: its sum over the devices must not overtake the ring's collectives.
    dsink, carry = jax.lax.optimization_barrier((dsink, carry))
  dq = jnp.reshape(jnp.transpose(carry["dq"], (0, 3, 1, 2, 4)), (B, T, K * G, H)).astype(q.dtype)
  dk = jnp.transpose(kv["dk"], (0, 2, 1, 3)).astype(k.dtype)
  dv = jnp.transpose(kv["dv"], (0, 2, 1, 3)).astype(v.dtype)
  dargs = tuple(_cotangent_like(s, g) for s, g in zip(score_args, carry["dargs"]))
  return dq, dk, dv, dsink, dargs


def attention(
  inputs,
  opts,
  *,
  axis_name: str,
  layout: str = "contiguous",
  block_q: Optional[int] = None,
  block_k: Optional[int] = None,
):
  """Ring attention of a validated dense call whose arrays are this device's shards.

  Args:
    inputs: :class:`attnjax.options.DenseInputs` of the local shards: q ``[B, T, N, H]``,
      k / v ``[B, T, K, H]`` (the same local length), segment ids ``[B, T]``; no ``bias``
      or ``mask`` array (their key columns would have to travel too).
    opts: :class:`attnjax.options.DenseOptions`; causal, window, ``score_mod`` and
      ``mask_mod`` act on global positions.
    axis_name: the ``jax.shard_map`` mesh axis the sequence is sharded over.
    layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
    block_q, block_k: tile sizes (None: the block-wise defaults; under zigzag they
      are cut to divide a chunk).

  Returns:
    The local output ``[B, T, N, Hv]``, or ``(out, AttentionStats)`` with ``logsumexp``
    ``[B, N, T]`` of the local rows and the other fields over the whole sequence (the same
    on every device).
  """
  if inputs.bias is not None or inputs.mask is not None:
    raise ValueError(
      "context_strategy='ring' takes no bias or mask array (their key columns "
      "would travel with the keys); express the rule as a mask_mod / score_mod "
      "on global positions, or use context_strategy='all_gather'"
    )
  if opts.block_layout is not None:
    raise ValueError(
      "block_layout describes one device's whole call; a ring call builds its "
      "own layouts per shard pair (pass mask_mod alone)"
    )
  if normalizers.get(opts.normalizer).needs_lse:
    raise ValueError(
      f"context_strategy='ring' carries the normaliser's online state from device to "
      f"device; normalizer={opts.normalizer!r} needs each row's log-normaliser over every "
      f"key before its first tile (needs_lse): use context_strategy='all_gather' or "
      f"'all_to_all'"
    )
  if normalizers.get(opts.normalizer).weights_only:
    raise ValueError(
      f"context_strategy='ring' carries the normaliser's online state from device to "
      f"device; normalizer={opts.normalizer!r} is weights-only (no online state): use "
      f"context_strategy='all_gather' or 'all_to_all'"
    )
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  P = jax.lax.axis_size(axis_name)
  ring = plan(
    T,
    S,
    P,
    layout,
    is_causal=opts.is_causal,
    window=opts.window,
    with_stats=opts.return_stats,
    block_q=block_q,
    block_k=block_k,
  )
  call = _Call(
    opts=opts,
    ring=ring,
    axis=axis_name,
    B=B,
    T=T,
    K=K,
    G=N // K,
    H=H,
    Hv=Hv,
    has_sink=inputs.sink_logits is not None,
    has_segments=inputs.q_segment_ids is not None,
  )
  x = (q, k, v, inputs.sink_logits, tuple(inputs.score_mod_args))
  nondiff = (inputs.q_segment_ids, inputs.kv_segment_ids, tuple(inputs.mask_mod_args))
  out, stats = autodiff.custom_vjp_with_jvp(
    lambda x, nd: _forward(call, x, nd),
    lambda x, nd, saved, cts: _backward(call, x, nd, saved, cts),
    x,
    nondiff,
    name="ring",
  )
  if not opts.return_stats:
    return out
  sink_mass, entropy, max_logit, lse, row_sum = stats
  return out, AttentionStats(
    sink_mass=sink_mass, entropy=entropy, max_logit=max_logit, logsumexp=lse, row_sum=row_sum
  )
