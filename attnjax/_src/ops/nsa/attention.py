"""Native Sparse Attention (Yuan et al. 2025): compressed, selected and window branches, gated.

Implementation behind the public module :mod:`attnjax.nsa`.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, empty, normalizers, op, static, trust
from attnjax._src.kernels import selected
from attnjax._src.ops.nsa import blockwise, reference, rules
from attnjax._src.ops.nsa.rules import Compressor, NSAOptions, NSAStats

Array = jnp.ndarray


class NSAInputs(NamedTuple):
  """The arrays of a validated call.

  Attributes:
    q: ``[B, T, N, H]``.
    k: the compressed, selected and window branches' keys, each ``[B, S, K, H]`` (one array
      three times when shared).
    v: their values, each ``[B, S, K, Hv]``.
    gates: ``[B, T, N, 3]``.
    compressor: ``(key compressor, value compressor)``, or None: mean pooling.
  """

  q: Array
  k: tuple[Array, Array, Array]
  v: tuple[Array, Array, Array]
  gates: Array
  compressor: Optional[tuple[Compressor, Compressor]]


def _compressed(inputs: NSAInputs, opts: NSAOptions) -> tuple[Array, Array]:
  ck, cv = (None, None) if inputs.compressor is None else inputs.compressor
  kw = dict(block_length=opts.block_length, stride=opts.stride)
  return rules.compress(inputs.k[0], ck, **kw), rules.compress(inputs.v[0], cv, **kw)


def _reference(inputs: NSAInputs, opts: NSAOptions):
  """The ``"reference"`` engine: :func:`reference.attend` at positions ``0 .. T - 1``."""
  k_c, v_c = _compressed(inputs, opts)
  T = inputs.q.shape[1]
  return reference.attend(inputs.q, jnp.arange(T), inputs.k, inputs.v, k_c, v_c, inputs.gates, opts)


def _blockwise(inputs: NSAInputs, opts: NSAOptions):
  """The ``"blockwise"`` engine (:mod:`attnjax._src.ops.nsa.blockwise`)."""
  k_c, v_c = _compressed(inputs, opts)
  return blockwise.compute(inputs.q, inputs.k, inputs.v, k_c, v_c, inputs.gates, opts)


# The selected-block kernels' platforms by engine name, and where each platform's run (the
# error of a named engine lowered elsewhere).
KERNEL_PLATFORMS = {"pallas_tpu": "tpu", "mosaic_gpu": "cuda"}
WHERE = {"tpu": "runs on a TPU only (a Mosaic kernel)", "cuda": "runs on a CUDA GPU (sm_90) only"}


def _selected_args(inputs: NSAInputs, opts: NSAOptions, interpret: bool = False):
  """The selected branch's kernel call as the kernels see it: ``(q, k, v, block_idx)``
  (``block_idx`` as its shape: every kernel decision reads only shapes) and its keywords."""
  B, T, _, _ = inputs.q.shape
  K = inputs.k[1].shape[2]
  idx = jax.ShapeDtypeStruct((B, T, K, opts.num_selected), jnp.int32)
  kw = dict(
    block_size=opts.selection_block,
    scale=opts.scale,
    normalizer=opts.normalizers[1],
    interpret=interpret,
  )
  return (inputs.q, inputs.k[1], inputs.v[1], idx), kw


def trust_class(inputs: NSAInputs, opts: NSAOptions) -> str:
  """The case class the selected-block kernels' verdicts name for a call
  (:func:`attnjax._src.kernels.selected.case_class`: the selected branch's normaliser, its
  loop order and q's dtype, e.g. ``"softmax selected_kv bfloat16"``)."""
  args, kw = _selected_args(inputs, opts)
  try:
    return selected.case_class("tpu", *args, **kw)  # the loop order is the platforms' one
  except (ValueError, TypeError):  # a call the kernels refuse (unsupported says why)
    return trust.case_class(opts.normalizers[1], "selected_unsupported", inputs.q.dtype)


def _kernel_engine(engine: str) -> op.Engine:
  """The engine running NSA with its selected branch on the ``engine`` selected-block kernel
  (:mod:`attnjax._src.kernels.selected`), vouched for by that kernel's verdicts
  (``selected_<engine>``)."""
  platform = KERNEL_PLATFORMS[engine]

  def compute(inputs: NSAInputs, opts: NSAOptions, interpret: bool = False):
    def selected_branch(q, k, v, idx, opts, want_stats):
      del want_stats  # refused by unsupported
      out = selected.selected_attention(
        q,
        k,
        v,
        idx,
        implementation=engine,
        block_size=opts.selection_block,
        scale=opts.scale,
        normalizer=opts.normalizers[1],
        interpret=interpret,
      )
      return out, None

    k_c, v_c = _compressed(inputs, opts)
    return blockwise.compute(
      inputs.q, inputs.k, inputs.v, k_c, v_c, inputs.gates, opts, selected_branch=selected_branch
    )

  def unsupported(inputs: NSAInputs, opts: NSAOptions, interpret: bool = False) -> list[str]:
    reasons = ["return_stats (the kernel returns no statistics)"] if opts.return_stats else []
    args, kw = _selected_args(inputs, opts, interpret)
    try:
      return reasons + selected.unsupported(platform, *args, **kw)
    except (ValueError, TypeError) as e:  # e.g. a dtype the kernels do not take
      return reasons + [str(e)]

  return op.Engine(
    engine,
    compute,
    unsupported,
    platform=platform,
    where=WHERE[platform],
    vouched_by="device-check",
    trust_name=selected.TRUST_NAMES[platform],
  )


def _empty(inputs: NSAInputs, opts: NSAOptions):
  B, T, N, _ = inputs.q.shape
  out = jnp.zeros((B, T, N, inputs.v[0].shape[3]), inputs.q.dtype)
  if not opts.return_stats:
    return out
  branch = empty.empty_stats(B, N, T)
  gate_mean = jnp.zeros((B, N, 3), jnp.float32)
  if T:
    gate_mean = jnp.mean(jnp.moveaxis(inputs.gates.astype(jnp.float32), 1, 2), axis=2)
  return out, NSAStats(branch, branch, branch, gate_mean)


# The NSA op: its call is ``(NSAInputs, NSAOptions)``.
ENGINES: dict[str, op.Engine] = {
  e.name: e
  for e in (
    op.Engine("reference", _reference, op.supports_everything),
    op.Engine("blockwise", _blockwise, op.supports_everything),
    _kernel_engine("pallas_tpu"),
    _kernel_engine("mosaic_gpu"),
  )
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
# Auto-dispatch takes a platform's selected-block kernel only where the kernel-trust rule allows
# it (its selected_* verdict passed the call's class, or attnjax.config.kernels = "all").
PREFERENCES: dict[str, tuple[str, ...]] = {"cuda": ("mosaic_gpu",), "tpu": ("pallas_tpu",)}
FALLBACK: tuple[str, ...] = ("blockwise",)
OP = op.register(
  op.Op(
    "nsa",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=_empty,
    is_empty=lambda inputs, opts: empty.is_empty(inputs.q, inputs.k[0]),
    trust_class=trust_class,
    samples=lambda: _samples(),
  )
)


# ---------------------------------------------------------------------------
# Validation.


def _branches(name: str, x: Any) -> tuple[Array, Array, Array]:
  """An array shared by the three branches, or one per branch."""
  if isinstance(x, (tuple, list)):
    if len(x) != 3:
      raise ValueError(
        f"{name} must be one array or three (compressed, selected, window), got a sequence "
        f"of {len(x)}"
      )
    return tuple(jnp.asarray(a) for a in x)
  x = jnp.asarray(x)
  return (x, x, x)


def check_block_sizes(block_length: Any, stride: Any, selection_block: Any) -> tuple[int, ...]:
  """``(l, d, l')`` as ints: ``1 <= d <= l``, ``l % d == 0``, ``l' % d == 0`` (ValueError or
  TypeError naming the values)."""
  l = validators.check_positive_int("block_length", block_length)
  d = validators.check_positive_int("stride", stride)
  ls = validators.check_positive_int("selection_block", selection_block)
  if d > l:
    raise ValueError(
      f"stride={d} > block_length={l}: compressed blocks of l keys start every d <= l keys"
    )
  if l % d or ls % d:
    raise ValueError(
      f"block sizes do not fit: block_length={l} and selection_block={ls} must be multiples "
      f"of stride={d} (the selection scores count shared runs of d keys)"
    )
  return l, d, ls


def _check_compressor(compressor: Any, l: int, H: int, Hv: int):
  if compressor is None:
    return None
  if not isinstance(compressor, (tuple, list)) or len(compressor) != 2:
    raise TypeError(
      "compressor must be None (mean pooling) or a pair (key Compressor, value Compressor), "
      f"got {type(compressor).__name__}"
    )
  out = []
  for name, c, X in (
    ("compressor[0] (keys)", compressor[0], H),
    ("compressor[1] (values)", compressor[1], Hv),
  ):
    if not isinstance(c, Compressor):
      if not isinstance(c, (tuple, list)) or len(c) != 5:
        raise TypeError(f"{name} must be an attnjax.nsa.Compressor, got {type(c).__name__}")
      c = Compressor(*c)
    c = Compressor(*(jnp.asarray(a) for a in c))
    M = validators.shape_of(c.w1)[-1] if np.ndim(c.w1) == 2 else None
    want = {"position": (l, X), "w1": (l * X, M), "b1": (M,), "w2": (M, X), "b2": (X,)}
    for field, shape in want.items():
      got = validators.shape_of(getattr(c, field))
      if got != shape:
        raise ValueError(
          f"{name}.{field} must have shape {shape} for block_length={l} and head dim {X}, got {got}"
        )
      validators.check_floating(f"{name}.{field}", getattr(c, field))
    out.append(c)
  return tuple(out)


def _normalizers(normalizer: Any) -> tuple[str, str, str]:
  names = (normalizer,) * 3 if isinstance(normalizer, str) else normalizer
  if not isinstance(names, tuple) or len(names) != 3:
    raise ValueError(
      f"normalizer must be a name or three names (compressed, selected, window), got {normalizer!r}"
    )
  for name in names:
    validators.check_choice("normalizer", name, normalizers.NORMALIZERS)
  return names


def validate(
  q,
  k,
  v,
  gates,
  *,
  compressor,
  block_length,
  stride,
  selection_block,
  num_selected,
  num_initial,
  num_local,
  window,
  scale,
  normalizer,
  return_stats,
) -> tuple[NSAInputs, NSAOptions]:
  """The canonical call ``(NSAInputs, NSAOptions)``, or ValueError / TypeError naming the
  argument and the values seen."""
  ks, vs = _branches("k", k), _branches("v", v)
  q = jnp.asarray(q)
  for b in range(3):
    B, T, S, N, K, H, Hv = validators.check_qkv(q, ks[b], vs[b])
  for b in (1, 2):
    if ks[b].shape != ks[0].shape or vs[b].shape != vs[0].shape:
      raise ValueError(
        f"the branches' keys and values must share their shapes, got k {[x.shape for x in ks]}, "
        f"v {[x.shape for x in vs]}"
      )
  if T != S:
    raise ValueError(
      f"nsa_attention is causal self-attention: q and k need the same length, got "
      f"q {q.shape} and k {ks[0].shape}"
    )
  l, d, ls = check_block_sizes(block_length, stride, selection_block)
  n = validators.check_positive_int("num_selected", num_selected)
  n0 = validators.check_positive_int("num_initial", num_initial, minimum=0)
  nl = validators.check_positive_int("num_local", num_local, minimum=0)
  window = validators.check_positive_int("window", window)
  gates = jnp.asarray(gates)
  if validators.shape_of(gates) != (B, T, N, 3):
    raise ValueError(
      f"gates must have shape [B, T, N, 3] = {(B, T, N, 3)} (compressed, selected, window "
      f"per query head), got {validators.shape_of(gates)}"
    )
  validators.check_floating("gates", gates)
  comp = _check_compressor(compressor, l, H, Hv)
  scale = H**-0.5 if scale is None else validators.check_positive_float("scale", scale)
  names = _normalizers(normalizer)
  return_stats = static.check_flag("return_stats", return_stats)
  # The options' relations last: an invalid option is named before a pair that does not fit.
  if n0 + nl > n:
    raise ValueError(
      f"num_initial={n0} + num_local={nl} always-selected blocks exceed num_selected={n}"
    )
  blocks = rules.num_selection_blocks(S, ls)
  if S > 0 and n > blocks:
    raise ValueError(
      f"num_selected={n} is larger than the {blocks} selection blocks of S={S} keys "
      f"(selection_block={ls})"
    )
  opts = NSAOptions(
    block_length=l,
    stride=d,
    selection_block=ls,
    num_selected=n,
    num_initial=n0,
    num_local=nl,
    window=int(window),
    scale=float(scale),
    normalizers=names,
    return_stats=return_stats,
  )
  return NSAInputs(q, ks, vs, gates, comp), opts


def _nsa(q, k, v, gates, compressor, *, implementation, **static_options):
  inputs, opts = validate(q, k, v, gates, compressor=compressor, **static_options)
  return op.run(OP, (inputs, opts), implementation)


_STATIC = (
  "block_length",
  "stride",
  "selection_block",
  "num_selected",
  "num_initial",
  "num_local",
  "window",
  "scale",
  "normalizer",
  "return_stats",
  "implementation",
)
_nsa_jit = jax.jit(_nsa, static_argnames=_STATIC)


def _nsa_attention(
  q: Array,
  k: Union[Array, Sequence[Array]],
  v: Union[Array, Sequence[Array]],
  gates: Array,
  *,
  compressor: Optional[tuple[Compressor, Compressor]] = None,
  block_length: int = 32,
  stride: int = 16,
  selection_block: int = 64,
  num_selected: int = 16,
  num_initial: int = 1,
  num_local: int = 2,
  window: int = 512,
  scale: Optional[float] = None,
  normalizer: Union[str, tuple[str, str, str]] = "softmax",
  implementation: Optional[ImplementationName] = None,
  return_stats: bool = False,
):
  """Native Sparse Attention: three causal branches, each normalised on its own, gated.

  ``out_t = g_cmp o_cmp + g_slc o_slc + g_win o_win`` per query head, with (``t`` the
  query's position, keys at ``0 .. S - 1``):

  - compressed: attention over the compressed keys and values ``phi(k[c d : c d + l])`` of
    the blocks that have ended (``c d + l - 1 <= t``); no such block: zero;
  - selected: attention over the raw keys ``s <= t`` of the ``n`` selection blocks of ``l'``
    keys chosen for the query: the first ``num_initial`` and the ``num_local`` ending at the
    query's own block always, then the highest compressed-branch weight mapped onto selection
    blocks (:func:`attnjax.nsa.selection_scores`) summed over the query heads of the GQA
    group, ties to the lower block; the selection carries no gradient;
  - window: attention over the raw keys ``t - w .. t``.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]`` shared by the branches, or three (compressed, selected,
      window; the paper's choice); ``S == T``, ``N % K == 0``.
    v: values ``[B, S, K, Hv]``, or three.
    gates: ``[B, T, N, 3]`` the branches' gates (the layer's ``sigmoid(x W_g)``).
    compressor: ``(key Compressor, value Compressor)``, the learned MLPs ``phi``
      (:class:`attnjax.nsa.Compressor`), or None: mean pooling.
    block_length: ``l``, keys per compressed block.
    stride: ``d <= l`` between compressed blocks; ``l`` and ``l'`` multiples of it.
    selection_block: ``l'``, keys per selection block.
    num_selected: ``n``, selection blocks per query (at most ``ceil(S / l')``).
    num_initial: leading blocks always selected.
    num_local: blocks up to the query's own always selected.
    window: ``w >= 1``.
    scale: logit scale; None means ``H ** -0.5``.
    normalizer: a name of :data:`attnjax.normalizers.NORMALIZERS`, or one per branch
      (compressed, selected, window); the selection reads the compressed branch's weights.
    implementation: None (auto: ``"blockwise"``, or a platform's selected-block kernel
      where the kernel-trust rule allows it), ``"reference"``, ``"blockwise"``,
      ``"pallas_tpu"`` or ``"mosaic_gpu"`` (the engines of :data:`~attnjax.nsa.OP`).
    return_stats: also return :class:`attnjax.nsa.NSAStats` (each branch's
      :class:`attnjax.AttentionStats` and the gate means).

  Returns:
    ``out [B, T, N, Hv]`` in ``q``'s dtype, or ``(out, NSAStats)``.

  References:
    Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and Natively Trainable
    Sparse Attention", arXiv:2502.11089.
  """
  implementation = op.check_implementation(OP, implementation, where="nsa_attention")
  if isinstance(k, list):
    k = tuple(k)
  if isinstance(v, list):
    v = tuple(v)
  if isinstance(compressor, list):
    compressor = tuple(compressor)
  return _nsa_jit(
    q,
    k,
    v,
    gates,
    compressor,
    block_length=block_length,
    stride=stride,
    selection_block=selection_block,
    num_selected=num_selected,
    num_initial=num_initial,
    num_local=num_local,
    window=window,
    scale=scale,
    normalizer=normalizer,
    return_stats=return_stats,
    implementation=implementation,
  )


nsa_attention = static.canonicalized(_nsa_attention, _STATIC)


def selection_scores(
  p: Array, *, block_length: int, stride: int, selection_block: int, num_keys: int
) -> Array:
  """Compressed-branch weights ``p [..., C]`` as selection-block scores ``[..., ceil(S / l')]``.

  Selection block ``j`` gets ``sum_c (shared keys of block c and j) / d * p[c]``
  (:mod:`attnjax.nsa` explains the choice). ``p`` itself when ``l = l' = d``.
  """
  l, d, ls = check_block_sizes(block_length, stride, selection_block)
  return rules.selection_scores(p, block_length=l, stride=d, selection_block=ls, num_keys=num_keys)


def compress(x: Array, compressor: Optional[Compressor], *, block_length: int, stride: int):
  """NSA's compression of keys or values ``[B, S, K, X]`` -> ``[B, C, K, Y]``,
  ``C = floor((S - l) / d) + 1`` whole blocks (none when ``S < l``): the learned MLP
  :class:`Compressor` over each block of ``l`` rows, or the mean (``compressor=None``)."""
  l, d, _ = check_block_sizes(block_length, stride, stride)
  return rules.compress(jnp.asarray(x), compressor, block_length=l, stride=d)


def _sample_arrays(q, k, v):
  """A sample call's gates: a deterministic draw in ``(0.1, 0.9)`` from the shape of ``q``,
  in its dtype where that is floating."""
  shape = tuple(np.shape(q))[:3]
  rng = np.random.default_rng([3, *shape])
  dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  return q, k, v, {"gates": jnp.asarray(rng.uniform(0.1, 0.9, shape + (3,)), dtype)}


def _samples() -> tuple[op.Sample, ...]:
  # Small blocks so the suites' short sequences (T = 3 .. 32) have several of each: two of
  # l' = 2 keys selected per query (the local one and the top-scoring one).
  return (
    op.Sample(
      nsa_attention,
      options=dict(
        block_length=4,
        stride=2,
        selection_block=2,
        num_selected=2,
        num_initial=0,
        num_local=1,
        window=3,
      ),
      arrays=_sample_arrays,
      self_only=True,
      flags=("return_stats",),  # its NSAStats: each branch's, tested in tests/test_nsa.py
      static=(
        ("scale", 0.5),
        ("block_length", 2),
        ("stride", 1),
        ("selection_block", 2),
        ("num_selected", 1),
        ("num_initial", 1),
        ("window", 2),
      ),
      choices=(
        ("block_length", (2, 4)),
        ("stride", (1, 2)),
        ("selection_block", (2, 4)),
        ("num_selected", (1, 2)),
        ("num_initial", (0, 1)),
        ("window", (1, 2, 5)),
        ("normalizer", normalizers.NORMALIZERS),
      ),
      defects=(
        ("block_length", (0,)),
        ("stride", (0, 16)),
        ("num_selected", (0,)),
        ("window", (0,)),
        ("normalizer", ("softmaxx",)),
      ),
    ),
  )
