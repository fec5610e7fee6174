"""The pieces the Pallas GPU kernels (:mod:`attnjax.kernels.pallas_gpu`, :mod:`attnjax._src.kernels.pallas_gpu.backward`) share.

A call's static description (:class:`GridPlan`), the block relation (loop bounds
of key blocks per query block and of query blocks per key block), a tile's
element mask, logits and matmuls, the loop over visited blocks that skips
blocks whose segments cannot meet, and the padded ``[B, heads, time, dim]``
layout of the arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnjax._src import logits as logits_lib
from attnjax._src.kernels._plan import KernelPlan

Array = jnp.ndarray


# ---------------------------------------------------------------------------
# Static description of a call and the pieces shared by the kernel bodies.


def _pow2(n: int, lo: int = 16) -> int:
  return max(lo, 1 << max(0, (n - 1).bit_length()))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class GridPlan(KernelPlan):
  """Everything a kernel body reads from Python: shapes, options, block sizes."""

  opts: object
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  Hv: int
  Tp: int  # padded lengths and head dims
  Sp: int
  Hp: int
  Hvp: int
  bq: int
  bk: int
  bq_bwd: int  # dq programs' rows and loop steps' keys
  bk_bwd: int
  bq_dkdv: int  # dk/dv loop steps' rows and programs' keys
  bk_dkdv: int
  has_sink: bool
  has_segments: bool
  num_warps: int
  num_stages: int
  num_stages_bwd: int
  interpret: bool

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def needs_mask(self) -> bool:
    """Some visited block may be cut by structure (else no element mask is evaluated)."""
    o = self.opts
    return (
      o.is_causal
      or o.window is not None
      or self.has_segments
      or self.S % self.bk != 0
      or self.S % self.bk_bwd != 0
      or self.S % self.bk_dkdv != 0
    )


def make_plan(inputs, opts, block_sizes, interpret: bool) -> GridPlan:
  B, T, N, H = inputs.q.shape
  _, S, K, Hv = inputs.v.shape
  bq = min(block_sizes.block_q, _pow2(T))
  bk = min(block_sizes.block_k, _pow2(S))
  bq_bwd = min(block_sizes.block_q_bwd, _pow2(T))
  bk_bwd = min(block_sizes.block_k_bwd, _pow2(S))
  bq_dkdv = min(block_sizes.block_q_dkdv or block_sizes.block_q_bwd, _pow2(T))
  bk_dkdv = min(block_sizes.block_k_dkdv or block_sizes.block_k_bwd, _pow2(S))
  Hp, Hvp = _pow2(H), _pow2(Hv)
  warps = block_sizes.num_warps or (4 if max(Hp, Hvp) <= 64 else 8)
  return GridPlan(
    opts=opts,
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=Hv,
    Tp=_round_up(T, max(bq, bq_bwd, bq_dkdv)),
    Sp=_round_up(S, max(bk, bk_bwd, bk_dkdv)),
    Hp=Hp,
    Hvp=Hvp,
    bq=bq,
    bk=bk,
    bq_bwd=bq_bwd,
    bk_bwd=bk_bwd,
    bq_dkdv=bq_dkdv,
    bk_dkdv=bk_dkdv,
    has_sink=inputs.sink_logits is not None,
    has_segments=inputs.q_segment_ids is not None,
    num_warps=warps,
    num_stages=block_sizes.num_stages,
    num_stages_bwd=block_sizes.num_stages_bwd,
    interpret=interpret,
  )


def kv_block_bounds(c: GridPlan, q0, q_last, bk: int):
  """``[lo, hi)`` key blocks rows ``q0 .. q_last`` may attend (from causal / window only)."""
  lo = 0
  hi = pl.cdiv(c.S, bk)
  if c.opts.is_causal:
    hi = jnp.minimum(hi, q_last // bk + 1)
  if c.opts.window is not None:
    left, right = c.opts.window
    lo = jnp.maximum(0, q0 - left) // bk
    hi = jnp.minimum(hi, jnp.maximum(0, q_last + right) // bk + 1)
  return lo, hi


def q_block_bounds(c: GridPlan, k0, k_last, bq: int):
  """``[lo, hi)`` query blocks whose rows may attend keys ``k0 .. k_last`` (the inverse relation)."""
  lo = 0
  hi = pl.cdiv(c.T, bq)
  if c.opts.is_causal:
    lo = k0 // bq
  if c.opts.window is not None:
    left, right = c.opts.window
    lo = jnp.maximum(lo, jnp.maximum(0, k0 - right) // bq)
    hi = jnp.minimum(hi, (k_last + left) // bq + 1)
  return lo, hi


def tile_allowed(
  c: GridPlan, qpos: Array, kpos: Array, q_seg: Optional[Array], k_seg: Optional[Array]
) -> Optional[Array]:
  """Boolean ``[tq, tk]`` mask of one tile from positions ``[tq, 1]``, ``[1, tk]`` (None: all)."""
  if not c.needs_mask:
    return None
  allowed = kpos < c.S
  if c.opts.is_causal:
    allowed = allowed & (kpos <= qpos)
  if c.opts.window is not None:
    left, right = c.opts.window
    allowed = allowed & (kpos >= qpos - left) & (kpos <= qpos + right)
  if q_seg is not None:
    allowed = allowed & (q_seg == k_seg)
  return allowed


def segments_meet(q_seg: Array, k_seg: Array) -> Array:
  """Whether the segment ranges of a query block and a key block can share an id."""
  return (jnp.max(k_seg) >= jnp.min(q_seg)) & (jnp.min(k_seg) <= jnp.max(q_seg))


def logits(c: GridPlan, q: Array, k: Array) -> tuple[Array, Array]:
  """``(z, s)`` float32 ``[tq, tk]``: the (soft-capped) logits and the scaled dots before the cap."""
  s = dot(q, k, trans_b=True) * c.opts.scale
  return logits_lib.softcap(s, c.opts.softcap), s


def dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """``a @ b`` with float32 accumulation (operands in their dtype: bf16 tensor cores).

  Float32 operands ask for ``Precision.HIGHEST`` (Triton's IEEE input precision):
  the default would round them to TF32 on tensor cores.
  """
  ca = 0 if trans_a else 1
  cb = 1 if trans_b else 0
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(
    a, b, (((ca,), (cb,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )


def compiler_params(c: GridPlan, backward: bool = False):
  if c.interpret:
    return None
  from jax.experimental.pallas import triton as plt

  return plt.CompilerParams(
    num_warps=c.num_warps, num_stages=c.num_stages_bwd if backward else c.num_stages
  )


def full_kv_blocks(c: GridPlan, q0, q_last, bk: int):
  """``[lo, hi)`` key blocks every row ``q0 .. q_last`` attends entirely (no element mask needed).

  Empty (``lo >= hi``) with segment ids, whose mask is data.
  """
  lo, hi = 0, c.S // bk  # a ragged last block is masked (its padded keys)
  if c.has_segments:
    return 0, 0
  if c.opts.is_causal:
    hi = jnp.minimum(hi, (q0 + 1) // bk)
  if c.opts.window is not None:
    left, right = c.opts.window
    lo = jnp.maximum(0, pl.cdiv(jnp.maximum(0, q_last - left), bk))
    hi = jnp.minimum(hi, jnp.maximum(0, q0 + right + 1) // bk)
  return lo, hi


def full_q_blocks(c: GridPlan, k0, k_last, bq: int):
  """``[lo, hi)`` query blocks whose rows all attend every key ``k0 .. k_last`` (the inverse)."""
  if c.has_segments:
    return 0, 0
  lo = 0
  # int32 operands: Triton's lowering gives a select of two Python ints another integer type
  # than the loop bounds (the compile fails: 'arith.minsi' op requires the same type).
  hi = jnp.where(
    k_last + 1 - k0 == c.bk_dkdv, jnp.int32(pl.cdiv(c.T, bq)), jnp.int32(0)
  )  # a ragged block: masked
  if c.opts.is_causal:
    lo = pl.cdiv(k_last, bq)
  if c.opts.window is not None:
    left, right = c.opts.window
    lo = jnp.maximum(lo, pl.cdiv(jnp.maximum(0, k_last - right), bq))
    hi = jnp.minimum(hi, (k0 + left + 1) // bq)
  return lo, hi


def visit_loop(c: GridPlan, lo, hi, carry, step, q_seg_blk, kv_seg_ref, bk: int, full=None):
  """Folds ``step(j, carry, k_seg, masked)`` over blocks ``[lo, hi)``.

  ``full`` is the ``[full_lo, full_hi)`` range of blocks needing no element
  mask (:func:`full_kv_blocks`); the loop then runs as three loops (masked
  edge, unmasked interior, masked edge) so interior blocks evaluate no mask.
  With segment ids, blocks whose segment ranges cannot meet are skipped.
  """

  def body(masked):
    def one(j, carry):
      if not c.has_segments:
        return step(j, carry, None, masked)
      k_seg = kv_seg_ref[pl.ds(j * bk, bk)]
      return jax.lax.cond(
        segments_meet(q_seg_blk, k_seg), lambda: step(j, carry, k_seg, masked), lambda: carry
      )

    return one

  if full is None or not c.needs_mask:
    return jax.lax.fori_loop(lo, hi, body(c.needs_mask), carry)
  a = jnp.clip(full[0], lo, hi)
  b = jnp.clip(full[1], a, hi)
  carry = jax.lax.fori_loop(lo, a, body(True), carry)
  carry = jax.lax.fori_loop(a, b, body(False), carry)
  return jax.lax.fori_loop(b, hi, body(True), carry)


def heads_first(c: GridPlan, q, k, v, q_seg, kv_seg):
  """Pads and transposes the arrays to the kernels' ``[B, N|K, T|S, H]`` order."""

  def pad_heads_first(x, L, Hp):
    x = jnp.transpose(x, (0, 2, 1, 3))
    return jnp.pad(x, ((0, 0), (0, 0), (0, L - x.shape[2]), (0, Hp - x.shape[3])))

  qh = pad_heads_first(q, c.Tp, c.Hp)
  kh = pad_heads_first(k, c.Sp, c.Hp)
  vh = pad_heads_first(v, c.Sp, c.Hvp)
  if q_seg is not None:
    q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, c.Tp - c.T)), mode="edge")
    kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, c.Sp - c.S)), mode="edge")
  return qh, kh, vh, q_seg, kv_seg
