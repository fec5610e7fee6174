"""The pieces of the Mosaic GPU kernel (:mod:`attnjax.kernels.mosaic_gpu`): block sizes, the
shared-memory budget, and the row lowering that runs the normalisers' online state in a
Mosaic GPU kernel body.

:func:`block_sizes_for` and :func:`smem_bytes` (limit ``SMEM_LIMIT_BYTES``); :func:`lower_rows`
evaluates a normaliser function with its ``[R, 1]`` rows held as ``[R]`` vectors, as Mosaic
GPU has no register layout for ``[R, 1]``. Guide: docs/guides/kernels.md, section
"Pallas Mosaic GPU for Hopper".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
from jax.extend import core as jex_core

from attnjax._src.kernels._plan import KernelPlan


Array = jnp.ndarray

# Warpgroups of a forward program that compute, each its own block_q query rows (a further
# one, the producer, only issues the K/V copies); query lengths are padded to their multiple.
CONSUMERS = 2

# Shared memory per block on sm_90 (H100, H200): 227 KiB usable of the 228 KiB per SM.
SMEM_LIMIT_BYTES = 227 * 1024

# Keys per dk/dv program: one wgmma M (64 rows) per warpgroup. Its two float32 accumulators
# [keys, head dim] take keys * head_dim / 64 registers per thread: 256 at 128 keys and head
# dim 128, more than a thread has (a deviceless H200 compile's ptxas spilled 3.7 KB and
# serialised the wgmmas, C7512); 128 at 64 keys.
DKDV_BLOCK_K = 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and pipeline depth of the Mosaic GPU forward kernel.

  Attributes:
    block_q: query rows per warpgroup (one wgmma M; a multiple of 64); a forward program's
      two consumer warpgroups take ``2 * block_q`` rows.
    block_k: keys per tile (a multiple of 64: the 128-byte swizzle of a bf16 tile row).
    num_stages: K/V tiles in flight in shared memory (TMA ring buffer depth, >= 2).
  """

  block_q: int = 64
  block_k: int = 64
  num_stages: int = 2

  def __post_init__(self):
    for f in ("block_q", "block_k"):
      b = getattr(self, f)
      if isinstance(b, bool) or not isinstance(b, int) or b < 64 or b % 64:
        raise ValueError(f"BlockSizes.{f} must be a positive multiple of 64, got {b!r}")
    if not isinstance(self.num_stages, int) or self.num_stages < 2:
      raise ValueError(f"BlockSizes.num_stages must be an int >= 2, got {self.num_stages!r}")


DEFAULT_BLOCK_SIZES = BlockSizes()

# Block sizes and pipeline depth per head dim for H100/H200 (sm_90), 2-byte inputs (bf16/fp16),
# shared by the forward and the two backward kernels. First row whose head dim covers the call.
# Each row's shared memory (:func:`smem_bytes`: forward / dq / dk/dv, KiB below) is within
# SMEM_LIMIT_BYTES, and each compiles for an H100 and an H200 (tests/test_mosaic_gpu.py,
# deviceless; 64 x 256 tiles x 4 stages at head dim 256 ask ~1.1 MB and are rejected).
# block_q = 64 rows per consumer warpgroup (one wgmma M; a forward program's two consumers
# take 128 rows); the [64, head dim] float32 accumulator takes head_dim / 2 registers per
# thread. Untuned: no GPU was lent.
#   head dim 64:  64 x 128, 3 stages: 112 / 112 / 64 KiB
#   head dim 128: 64 x 128, 2 stages: 160 / 160 / 96 KiB
#   head dim 256: 64 x 64,  2 stages: 192 / 192 / 192 KiB
BLOCK_SIZE_TABLE: tuple[tuple[int, BlockSizes], ...] = (
  # head dim <=, sizes
  (64, BlockSizes(block_q=64, block_k=128, num_stages=3)),
  (128, BlockSizes(block_q=64, block_k=128, num_stages=2)),
  (256, BlockSizes(block_q=64, block_k=64, num_stages=2)),
)


def block_sizes_for(head_dim: int) -> BlockSizes:
  """The :data:`BLOCK_SIZE_TABLE` row of a head dim (ValueError above the table)."""
  for max_head, sizes in BLOCK_SIZE_TABLE:
    if head_dim <= max_head:
      return sizes
  raise ValueError(
    f"mosaic_gpu has no block sizes for head dim {head_dim} "
    f"(the table stops at {BLOCK_SIZE_TABLE[-1][0]})"
  )


def smem_bytes(
  sizes: BlockSizes, head_dim: int, head_dim_v: int, itemsize: int = 2, kernel: str = "forward"
) -> int:
  """Shared memory of a kernel's tiles (barriers and float32 row vectors are a few KiB more).

  ``"forward"``: the two consumers' Q tiles (each output written into its Q's) and
  ``num_stages`` K and V tiles; ``"dq"``: the Q and dO tiles (dq is written into Q's) and
  ``num_stages`` K and V tiles; ``"dkdv"``: the K and V tiles of ``DKDV_BLOCK_K`` keys
  at most (dk, dv written into them) and ``num_stages`` Q and dO tiles.
  """
  bq, bk, st = sizes.block_q, sizes.block_k, sizes.num_stages
  if kernel == "forward":
    return (
      CONSUMERS * bq * max(head_dim, head_dim_v) + st * bk * (head_dim + head_dim_v)
    ) * itemsize
  if kernel == "dq":
    return (bq * (head_dim + head_dim_v) + st * bk * (head_dim + head_dim_v)) * itemsize
  if kernel == "dkdv":
    bk = min(bk, DKDV_BLOCK_K)
    return (bk * (head_dim + head_dim_v) + st * bq * (head_dim + head_dim_v)) * itemsize
  raise ValueError(f"kernel must be 'forward', 'dq' or 'dkdv', got {kernel!r}")


# jax 0.12's Mosaic GPU interpreter runs layout annotations (layout_cast, iotas' and loads'
# layouts) and wgmma with a transposed shared-memory operand; jax 0.10.2's has neither. Both
# lack wgmma with a register lhs (the kernels stage it through shared memory in interpret mode).
INTERPRETER_RUNS_LAYOUTS = jax.__version_info__ >= (0, 12)


def load_vector(ref, layout):
  """``plgpu.load`` of a whole shared-memory vector with ``layout`` (jax 0.10 takes an index
  argument, jax 0.12 none)."""
  import inspect
  import jax.experimental.pallas.mosaic_gpu as plgpu

  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def interpret_params(enabled: bool):
  """``plgpu.kernel``'s ``interpret=``: the Mosaic GPU interpreter's parameters, or None.

  jax 0.12 exports ``InterpretGPUParams`` from ``jax.experimental.pallas.mosaic_gpu``;
  jax 0.10.2 has it only at ``jax._src.pallas.mosaic_gpu.interpret.params``.
  """
  if not enabled:
    return None
  import jax.experimental.pallas.mosaic_gpu as plgpu

  params_type = getattr(plgpu, "InterpretGPUParams", None)
  if params_type is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params_type
  return params_type()


def named_barrier(op: str, barrier_id, threads: int, after=()) -> None:
  """``bar.<op> barrier_id, threads`` (``op`` "arrive" or "sync") on a hardware named barrier:
  compiled kernels only (no interpreter runs inline PTX). ``barrier_id`` a Python int or a
  traced int32 (then held in a register). Mosaic GPU itself uses barrier 0 (the whole block)
  and ``1 + warpgroup`` (its warpgroup barriers, e.g. in ``commit_smem``).

  ``after``: float32 ``[64]`` row vectors (the wgmma row layout) that must be computed before
  the barrier. ptxas schedules arithmetic freely across ``bar.sync`` (it sank the forward's
  rescale exponentials past its turn's sync, to just before their use by the next wgmma), so
  the barrier's id is made to depend on them: ``id + cvt.rzi.s32(sum of 0 * x)``, where each
  ``0 * x`` is 0 or NaN and ``cvt.rzi`` takes both to 0 (PTX converts NaN to 0): the same id,
  but one that the values must exist to compute (a multiply-add per value, one conversion)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm

  void = lambda: ir.Type.parse("!llvm.void")
  if isinstance(barrier_id, int) and not after:

    @plgpu.inline_mgpu()
    def static(_):
      llvm.inline_asm(void(), [], f"bar.{op} {barrier_id}, {threads};", "", has_side_effects=True)

    static()
    return

  row = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,) + (row,) * len(after))
  def dynamic(_, bar, *rows):
    i32 = ir.IntegerType.get_signless(32)
    values = [
      llvm.extractelement(reg, arith.constant(i32, e))
      for r in rows
      for reg in r.registers.flat
      for e in range(ir.VectorType(reg.type).shape[0])
    ]
    asm = f"bar.{op} $0, {threads};"
    if values:
      terms = ["mul.f32 t, $1, 0f00000000;"] + [
        f"fma.rn.f32 t, ${k}, 0f00000000, t;" for k in range(2, len(values) + 1)
      ]
      asm = (
        "{ .reg .f32 t; .reg .s32 z; "
        + " ".join(terms)
        + f" cvt.rzi.s32.f32 z, t; add.s32 z, z, $0; bar.{op} z, {threads}; }}"
      )
    llvm.inline_asm(
      void(),
      [bar.registers.item()] + values,
      asm,
      ",".join(["r"] + ["f"] * len(values)),
      has_side_effects=True,
    )

  dynamic(jnp.asarray(barrier_id, jnp.int32), *after)


def warpgroup_barrier() -> None:
  """Mosaic GPU's barrier of the calling warpgroup (compiled kernels only): where a kernel
  compiled with ``unsafe_no_auto_barriers`` needs every warp's shared-memory reads done
  before a TMA copy overwrites them."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu

  plgpu.inline_mgpu()(lambda _: mgpu.utils.warpgroup_barrier())()


# ---------------------------------------------------------------------------
# Row lowering of the normalisers' online state.

# ``pv(w)`` of Normalizer.visit, traced as a placeholder and evaluated by the kernel's wgmma.
_pv_p = jex_core.Primitive("attnjax_mosaic_gpu_pv")


def _pv_abstract(w, *, hv):
  return jax.core.ShapedArray((w.shape[0], hv), jnp.float32)


_pv_p.def_abstract_eval(_pv_abstract)


def lower_rows(
  fn: Callable,
  R: int,
  pv: Optional[Callable] = None,
  hv: int = 0,
  iota: Optional[Callable] = None,
  transposed: bool = False,
  fuse: bool = False,
) -> Callable:
  """``fn`` evaluated with every ``[R, 1]`` value held as an ``[R]`` array (see the module
  docstring). ``fn`` takes and returns pytrees whose row leaves are ``[R]`` arrays here and
  ``[R, 1]`` arrays to ``fn``; ``pv`` (if given) is passed to ``fn`` as its last argument
  and evaluated on the ``[R, tk]`` weights; ``iota(dtype, shape, dimension)`` (if given)
  replaces ``lax.broadcasted_iota`` (Mosaic GPU needs its layout named).

  ``transposed=True`` (the dk/dv kernel, whose tiles have keys as rows): ``fn`` sees
  ``[R, X]`` tiles that are held as their transposes ``[X, R]``, rows broadcast along
  dimension 1; only elementwise work on tiles is allowed then (a reduction, a product or
  a reshape of a tile raises NotImplementedError), which is what
  :meth:`Normalizer.tile_backward` does.

  ``fuse=True`` (the forward's visit, the backward's tile rule) rewrites two patterns as it
  evaluates, without changing any value: ``x + pv(w)`` with ``x`` a ``[R, hv]`` tile calls
  ``pv(w, x, rows)``, which accumulates ``w V`` into ``x`` in place (the wgmma's accumulator
  starts at ``x``: no third tile of registers and no merge; ``rows`` holds ``r`` where
  ``x = r * acc``, else nothing); and a tile times a positive constant ``c`` is kept
  unmultiplied until it is read, so that its row maximum is ``c`` times the raw maximum and
  ``exp(c * s - r)`` becomes ``exp2(s * (c log2 e) - r log2 e)``: one FFMA and the MUFU op
  per element instead of a multiply for ``c``, a subtraction and a multiply for ``log2 e``."""

  def wrapped(*args):
    leaves, tree = jax.tree.flatten(args)

    def logical_shape(x):
      if _is_row(x, R):
        return (R, 1)
      return jnp.shape(x)[::-1] if transposed and jnp.ndim(x) == 2 else jnp.shape(x)

    logical = [jax.ShapeDtypeStruct(logical_shape(x), jnp.result_type(x)) for x in leaves]

    def flat_fn(*flat):
      a = jax.tree.unflatten(tree, flat)
      if pv is not None:
        return fn(*a, lambda w: _pv_p.bind(w, hv=hv))
      return fn(*a)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*logical)
    outs = _eval(closed.jaxpr, closed.consts, leaves, R, (pv, iota, transposed, fuse))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped


def _is_row(x, R: int) -> bool:
  return jnp.ndim(x) == 1 and jnp.shape(x)[0] == R


def _logical_is_row(aval, R: int) -> bool:
  return tuple(getattr(aval, "shape", ())) == (R, 1)


def _eval(jaxpr, consts, args, R: int, hooks):
  env = {}
  fuse = hooks[3]
  accumulated = _in_place_sums(jaxpr) if fuse else {}

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val
    return env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = _to_rep(val, var.aval, R)
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if fuse:
      if eqn.primitive is _pv_p and eqn.outvars[0] in {v for v, _ in accumulated.values()}:
        env[eqn.outvars[0]] = _Deferred(_materialize(invals[0]))  # evaluated by its sum
        continue
      if id(eqn) in accumulated:
        x, w = (_materialize(v) for v in invals if not isinstance(v, _Deferred)), None
        x = next(x)
        w = next(v.w for v in invals if isinstance(v, _Deferred))
        factor = accumulated[id(eqn)][1]
        rows = () if factor is None else (_materialize(read(factor)),)
        env[eqn.outvars[0]] = hooks[0](w, x, rows)
        continue
      folded = _fold(eqn, invals, R, hooks[2])
      if folded is not None:
        env[eqn.outvars[0]] = folded
        continue
      invals = [_materialize(x) for x in invals]
    outs = _eval_eqn(eqn, invals, R, hooks)
    for var, val in zip(eqn.outvars, outs):
      env[var] = val
  return [_materialize(read(v)) for v in jaxpr.outvars]


# ``fuse=True`` (see lower_rows): values held back from evaluation.
@dataclasses.dataclass(frozen=True)
class _Deferred:
  """``pv(w)``, evaluated by the sum it feeds (accumulated in place)."""

  w: object


@dataclasses.dataclass(frozen=True)
class _Scaled:
  """The tile ``c * s`` (``c > 0`` a Python float), not yet multiplied."""

  s: object
  c: float


@dataclasses.dataclass(frozen=True)
class _Shifted:
  """The tile ``c * s - r`` (``r`` an ``[R]`` row broadcast along dimension ``dim`` of the held
  tile: 0, or 1 where tiles are held transposed), not yet computed."""

  s: object
  c: float
  r: object
  dim: int = 0


def _const(c: float, shape):
  return lax.broadcast_in_dim(jnp.float32(c), shape, ())


def _materialize(x):
  if isinstance(x, _Scaled):
    return x.s * _const(x.c, x.s.shape)
  if isinstance(x, _Shifted):
    return x.s * _const(x.c, x.s.shape) - lax.broadcast_in_dim(x.r, x.s.shape, (x.dim,))
  return x


def _in_place_sums(jaxpr) -> dict:
  """``{id(add eqn): (pv outvar, row var or None)}`` for each ``x + pv(w)`` whose ``pv(w)`` is
  read only there and ``x`` is a tile of its shape: the sum is one wgmma accumulating into
  ``x``. Where ``x = r * acc`` with ``r`` a row (the online rescale), ``r`` is named too: the
  kernel makes its turn wait on it (see ``named_barrier``'s ``after``)."""
  producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  uses: dict = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal):
        uses.setdefault(v, []).append(eqn)
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal):
      uses.setdefault(v, []).append(None)
  out = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive is not _pv_p:
      continue
    (var,) = eqn.outvars
    readers = uses.get(var, [])
    if len(readers) != 1 or readers[0] is None or readers[0].primitive.name != "add":
      continue
    add = readers[0]
    others = [v for v in add.invars if v is not var]
    if len(others) == 1 and getattr(others[0].aval, "shape", None) == var.aval.shape:
      out[id(add)] = (var, _row_factor(producer.get(others[0]), var.aval.shape[0]))
  return out


def _row_factor(eqn, R: int):
  """The row ``r`` (``[R, 1]``) of a tile ``r * x`` made by ``eqn``, or None."""
  if eqn is None or eqn.primitive.name != "mul":
    return None
  rows = [
    v for v in eqn.invars if not isinstance(v, jex_core.Literal) and _logical_is_row(v.aval, R)
  ]
  return rows[0] if len(rows) == 1 else None


def _fold(eqn, invals, R: int, transposed: bool = False):
  """The value of ``eqn`` with the constant scale folded (see lower_rows), or None. Held
  transposed (``[X, R]``), a tile's rows are its columns and it has no row maximum here."""
  name = eqn.primitive.name
  dim = int(transposed)
  if name == "mul" and len(invals) == 2:
    for tile, (cvar, c) in (
      (invals[0], (eqn.invars[1], invals[1])),
      (invals[1], (eqn.invars[0], invals[0])),
    ):
      if (
        isinstance(cvar, jex_core.Literal)
        and jnp.ndim(c) == 0
        and float(c) > 0
        and not isinstance(tile, (_Scaled, _Shifted, _Deferred))
        and jnp.ndim(tile) == 2
        and jnp.shape(tile)[dim] == R
        and jnp.result_type(tile) == jnp.float32
      ):
        return _Scaled(tile, float(c))
    return None
  x = invals[0] if invals else None
  if (
    name == "reduce_max"
    and not transposed
    and isinstance(x, _Scaled)
    and tuple(eqn.params["axes"]) == (1,)
  ):
    m = eqn.primitive.bind(x.s, **eqn.params)
    return m * _const(x.c, m.shape)
  if (
    name == "sub"
    and isinstance(x, _Scaled)
    and _logical_is_row(eqn.invars[1].aval, R)
    and not isinstance(invals[1], (_Scaled, _Shifted, _Deferred))
    and jnp.ndim(invals[1]) == 1
  ):
    return _Shifted(x.s, x.c, invals[1], dim)
  if name == "exp" and isinstance(x, _Shifted):
    log2e = 1.4426950408889634
    shift = lax.broadcast_in_dim(x.r * _const(log2e, x.r.shape), x.s.shape, (x.dim,))
    return lax.exp2(x.s * _const(x.c * log2e, x.s.shape) - shift)
  return None


def _splat_row(x, R: int):
  """A size-1 value as an ``[R]`` row (a scalar is broadcast as is: jax 0.12's Mosaic GPU
  lowering refuses the 0-d vector a reshape to ``()`` makes)."""
  if jnp.ndim(x):
    x = jnp.reshape(x, ())
  return lax.broadcast_in_dim(x, (R,), ())


def _to_rep(val, aval, R):
  if _logical_is_row(aval, R):
    return jnp.reshape(val, (R,))
  return val


def _eval_eqn(eqn, invals, R: int, hooks):
  prim, params = eqn.primitive, eqn.params
  in_rows = [_logical_is_row(v.aval, R) for v in eqn.invars]
  out_rows = [_logical_is_row(v.aval, R) for v in eqn.outvars]
  name = prim.name
  pv, iota, transposed, _ = hooks
  if prim is _pv_p:
    return [pv(invals[0])]
  if name == "iota" and iota is not None:
    return [iota(params["dtype"], tuple(params["shape"]), params["dimension"])]
  if name == "is_finite":  # no Mosaic GPU lowering; |x| < inf is the same for floats (NaN: False)
    return [jnp.abs(invals[0]) < jnp.inf]
  if name in ("pjit", "jit", "closed_call", "core_call"):
    inner = params["jaxpr"]
    return _eval(inner.jaxpr, inner.consts, invals, R, hooks)
  if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
    inner = params.get("call_jaxpr", params.get("fun_jaxpr"))
    return _eval(inner.jaxpr, inner.consts, invals, R, hooks)
  if transposed:
    return _eval_transposed(eqn, invals, R, in_rows, out_rows)
  if name == "broadcast_in_dim":
    (x,), shape = invals, tuple(params["shape"])
    if in_rows[0]:
      if out_rows[0]:
        return [x]
      return [lax.broadcast_in_dim(x, shape, (0,))]
    if out_rows[0]:
      if jnp.ndim(x) == 1 and jnp.shape(x)[0] == R:
        return [x]  # expand_dims of a reduction: [R] -> [R, 1]
      return [_splat_row(x, R)]
  if name in ("reshape", "squeeze", "expand_dims"):
    x = invals[0]
    if out_rows[0] or in_rows[0]:
      out_shape = tuple(eqn.outvars[0].aval.shape)
      if out_rows[0]:
        return [jnp.reshape(x, (R,))]
      return [jnp.reshape(x, out_shape)]
  if any(in_rows) or any(out_rows):
    # An elementwise primitive on [R, 1] operands (lax ops take equal shapes; jnp inserted the
    # broadcasts, or the primitive broadcasts a size-1 axis itself): apply it to the [R]
    # values, broadcasting rows along dimension 0 where the result is an [R, X] tile.
    shape = (R,) if all(out_rows) else tuple(eqn.outvars[0].aval.shape)
    if not all(out_rows):
      invals = [lax.broadcast_in_dim(x, shape, (0,)) if r else x for x, r in zip(invals, in_rows)]
    out = prim.bind(*_explicit_scalars(name, invals, shape), **params)
    return list(out) if prim.multiple_results else [out]
  if len(eqn.outvars) == 1:
    invals = _explicit_scalars(name, invals, tuple(eqn.outvars[0].aval.shape))
  out = prim.bind(*invals, **params)
  return list(out) if prim.multiple_results else [out]


# Elementwise primitives whose scalar operands are broadcast explicitly (jax 0.12's Mosaic GPU
# lowering has no implicit broadcast: "Implicit broadcast not implemented").
_ELEMENTWISE = frozenset(
  (
    "add",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "pow",
    "rem",
    "select_n",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "xor",
    "atan2",
  )
)


def _explicit_scalars(name: str, invals, shape):
  if name not in _ELEMENTWISE or not shape:
    return invals
  return [lax.broadcast_in_dim(x, shape, ()) if jnp.ndim(x) == 0 else x for x in invals]


_ELEMENTWISE_SHAPES = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")


def _eval_transposed(eqn, invals, R, in_rows, out_rows):
  prim, params, name = eqn.primitive, eqn.params, eqn.primitive.name
  out_shape = tuple(eqn.outvars[0].aval.shape)
  phys = out_shape[::-1] if len(out_shape) == 2 and not out_rows[0] else None
  if name == "broadcast_in_dim":
    x = invals[0]
    if out_rows[0]:
      return [x if in_rows[0] else _splat_row(x, R)]
    if in_rows[0]:
      return [lax.broadcast_in_dim(x, phys, (1,))]
    if jnp.ndim(x) == 0:
      return [lax.broadcast_in_dim(x, phys, ())]
  if (
    name in _ELEMENTWISE_SHAPES
    or name.startswith("reduce")
    or name in ("dot_general", "transpose", "iota", "argmax", "argmin", "cumsum")
  ):
    raise NotImplementedError(f"{name} of a transposed tile in the row lowering ({eqn})")
  if phys is not None:
    invals = [lax.broadcast_in_dim(x, phys, (1,)) if r else x for x, r in zip(invals, in_rows)]
  out = prim.bind(*invals, **params)
  return list(out) if prim.multiple_results else [out]


def res_row_keys(nz, with_stats: bool, has_sink: bool, needs_counts: bool) -> tuple[str, ...]:
  """Names of the residual rows a normaliser's ``finish`` returns (sorted)."""
  rows = (8, 1)
  sink = jnp.zeros(rows, jnp.float32) if has_sink else None

  def run():
    row = nz.row_inputs(sink, jnp.ones(rows, jnp.float32) if needs_counts else None)
    return nz.finish(nz.init(rows, (8, 4), with_stats), row, with_stats)

  _, res, _ = jax.eval_shape(run)
  return tuple(sorted(res))


def stat_row_keys(nz, with_stats: bool, has_sink: bool) -> tuple[str, ...]:
  """Names of the statistics rows a normaliser's ``finish`` returns (sorted)."""
  rows = (8, 1)
  sink = jnp.zeros(rows, jnp.float32) if has_sink else None

  def run():
    row = nz.row_inputs(sink, jnp.ones(rows, jnp.float32))
    return nz.finish(nz.init(rows, (8, 4), with_stats), row, with_stats)

  _, _, srow = jax.eval_shape(run)
  return tuple(sorted(srow)) if srow is not None else ()


# ---------------------------------------------------------------------------
# The plan of one call, and what the kernels read from it.


@dataclasses.dataclass(frozen=True)
class Plan(KernelPlan):
  """Everything the kernel body reads from Python."""

  opts: object
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  Tp: int
  Sp: int
  bq: int
  bk: int
  stages: int
  has_sink: bool
  has_segments: bool
  interpret: bool

  @property
  def plain(self) -> bool:
    """In the interpreter of a jax without layouts or transposed wgmma operands (jax < 0.12):
    the kernels drop layout annotations and compute transposed products by register dots."""
    return self.interpret and not INTERPRETER_RUNS_LAYOUTS

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def approx_math(self) -> bool:
    """Whether the kernels compile with Mosaic GPU's ``approx_math``: ``exp`` becomes
    ``ex2.approx.ftz.f32`` of ``x * log2(e)`` (one MUFU op; relative error about 2^-22 by
    the PTX manual, plus the rounding of ``x * log2(e)``: ``|x| * 2^-24``, below 1e-6 for
    the ``|x| < 20`` that weigh in a bf16 / fp16 sum), ``log`` ``lg2.approx`` times ln 2
    (absolute error about 2^-22 on the log-normaliser), and ``tanh`` ``tanh.approx.f32``,
    whose relative error of about 2^-11 would move a soft-capped logit by up to
    ``cap * 2^-11`` (0.015 at cap 30, 1.5% in its weight): so not with a soft cap.
    Divisions become ``div.full.f32`` (2 ulp) and reciprocals ``rcp.approx.f32`` (sigmoid's
    ``1 / (1 + exp(-x))``, 1 ulp), seen in the PTX of a deviceless H200 compile; so every
    normaliser's weights keep a relative error near 1e-6, far below the inputs' rounding
    (bf16: 2^-9). The
    interpreter ignores the flag (its tests check the exact maths); a device run checks
    the approximate one (``python -m attnjax.check``)."""
    return self.opts.softcap is None

  @property
  def needs_mask(self) -> bool:
    o = self.opts
    return o.is_causal or o.window is not None or self.has_segments or self.S % self.bk != 0


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def make_plan(inputs, opts, sizes: BlockSizes, interpret: bool) -> Plan:
  B, T, N, H = inputs.q.shape
  S, K = inputs.k.shape[1], inputs.k.shape[2]
  return Plan(
    opts=opts,
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Tp=_round_up(T, CONSUMERS * sizes.block_q),
    Sp=_round_up(S, sizes.block_k),
    bq=sizes.block_q,
    bk=sizes.block_k,
    stages=sizes.num_stages,
    has_sink=inputs.sink_logits is not None,
    has_segments=inputs.q_segment_ids is not None,
    interpret=interpret,
  )


def kv_bounds(c: Plan, q0, q_last):
  """``(lo, hi, full_lo, full_hi)``: key blocks ``[lo, hi)`` visited by rows ``q0 .. q_last``,
  ``[full_lo, full_hi)`` of them attended by every row (no element mask; none with segment
  ids, whose mask is data: their blocks are skipped at run time, see ``_kernel``)."""
  bk = c.bk
  lo, hi = jnp.int32(0), jnp.int32(pl.cdiv(c.S, bk))
  flo, fhi = jnp.int32(0), jnp.int32(c.S // bk)
  if c.opts.is_causal:
    hi = jnp.minimum(hi, q_last // bk + 1)
    fhi = jnp.minimum(fhi, (q0 + 1) // bk)
  if c.opts.window is not None:
    left, right = c.opts.window
    lo = jnp.maximum(0, q0 - left) // bk
    hi = jnp.minimum(hi, jnp.maximum(0, q_last + right) // bk + 1)
    flo = jnp.maximum(0, pl.cdiv(jnp.maximum(0, q_last - left), bk))
    fhi = jnp.minimum(fhi, jnp.maximum(0, q0 + right + 1) // bk)
  hi = jnp.maximum(hi, lo)
  if c.has_segments:
    flo, fhi = lo, lo
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  return lo, hi, flo, fhi


def dkdv_plan(c):
  """The dk/dv kernel's plan: the call's, with :data:`DKDV_BLOCK_K` keys per program (the
  padded key length, a multiple of every block_k, is one of 64 too)."""
  return dataclasses.replace(c, bk=min(c.bk, DKDV_BLOCK_K))


def padded(x, L):
  """``x`` ``[B, T, N, H]`` with zero rows up to length ``L`` (no copy when ``T == L``). The
  kernels read and write ``[B, T, N, H]`` in place: a TMA copy of rows ``r`` of head ``n``
  is the strided box ``x[b, r, n]`` (no transposes to and from heads-first)."""
  T = x.shape[1]
  return x if T == L else jnp.pad(x, ((0, 0), (0, L - T), (0, 0), (0, 0)))


def heaviest_first(c: Plan, i, count: int):
  """The query-block program that grid index ``i`` (of ``count``) runs. Causal: the last
  query blocks attend the most keys, and CUDA launches programs about in grid order
  (Mosaic GPU makes the batch axis the fastest, then the query blocks, then the heads), so
  they are taken in reverse, heaviest first, and the last wave holds the lightest (as
  FlashAttention-3's causal scheduler does). Otherwise the blocks weigh alike: ``i``."""
  return jnp.int32(count - 1) - i if c.opts.is_causal else i


def tile_allowed(c: Plan, qpos, kpos, q_seg=None, k_seg=None):
  """Boolean tile of the pairs the structure and segment ids allow (keys past S out)."""
  allowed = kpos < c.S
  if q_seg is not None:
    allowed = allowed & (q_seg == k_seg)
  if c.opts.is_causal:
    allowed = allowed & (kpos <= qpos)
  if c.opts.window is not None:
    left, right = c.opts.window
    allowed = allowed & (kpos >= qpos - left) & (kpos <= qpos + right)
  return allowed


def segment_args(c: Plan, q_seg, kv_seg) -> list:
  """``[q ids [B, Tp], kv ids [B, Sp], q block ranges [B, Tp / bq, 2], kv block ranges]``
  (padded by repeating the last id; each block's [min, max]); [] without segment ids."""
  if not c.has_segments:
    return []
  q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, c.Tp - c.T)), mode="edge")
  kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, c.Sp - c.S)), mode="edge")

  def ranges(x, blk):
    x = jnp.reshape(x, (c.B, -1, blk))
    return jnp.stack([jnp.min(x, axis=-1), jnp.max(x, axis=-1)], axis=-1)

  return [q_seg, kv_seg, ranges(q_seg, c.bq), ranges(kv_seg, c.bk)]
