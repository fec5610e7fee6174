"""The base of the per-family attention specs: :class:`.AttentionSpec`, :class:`.Call`, registry.

See :mod:`attnjax.nn.specs` for the families and how to add one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Optional

import jax.numpy as jnp
from flax import nnx

from attnjax._src import feature_maps, normalizers, op, validators
from attnjax._src.nn import _context, _layers
from attnjax._src.nn.rope import apply_rope

Array = jnp.ndarray

STREAMING_ROPE = ("cache", "absolute")
PATTERNS = (
  "causal",
  "sliding_window",
  "strided",
  "fixed",
  "global_window",
  "bigbird",
  "sinks_window",
  "dilated_window",
)
FEATURE_MAPS = feature_maps.DETERMINISTIC + feature_maps.RANDOM

# Initial cosine temperature per convention: Swin v2 learns log(scale) from log 10;
# "scale" learns the multiplier itself; nGPT's s_qk starts at 1 (logits sqrt(H) cos).
DEFAULT_TEMPERATURE = {"swin": math.log(10.0), "scale": 10.0, "ngpt": 1.0}


def check_type(name: str, value: Any, types, what: str) -> None:
  """Raises TypeError naming ``name`` unless ``value`` is one of ``types`` (a bool is not an
  int unless ``bool`` is listed); ``what`` describes the expected type in the message."""
  if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
    raise TypeError(f"{name} must be {what}, got {value!r}")
  if not isinstance(value, types):
    raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def check_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
  """Raises TypeError unless ``value`` is a Python int (or None with ``allow_none``: a config
  holds JSON values), ValueError when it is below ``minimum``; both name ``name``."""
  if value is not None:
    check_type(name, value, int, "an int")
  validators.check_positive_int(name, value, allow_none=allow_none, minimum=minimum)


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of the layer, as a spec sees it.

  Attributes:
    mask: user mask, rank 4, broadcastable to ``[B, N, T, S]`` (None = none).
    segment_ids: ``[B, T]`` int segment ids of self-attention (None = none).
    positions: RoPE positions ``[T]`` or ``[B, T]`` (None = sequence positions).
    cross: keys and values come from a second sequence.
    cache: the self-attention decode cache (None = full forward).
    capture: statistics are being captured (``nnx.capture``).
    sow_weights: sow the attention weights too (only when capturing).
    inputs: the layer's input ``x`` ``[B, T, D]`` (the queries' sequence), for
      families whose gates or decays are projected from it (None = not given).
  """

  mask: Optional[Array] = None
  segment_ids: Optional[Array] = None
  positions: Optional[Array] = None
  cross: bool = False
  cache: Any = None
  capture: bool = False
  sow_weights: bool = False
  inputs: Optional[Array] = None

  def decode_positions(self, start: Array, batch: int, length: int):
    """``(idx [T], seg [B, T], rope [B, T])`` of a decode call's new tokens (int32).

    ``start`` is the cache's index (tokens seen so far): ``idx`` are the new
    tokens' sequence positions, ``seg`` their segment ids (0 without
    ``segment_ids``), ``rope`` their RoPE positions (``positions``, else ``idx``).
    """
    idx = jnp.arange(length, dtype=jnp.int32) + start
    seg = (
      jnp.zeros((batch, length), jnp.int32)
      if self.segment_ids is None
      else self.segment_ids.astype(jnp.int32)
    )
    rope = jnp.broadcast_to(
      idx if self.positions is None else self.positions, (batch, length)
    ).astype(jnp.int32)
    return idx, seg, rope


def check_normalizer(normalizer: Any) -> normalizers.Normalizer:
  """The registered normaliser a spec names (TypeError / ValueError naming the field)."""
  return normalizers.get(normalizer)


def init_normalizer_params(layer, normalizer: str, param_dtype) -> None:
  """``layer.normalizer_params``: the learned parameters a weights-only normaliser declares
  (:class:`attnjax.normalizers.Param`), ``[N]`` per head or a scalar, at their ``init``."""
  declared = normalizers.get(normalizer).params
  if declared:
    layer.normalizer_params = nnx.Dict(
      {
        p.name: _layers.param(
          jnp.full(p.shape(layer.num_heads), p.init, param_dtype), ("heads",) if p.per_head else ()
        )
        for p in declared
      }
    )


def normalizer_param_kwargs(layer, normalizer: str) -> dict[str, Any]:
  """``{"normalizer_params": {...}}`` of a layer whose normaliser declares parameters, else {}."""
  declared = normalizers.get(normalizer).params
  if not declared:
    return {}
  return {"normalizer_params": {p.name: layer.normalizer_params[p.name][...] for p in declared}}


def _rope(layer, x: Array, positions: Array) -> Array:
  """``x`` rotated by the layer's RoPE (base and scaling) at ``positions``; as is without RoPE."""
  c = layer.config
  if c.rope_theta is None:
    return x
  return apply_rope(x, positions, c.rope_theta, scaling=c.rope_scaling, rotary_dim=c.rope_dim)


def run_and_sow(
  layer,
  run: Callable,
  q: Array,
  k: Array,
  v: Array,
  call: Call,
  *,
  weights: Optional[Callable[[], Array]] = None,
) -> Array:
  """``run(q, k, v, return_stats=...)``; inside ``nnx.capture`` also sows stats and weights.

  Under a mesh with a ``context`` axis the call runs sequence-sharded (``attnjax._src.nn._context``).

  The weights default to ``run`` applied to identity values: every family is
  linear in ``v``, so ``attn(q, k, I)`` is exactly the weight matrix the layer
  used, with its mask, normaliser and null columns (``O(T S^2)``: for inspection).

  Args:
    layer: the :class:`~attnjax.nn.Attention` layer (it sows).
    run: the family's attention call, ``run(q, k, v, return_stats=...)``.
    q: ``[B, T, N, H]``.
    k: ``[B, S, K, H]``.
    v: ``[B, S, K, Hv]``.
    call: the :class:`.Call` (whether a capture is on and asks for weights).
    weights: a function returning the weights ``[B, N, T, S]``, instead of the default.

  Returns:
    The output ``[B, T, N, Hv]``.
  """
  if not call.capture:
    return _context.run(run, q, k, v, kwargs=dict(return_stats=False))
  if call.sow_weights:
    # The weights are materialised ([B, N, T, S]) anyway: the whole capture runs partitioned
    # by XLA. A sequence-sharded ring beside the XLA-partitioned weights in one program
    # deadlocked the CPU runtime's collectives on jax 0.12 (the probe of a context mesh).
    out, stats = run(q, k, v, return_stats=True)
  else:
    out, stats = _context.run(run, q, k, v, kwargs=dict(return_stats=True))
  _layers.sow(layer, "attention_stats", stats)
  if call.sow_weights:
    if weights is None:
      B, S, K, _ = k.shape
      eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
      w = run(q.astype(jnp.float32), k.astype(jnp.float32), eye, return_stats=False)
      w = jnp.transpose(w, (0, 2, 1, 3))  # [B, T, N, S] -> [B, N, T, S]
    else:
      w = weights()
    _layers.sow(layer, "weights", w)
  return out


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Base of the family specs (see the module docstring).

  Subclasses set ``family`` and ``optional_params`` (names of the layer
  attributes their parameters may take; the layer declares them ``None``
  before ``init_params`` runs) and override the methods below.

  Attributes:
    op: the name of the op the family's function runs (:data:`attnjax._src.op.OPS`): the
      one map from the layer's family names onto the ops' (``"retnet"``, ``"gla"`` and
      ``"mamba2_decay"`` run ``"gated_linear"``). A subclass naming one takes its
      ``implementations`` and ``deprecated_implementations`` from the op.
    implementations: the ``implementation`` names the family's function takes
      (besides None = auto): the op's engines; :class:`attnjax.nn.AttentionConfig` checks
      its ``implementation`` against them (and ``deprecated_implementations``).
    deprecated_implementations: old names still accepted, ``{old: new}`` (the op's
      ``renamed``).
    takes_segment_ids: the family can keep packed documents apart
      (``segment_ids``).
  """

  family: ClassVar[str] = ""
  op: ClassVar[str] = ""
  optional_params: ClassVar[tuple[str, ...]] = ()
  implementations: ClassVar[tuple[str, ...]] = ()
  deprecated_implementations: ClassVar[dict[str, str]] = {}
  takes_segment_ids: ClassVar[bool] = True
  takes_cross: ClassVar[bool] = True
  # The values are the layer's v as the weights mix them (not a latent expanded after the
  # weights, MLA): the output for one-hot values is a column of the weights.
  plain_values: ClassVar[bool] = True

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.op:  # the engines and their old names: the op's, read from the op registry
      family_op = op.OPS[cls.op]
      cls.implementations = family_op.implementations
      cls.deprecated_implementations = dict(family_op.renamed)

  def __post_init__(self):
    self.validate()

  @classmethod
  def takes_implementation(cls, name: Optional[str]) -> bool:
    """Whether the family's function takes ``implementation=name`` (None always)."""
    return name is None or name in cls.implementations or name in cls.deprecated_implementations

  @classmethod
  def check_implementation(cls, name: Optional[str]) -> None:
    """ValueError naming the field and the family unless ``takes_implementation``."""
    try:
      # Deprecated names pass here unwarned (old run directories load); the
      # function warns when called.
      validators.check_implementation(
        "implementation", name, cls.implementations + tuple(cls.deprecated_implementations)
      )
    except ValueError as e:
      raise ValueError(f"{e} (the implementations of family={cls.family!r})") from None

  def has_null_column(self) -> bool:
    """Whether the weights have a null column (a row may put mass on no key)."""
    return False

  def fixed_head_dim(self) -> Optional[int]:
    """The query head dim the family fixes itself (MLA's ``d_n + d_r``), or None: the
    config's ``head_dim`` (or ``d_model // num_heads``)."""
    return None

  def value_head_dim(self, head_dim: int) -> int:
    """``Hv``, the width of each head's output (``head_dim`` unless the family sets it)."""
    return head_dim

  def init_projections(self, layer, d_model: int, lin: dict) -> None:
    """Creates the layer's projections: ``q_proj``, ``k_proj``, ``v_proj`` (``[D, heads H]``)
    and ``o_proj`` (``[N Hv, D]``); ``lin`` holds the rngs and dtypes."""
    N, K, H, c = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.config
    bias = c.qkv_bias
    layer.q_proj = _layers.linear(d_model, N * H, ("embed", "heads"), use_bias=bias, **lin)
    layer.k_proj = _layers.linear(d_model, K * H, ("embed", "heads"), use_bias=bias, **lin)
    layer.v_proj = _layers.linear(d_model, K * H, ("embed", "heads"), use_bias=bias, **lin)
    Hv = self.value_head_dim(H)
    layer.o_proj = _layers.linear(N * Hv, d_model, ("heads", "embed"), use_bias=c.out_bias, **lin)

  def project(self, layer, x: Array):
    """The raw projections ``(q, k, v)`` of ``x [B, T, D]`` that :meth:`attend` takes."""
    return (
      layer._heads(layer.q_proj, x, layer.num_heads),
      layer._heads(layer.k_proj, x, layer.num_kv_heads),
      layer._heads(layer.v_proj, x, layer.num_kv_heads),
    )

  def rotate(self, layer, x: Array, positions: Array) -> Array:
    """``x`` (queries or keys ``[B, T, heads, .]``) rotated by the layer's RoPE at
    ``positions``; as is without RoPE."""
    return _rope(layer, x, positions)

  def sown_weights(self, layer, run: Callable, q: Array, k: Array, v: Array):
    """A function returning the weights ``[B, N, T, S]`` of ``run(q, k, v)`` to sow, or None:
    ``run`` applied to identity values (``run_and_sow``'s default)."""
    del layer, run, q, k, v
    return None

  def validate(self) -> None:
    """Checks this spec's own fields (ValueError/TypeError naming the field)."""

  def check(self, config) -> None:
    """Checks the spec against the common fields of its :class:`.AttentionConfig`."""

  def init_params(self, layer, rngs, param_dtype) -> None:
    """Creates the family's parameters as attributes of ``layer``."""

  def function(self, layer) -> Callable:
    """The pure attention function: the layer's injected one, or the family's."""
    return layer.attention_fn or self.default_function(layer)

  def default_function(self, layer) -> Callable:
    """The family's own pure attention function (used when none is injected).

    Raises:
      NotImplementedError: a spec that does not define one.
    """
    raise NotImplementedError

  def attend(self, layer, q: Array, k: Array, v: Array, call: Call):
    """``(out [B, T, N, Hv], new self-attention cache or None)`` of projected q, k, v."""
    raise NotImplementedError

  def check_decode_cache(self, layer, cache, cache_type: type) -> None:
    """Raises unless ``cache`` is this family's ``cache_type`` and the layer is causal."""
    if not isinstance(cache, cache_type):
      raise TypeError(
        f"cache must be a {cache_type.__name__} for family={self.family!r}, "
        f"got {type(cache).__name__}"
      )
    if not layer.config.is_causal:
      raise ValueError(
        "decode needs is_causal=True: an encoder layer (is_causal=False) has no decode"
      )

  def init_cache(self, layer, batch_size: int, max_len: int):
    """The family's empty decode cache for ``batch_size`` sequences of up to ``max_len`` tokens.

    Args:
      layer: the :class:`.Attention` layer (its config and parameters).
      batch_size: ``B``.
      max_len: the longest sequence the cache will hold.

    Returns:
      The cache (a NamedTuple of arrays, e.g. :class:`~attnjax.nn.KVCache`).

    Raises:
      NotImplementedError: a spec that does not define one.
    """
    raise NotImplementedError

  def cache_capacity(self, layer, max_len: int) -> int:
    """Key slots the decode cache keeps for ``max_len`` tokens (``max_len`` unless bounded)."""
    return max_len

  def allowed_mask(self, layer, length: int) -> Array:
    """Which (query, key) pairs the layer's training forward allows.

    Args:
      layer: the :class:`.Attention` layer.
      length: ``T`` (self-attention).

    Returns:
      Boolean ``[1 or B, 1 or N, T, S]``, True = may attend (``S`` includes a k/v bias
      slot where the layer has one).

    Raises:
      NotImplementedError: a spec that does not define one.
    """
    raise NotImplementedError

  def prepare_qk(self, layer, q: Array, k: Array):
    """q and k before RoPE, as the layer feeds them on (e.g. a pre-RoPE QK norm)."""
    return q, k

  def compared_qk(self, layer, q: Array, k: Array, positions: Array):
    """What the attention function compares: ``prepare_qk``, then RoPE."""
    q, k = self.prepare_qk(layer, q, k)
    return self.rotate(layer, q, positions), self.rotate(layer, k, positions)

  def to_dict(self) -> dict[str, Any]:
    """The spec's fields as a dict (``AttentionConfig.to_dict`` nests it)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def options_from_json(cls, options: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``to_dict``'s JSON-friendly conversions (lists back to tuples)."""
    return options

  def replace(self, **changes) -> "AttentionSpec":
    """A copy with ``changes`` (field name -> value), validated as a new spec."""
    return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------
# The registry.

FAMILY_SPECS: dict[str, type[AttentionSpec]] = {}


def register_family(spec_class: type[AttentionSpec]) -> type[AttentionSpec]:
  """Makes ``spec_class`` (a frozen :class:`.AttentionSpec` dataclass) a family of the layer.

  ``AttentionConfig(family=spec_class.family, ...)`` then builds it from its
  fields. Usable as a class decorator. Spec fields must not shadow the common
  fields of :class:`attnjax.nn.AttentionConfig`.

  Args:
    spec_class: a frozen dataclass subclassing :class:`.AttentionSpec`, whose ``family``
      class variable names the family.

  Returns:
    ``spec_class`` itself (registered).

  Raises:
    TypeError: ``spec_class`` is not an :class:`.AttentionSpec` dataclass.
    ValueError: it names no family.
  """
  if not (
    isinstance(spec_class, type)
    and issubclass(spec_class, AttentionSpec)
    and dataclasses.is_dataclass(spec_class)
  ):
    raise TypeError(f"spec_class must be an AttentionSpec dataclass, got {spec_class!r}")
  if not spec_class.family:
    raise ValueError(f"{spec_class.__name__}.family must name the family")
  FAMILY_SPECS[spec_class.family] = spec_class
  return spec_class
