"""The canonical form of a dense attention call, shared by every dense path.

Implementation behind the public module :mod:`attnjax.options`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, get_args

import jax
import jax.numpy as jnp

from attnjax._src import validators, empty, logits, masks, normalizers
from attnjax._src import static as static_lib

Array = jnp.ndarray

Similarity = Literal["dot", "neg_sq_euclidean"]
SIMILARITIES: tuple[str, ...] = get_args(Similarity)

# Context parallelism (attnjax.parallel): how a call sharded along time over a mesh axis
# reaches the keys of the other shards, and which tokens each shard holds.
ContextStrategy = Literal["ring", "all_gather", "all_to_all"]
CONTEXT_STRATEGIES: tuple[str, ...] = get_args(ContextStrategy)
ContextLayout = Literal["contiguous", "zigzag"]
CONTEXT_LAYOUTS: tuple[str, ...] = get_args(ContextLayout)


def _static_keyword(default: Any, *, validated: Any = dataclasses.MISSING) -> Any:
  """A static keyword, and so a field of :class:`DenseOptions`: its default there is
  ``validated`` when given (what the keyword's default stands for once validated), else the
  keyword's default."""
  metadata = {"static": True}
  if validated is not dataclasses.MISSING:
    metadata["validated"] = validated
  return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, eq=False)
class DenseKeywords:
  """The keywords of a dense call besides ``q, k, v`` and ``implementation``, as given.

  The one definition of their names, defaults and static-ness (``_static_keyword``:
  a static argument under ``jax.jit`` and a field of :class:`DenseOptions`;
  every other one is an array or a tuple of arrays). :func:`validate` takes
  exactly these and turns them into a :class:`DenseInputs` and a
  :class:`DenseOptions`; a family lists the
  ones it takes in its public signature (``options.keywords(without=...)``,
  held equal to the signatures by ``tests/test_options.py``), forwards them
  with ``forwarded`` and declares :func:`static` of them to ``jax.jit``.
  Their meanings: :func:`attnjax.dot_product_attention`.
  """

  bias: Any = None
  mask: Any = None
  is_causal: bool = _static_keyword(False)
  scale: Optional[float] = _static_keyword(None)
  normalizer: str = _static_keyword("softmax")
  normalizer_params: Any = None
  sink_logits: Any = None
  softcap: Optional[float] = _static_keyword(None)
  window: Optional[tuple[int, int]] = _static_keyword(None)
  segment_ids: Any = None
  similarity: str = _static_keyword("dot")
  return_stats: bool = _static_keyword(False)
  score_mod: Optional[Callable[..., Any]] = _static_keyword(None)
  score_mod_args: Any = None
  mask_mod: Optional[Callable[..., Any]] = _static_keyword(None)
  mask_mod_args: Any = None
  block_layout: Any = _static_keyword(None)
  context_axis: Optional[str] = _static_keyword(None)
  context_strategy: Optional[str] = _static_keyword("ring")
  context_layout: Optional[str] = _static_keyword(None, validated="contiguous")


KEYWORDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DenseKeywords))
_KEYWORD_SET = frozenset(KEYWORDS)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(DenseKeywords)}
# The keywords of a dense call that are static under jax.jit (every other one is an array).
STATIC_NAMES: tuple[str, ...] = tuple(
  f.name for f in dataclasses.fields(DenseKeywords) if f.metadata.get("static")
)
# The flags among them (True or False only).
FLAGS: tuple[str, ...] = tuple(
  f.name for f in dataclasses.fields(DenseKeywords) if f.type in (bool, "bool")
)


def keywords(without: tuple[str, ...] = ()) -> tuple[str, ...]:
  """:data:`KEYWORDS` less ``without`` (the dense keywords a family does not take)."""
  unknown = [name for name in without if name not in KEYWORDS]
  if unknown:
    raise ValueError(f"not keywords of a dense call: {unknown}; they are {KEYWORDS}")
  return tuple(name for name in KEYWORDS if name not in without)


def static(names: tuple[str, ...]) -> tuple[str, ...]:
  """The static ones among dense keyword ``names`` (for ``jax.jit(static_argnames=...)``)."""
  return tuple(name for name in names if name in STATIC_NAMES)


def forwarded(names: tuple[str, ...], scope: dict[str, Any]) -> dict[str, Any]:
  """``{name: scope[name]}`` for dense keyword ``names``: a public function's ``locals()``
  (read before it rebinds any of them) as the keywords of :func:`validate`."""
  out = {}
  for name in names:
    out[name] = scope[name]
  return out


# The options of a dense call that no keyword sets: (name, type, default, meaning).
INTERNAL_OPTIONS = (
  (
    "empty_row_logsumexp",
    float,
    0.0,
    "the logsumexp statistic of a query row with no allowed key (0; jax.nn's masked logit "
    "where dot_product_attention returns jax.nn's residual)",
  ),
)


@dataclasses.dataclass(frozen=True)
class DenseOptions:
  """Static, validated options of a dense attention call (hashable).

  Its fields are the static keywords of ``DenseKeywords``, in their order,
  with their types and defaults (``context_layout``'s default as validated;
  ``scale`` a float, ``window`` a pair and ``context_layout`` a name once
  validated), followed by ``INTERNAL_OPTIONS``, which no keyword sets.
  ``tests/test_options.py`` holds the two definitions equal.
  """

  is_causal: bool = False
  scale: Optional[float] = None
  normalizer: str = "softmax"
  softcap: Optional[float] = None
  window: Optional[tuple[int, int]] = None
  similarity: str = "dot"
  return_stats: bool = False
  score_mod: Optional[Callable[..., Any]] = None
  mask_mod: Optional[Callable[..., Any]] = None
  block_layout: Any = None
  context_axis: Optional[str] = None
  context_strategy: Optional[str] = "ring"
  context_layout: Optional[str] = "contiguous"
  # INTERNAL_OPTIONS
  empty_row_logsumexp: float = 0.0

  def local(self) -> "DenseOptions":
    """These options for one device's own call (no context parallelism)."""
    return dataclasses.replace(
      self, context_axis=None, context_strategy="ring", context_layout="contiguous"
    )


@dataclasses.dataclass(frozen=True)
class DenseInputs:
  """Canonical array arguments: bias and mask are rank 4 or None, sink logits ``[1, N, 1, 1]``.

  ``score_mod_args`` / ``mask_mod_args`` are tuples of arrays read by the
  modifiers; ``score_mod_args`` receive gradients. ``normalizer_params`` are a weights-only
  normaliser's learned parameters in the order it declares them, each ``[1, N|1, 1, 1]``
  float32 (every declared one: a call that passes none gets its ``init``); ``()`` otherwise.
  """

  q: Array
  k: Array
  v: Array
  bias: Optional[Array] = None
  mask: Optional[Array] = None
  sink_logits: Optional[Array] = None
  q_segment_ids: Optional[Array] = None
  kv_segment_ids: Optional[Array] = None
  score_mod_args: tuple = ()
  mask_mod_args: tuple = ()
  normalizer_params: tuple = ()


# The DenseOptions fields every platform kernel (cuDNN, splash, the Pallas kernels) is written
# for. A field added later is reported by unknown_options until a kernel lists it, so
# auto-dispatch never drops it.
KERNEL_OPTIONS = (
  "is_causal",
  "window",
  "scale",
  "normalizer",
  "softcap",
  "similarity",
  "return_stats",
  "empty_row_logsumexp",
)
# The DenseInputs fields the platform kernels are written for (reported the same way).
KERNEL_INPUTS = ("q", "k", "v", "bias", "mask", "sink_logits", "q_segment_ids", "kv_segment_ids")


def unknown_options(
  opts: DenseOptions,
  inputs: DenseInputs,
  known_options: Sequence[str],
  known_inputs: Sequence[str],
  who: str,
) -> list[str]:
  """Reasons for every ``DenseOptions`` field outside ``known_options`` set away from its
  default and every ``DenseInputs`` field outside ``known_inputs`` that is given (set away
  from its default: None, or ``()`` for the modifiers' argument tuples).

  A platform kernel lists the fields it honours; a field added later (a new
  option of the dense call) is then reported until the kernel is taught it, so
  auto-dispatch never silently drops it.
  """
  reasons = []
  for f in dataclasses.fields(opts):
    value = getattr(opts, f.name)
    if f.name not in known_options and value != f.default:
      reasons.append(f"{f.name}={value!r} (an option {who} does not know)")
  for f in dataclasses.fields(inputs):
    value = getattr(inputs, f.name)
    # An input is given when it is set away from its default (None, or () for argument tuples).
    default = None if f.default is dataclasses.MISSING else f.default
    given = value is not default if default is None else value != default
    if f.name not in known_inputs and given:
      reasons.append(f"{f.name} (an input {who} does not know)")
  return reasons


# The fused kernels that run the row pre-passes of a ``needs_lse`` normaliser (its forward's
# log-normaliser, its backward's row term from the tiles).
ROW_PASS_KERNELS: frozenset = frozenset({"pallas_gpu", "pallas_tpu"})


def array_refusals(name: str, inputs: DenseInputs, opts: DenseOptions, takes: str) -> list[str]:
  """What a fused dense kernel named ``name`` refuses in every call: a weights-only normaliser
  (the kernel runs the online tile interface), a ``bias`` array, a ``mask`` array (the kernel
  ``takes`` its structure otherwise) and a non-dot similarity."""
  reasons = []
  nz = normalizers.get(opts.normalizer)
  if nz.row_passes and name not in ROW_PASS_KERNELS:
    reasons.append(
      f"normalizer={opts.normalizer!r}, which needs each row's log-normaliser before its "
      f"first tile and its backward row term summed over the tiles ({name} runs neither "
      f"pre-pass; 'blockwise' and 'reference' do)"
    )
  if nz.weights_only:
    reasons.append(
      f"normalizer={opts.normalizer!r}, a weights-only normaliser ({name} runs the online "
      f"tile interface init / visit / finish / tile_backward; 'blockwise' and 'reference' "
      f"run weights-only normalisers)"
    )
  if inputs.bias is not None:
    reasons.append(f"bias ({name} adds no bias array)")
  if inputs.mask is not None:
    reasons.append(f"an explicit mask array ({name} takes {takes})")
  if opts.similarity != "dot":
    reasons.append(f"similarity={opts.similarity!r} ({name} computes dot products)")
  return reasons


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _closed_over(fn: Callable) -> list:
  """Objects a callable closes over directly (closure cells, ``functools.partial`` arguments)."""
  found = []
  while isinstance(fn, functools.partial):
    found.extend(fn.args)
    found.extend(fn.keywords.values())
    fn = fn.func
  for cell in getattr(fn, "__closure__", None) or ():
    try:
      found.append(cell.cell_contents)
    except ValueError:  # an empty cell
      pass
  return found


def check_mod(name: str, fn: Any, args: Any, abstract_inputs: tuple) -> tuple:
  """Validates a ``score_mod`` / ``mask_mod`` and its argument arrays; returns the args as a tuple.

  The function must be callable and hashable (it is a static argument of the
  jitted call: a module-level function, a ``functools.partial`` of hashable
  values, or an object with ``__hash__``), and must not close over traced
  arrays: those would be baked in as constants without gradients, so they
  must be passed in ``<name>_args`` instead. Closure is detected on the
  function's closure cells and on the constants of its traced jaxpr.

  Args:
    name: ``"score_mod"`` or ``"mask_mod"``.
    fn: the callable, or None.
    args: a tuple / list of arrays (or one array), or None / ``()``.
    abstract_inputs: the leading positional inputs of ``fn`` for a trial trace.

  Returns:
    ``args`` as a tuple of arrays.
  """
  args = () if args is None else args
  if not isinstance(args, (tuple, list)):
    args = (args,)
  args = tuple(a if _is_tracer(a) else jnp.asarray(a) for a in args)
  if fn is None:
    if args:
      raise ValueError(f"{name}_args were given ({len(args)} arrays) but {name} is None")
    return ()
  if not callable(fn):
    raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
  try:
    hash(fn)
  except TypeError as e:
    raise TypeError(
      f"{name} must be hashable (it is a static argument of a jitted call): {e}"
    ) from None
  message = (
    f"{name} closes over a traced array; pass the arrays it reads in {name}_args "
    f"(they are then inputs of the call and receive gradients), as "
    f"{name}=fn, {name}_args=(table, ...), with fn(..., table, ...)"
  )
  if any(_is_tracer(x) for x in jax.tree_util.tree_leaves(_closed_over(fn))):
    raise ValueError(message)
  specs = [
    jax.ShapeDtypeStruct((), x.dtype)
    if not hasattr(x, "shape")
    else jax.ShapeDtypeStruct(x.shape, x.dtype)
    for x in abstract_inputs
  ]
  arg_specs = [jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in args]
  try:
    closed = jax.make_jaxpr(fn)(*specs, *arg_specs)
  except Exception as e:  # reported with the signature expected
    raise TypeError(
      f"{name} failed on a trial call {name}({', '.join(str(s) for s in specs)}, "
      f"*{name}_args): {type(e).__name__}: {e}"
    ) from e
  if any(_is_tracer(x) for x in closed.consts):
    raise ValueError(message)
  return args


def check_context(context_axis: Any, context_strategy: Any, context_layout: Any) -> str:
  """Validates the context-parallel keywords; returns the layout (None means contiguous)."""
  if context_axis is not None and not isinstance(context_axis, str):
    raise TypeError(
      f"context_axis must be a shard_map mesh axis name (a str) or None, got {context_axis!r}"
    )
  validators.check_choice("context_strategy", context_strategy, (None,) + CONTEXT_STRATEGIES)
  layout = "contiguous" if context_layout is None else context_layout
  validators.check_choice("context_layout", layout, CONTEXT_LAYOUTS)
  if context_axis is None and (context_strategy not in (None, "ring") or layout != "contiguous"):
    raise ValueError(
      f"context_strategy={context_strategy!r} / context_layout="
      f"{context_layout!r} were given without context_axis (the shard_map axis "
      f"the sequence is sharded over)"
    )
  return layout


def _check_mods(kw: DenseKeywords) -> tuple[tuple, tuple]:
  """``(score_mod_args, mask_mod_args)`` as tuples, the modifiers checked by :func:`check_mod`
  (each where it or its arguments are given)."""
  score_args = mask_args = ()
  index = jnp.zeros((), jnp.int32)
  if kw.score_mod is not None or kw.score_mod_args is not None:
    score_args = check_mod(
      "score_mod",
      kw.score_mod,
      kw.score_mod_args,
      (jnp.zeros((), jnp.float32), index, index, index, index),
    )
  if kw.mask_mod is not None or kw.mask_mod_args is not None:
    mask_args = check_mod("mask_mod", kw.mask_mod, kw.mask_mod_args, (index, index, index, index))
  return score_args, mask_args


def check_normalizer_params(nz: normalizers.Normalizer, params: Any, num_heads: int) -> tuple:
  """``normalizer_params`` of a call as :attr:`DenseInputs.normalizer_params`: a mapping of
  the normaliser's declared parameters (``[N]`` per head, a scalar per layer) to arrays; a
  declared one left out takes its ``init``.

  Raises:
    TypeError: not a mapping, or a value that is not an array.
    ValueError: a name the normaliser does not declare (the closest named), or a shape unlike
      the declared one.
  """
  if params is None:
    params = {}
  if not isinstance(params, Mapping):
    raise TypeError(
      f"normalizer_params must be a mapping of parameter names to arrays, got "
      f"{type(params).__name__}"
    )
  declared = {p.name: p for p in nz.params}
  unknown = [name for name in params if name not in declared]
  if unknown:
    close = difflib.get_close_matches(str(unknown[0]), list(declared), n=1)
    raise ValueError(
      f"normalizer_params {sorted(map(str, unknown))} are not parameters of normalizer="
      f"{nz.name!r} (it declares {list(declared) or 'none'})"
      + (f"; did you mean {close[0]!r}?" if close else "")
    )
  out = []
  for name, p in declared.items():
    if name not in params:
      value = jnp.full(p.shape(num_heads), p.init, jnp.float32)
    else:
      value = params[name]
      if not hasattr(value, "shape") and not isinstance(value, (int, float)):
        raise TypeError(
          f"normalizer_params[{name!r}] must be an array, got {type(value).__name__} {value!r:.60}"
        )
      value = jnp.asarray(value)
      if not jnp.issubdtype(value.dtype, jnp.floating):
        value = value.astype(jnp.float32)
      if value.shape != p.shape(num_heads):
        raise ValueError(
          f"normalizer_params[{name!r}] of normalizer={nz.name!r} must have shape "
          f"{p.shape(num_heads)} ({'one per query head' if p.per_head else 'a scalar'}), "
          f"got {value.shape}"
        )
    out.append(jnp.reshape(value, (1, num_heads if p.per_head else 1, 1, 1)))
  return tuple(out)


def validate(q, k, v, **dense_keywords) -> tuple[DenseInputs, DenseOptions]:
  """Validates a dense call (every argument but ``implementation``); see ``dense.prepare``.

  Modifiers (``score_mod``, ``mask_mod``; see :mod:`attnjax.mods`):
  ``score_mod(z, b, n, i, j, *score_mod_args) -> z'`` receives the float32
  logits ``z`` and int32 index arrays broadcastable against them (batch, query
  head, query position, key position) and must be written with elementwise,
  broadcasting ``jnp`` operations. It is applied after ``scale``, ``softcap``
  and ``bias``, just before the normaliser. ``mask_mod(b, n, i, j,
  *mask_mod_args) -> bool`` (True = may attend) is intersected with every
  other mask. Both are static (hashable) and receive their arrays through
  the ``*_args`` tuples.
  """
  if not _KEYWORD_SET.issuperset(dense_keywords):
    unknown = [name for name in dense_keywords if name not in KEYWORDS]
    raise TypeError(f"unknown keyword(s) {unknown} of a dense call; the keywords are {KEYWORDS}")
  kw = DenseKeywords(**dense_keywords)
  B, T, S, N, K, H, _ = validators.check_qkv(q, k, v)
  # Each check runs where a value could be wrong: a keyword left at None needs none.
  # The live registry (a plain dict lookup); get explains a name it does not hold.
  nz = normalizers.REGISTRY.get(kw.normalizer) or normalizers.get(kw.normalizer)
  if kw.similarity not in SIMILARITIES:
    validators.check_choice("similarity", kw.similarity, SIMILARITIES)
  if not isinstance(kw.is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {kw.is_causal!r}")
  window = None if kw.window is None else validators.check_window(kw.window)
  scale = H**-0.5 if kw.scale is None else kw.scale
  if isinstance(scale, bool) or not isinstance(scale, (int, float)):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got scale={scale!r}")
  softcap = None if kw.softcap is None else validators.check_positive_float("softcap", kw.softcap)
  target = (B, N, T, S)
  sink_logits = kw.sink_logits
  if sink_logits is not None:
    if not nz.accepts_sink_logits:
      raise ValueError(
        f"sink_logits adds a learned null column to softmax; it cannot be combined "
        f"with normalizer={kw.normalizer!r}"
      )
    sink_logits = jnp.reshape(
      validators.check_per_head("sink_logits", sink_logits, N), (1, N, 1, 1)
    )
  bias = None if kw.bias is None else validators.as_rank4("bias", kw.bias, target, kind="bias")
  mask = None if kw.mask is None else validators.as_rank4("mask", kw.mask, target, kind="mask")
  q_seg = kv_seg = None
  if kw.segment_ids is not None:
    q_seg, kv_seg = validators.check_segment_ids(kw.segment_ids, B, T, S)
  score_args = mask_args = ()
  if (
    kw.score_mod is not None
    or kw.score_mod_args is not None
    or kw.mask_mod is not None
    or kw.mask_mod_args is not None
  ):
    score_args, mask_args = _check_mods(kw)
  layout = kw.block_layout
  if layout is not None:
    if kw.mask_mod is None:
      raise ValueError("block_layout (from attnjax.layout.from_mask_mod) needs its mask_mod")
    if (getattr(layout, "q_len", None), getattr(layout, "kv_len", None)) != (T, S):
      raise ValueError(
        f"block_layout must be an attnjax.layout.BlockLayout for q_len={T}, kv_len={S}, got "
        f"{layout!r:.120}"
      )
  context_layout = "contiguous"
  if (
    kw.context_axis is not None
    or kw.context_strategy not in (None, "ring")
    or kw.context_layout is not None
  ):
    context_layout = check_context(kw.context_axis, kw.context_strategy, kw.context_layout)
  params = ()
  if nz.params or kw.normalizer_params is not None:
    params = check_normalizer_params(nz, kw.normalizer_params, N)
  inputs = DenseInputs(
    q, k, v, bias, mask, sink_logits, q_seg, kv_seg, score_args, mask_args, params
  )
  opts = DenseOptions(
    is_causal=kw.is_causal,
    window=window,
    scale=float(scale),
    normalizer=kw.normalizer,
    softcap=softcap,
    similarity=kw.similarity,
    return_stats=bool(kw.return_stats),
    score_mod=kw.score_mod,
    mask_mod=kw.mask_mod,
    block_layout=layout,
    context_axis=kw.context_axis,
    context_strategy=kw.context_strategy,
    context_layout=context_layout,
  )
  return inputs, opts


def apply_score_mod(
  opts: DenseOptions, args: tuple, z: Array, b: Array, n: Array, i: Array, j: Array
) -> Array:
  """``z`` after ``opts.score_mod`` (float32, ``z``'s shape), or ``z`` when there is none."""
  if opts.score_mod is None:
    return z
  out = opts.score_mod(z, b, n, i, j, *args)
  return jnp.broadcast_to(jnp.asarray(out, jnp.float32), z.shape)


def apply_mask_mod(
  opts: DenseOptions, args: tuple, b: Array, n: Array, i: Array, j: Array
) -> Optional[Array]:
  """``opts.mask_mod`` on broadcastable indices as a boolean array, or None when there is none."""
  if opts.mask_mod is None:
    return None
  out = jnp.asarray(opts.mask_mod(b, n, i, j, *args))
  if out.dtype != jnp.bool_:
    raise TypeError(f"mask_mod must return booleans, got dtype {out.dtype}")
  return out


def rows_with_keys(inputs: DenseInputs, opts: DenseOptions, T: int, S: int) -> Optional[Array]:
  """``[B|1, N|1, T]`` True where a query row has at least one allowed key; None if all do."""
  structure_can_empty = (
    inputs.mask is not None
    or inputs.q_segment_ids is not None
    or (opts.window is not None and T > S)
    or opts.mask_mod is not None
  )
  if not structure_can_empty:
    return None
  full = masks.make_attention_mask(
    T,
    S,
    mask=inputs.mask,
    is_causal=opts.is_causal,
    window=opts.window,
    q_segment_ids=inputs.q_segment_ids,
    kv_segment_ids=inputs.kv_segment_ids,
  )
  if opts.mask_mod is not None:
    grid = logits.index_grid(inputs.q.shape[0], (inputs.q.shape[2],), jnp.arange(T), jnp.arange(S))
    full = masks.combine_masks(full, apply_mask_mod(opts, inputs.mask_mod_args, *grid))
  return jnp.any(full, axis=-1)


def engine_entry(run: Callable[..., Any], name: str, engine_static: tuple[str, ...] = ()):
  """An engine's ``attention(q, k, v, **dense_options, **engine_options)``, jitted.

  ``run(inputs, opts, **engine_options)`` is the engine on a validated call;
  the entry validates ``q, k, v`` and the dense keywords (:data:`KEYWORDS`)
  with :func:`validate`, and passes the engine's own keywords (``engine_static``,
  e.g. ``block_sizes``, ``interpret``: static) through.
  """

  def attention(q, k, v, **kwargs):
    if "implementation" in kwargs:
      raise TypeError(f"{name}.attention takes no implementation argument (it is one)")
    engine = {key: kwargs.pop(key) for key in engine_static if key in kwargs}
    inputs, opts = validate(q, k, v, **kwargs)
    if empty.is_empty(q, k):
      return empty.dense(inputs, opts)
    return run(inputs, opts, **engine)

  attention.__name__ = attention.__qualname__ = "attention"
  flags = FLAGS + tuple(name for name in engine_static if name == "interpret")
  return static_lib.jit(
    attention,
    STATIC_NAMES + tuple(engine_static),
    flags=flags,
    keywords=KEYWORDS + tuple(engine_static),
    name=f"{name}.attention",
  )
