"""Frozen, serialisable configurations of an attention layer and of a decoder LM.

``AttentionConfig`` names an attention family and every option a layer can
take; ``ModelConfig`` names the decoder around it. Both are frozen dataclasses
(hashable, so a module may key jitted code on them) that round-trip through a
plain dict (``to_dict`` / ``from_dict``) for run directories. Invalid
combinations are rejected when the config is built, with a ``ValueError`` or
``TypeError`` that names the field and the reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from attnjax import _checks, dense, feature_maps, linear, normalizers, patterns, qk_norm

FAMILIES = ("dense", "qk_norm", "cosine", "linear", "sparse")
OUTPUT_GATES = (None, "elementwise", "headwise")
QK_NORM_PLACEMENTS = ("before_rope", "after_rope")
STREAMING_ROPE = ("cache", "absolute")
# Families built on the dense softmax-style kernel: they take normalisers, sink
# logits, the k/v bias slot, windows and softcaps.
DENSE_FAMILIES = ("dense", "qk_norm", "cosine")
MLPS = ("gelu", "swiglu")
NORMS = ("rms", "layer")
DTYPES = ("float32", "bfloat16", "float16")
PATTERNS = ("causal", "sliding_window", "strided", "fixed", "global_window", "bigbird",
            "sinks_window")
FEATURE_MAPS = feature_maps.DETERMINISTIC + feature_maps.RANDOM

# Initial cosine temperature per convention: Swin v2 learns log(scale) from log 10;
# "scale" learns the multiplier itself; nGPT's s_qk starts at 1 (logits sqrt(H) cos).
DEFAULT_TEMPERATURE = {"swin": math.log(10.0), "scale": 10.0, "ngpt": 1.0}


def _check_type(name: str, value: Any, types, what: str) -> None:
  if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
    raise TypeError(f"{name} must be {what}, got {value!r}")
  if not isinstance(value, types):
    raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def _positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
  if value is None and allow_none:
    return
  _check_type(name, value, int, "an int")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """One attention layer: a family and its options.

  Attributes:
    family: ``"dense"`` (scaled dot product), ``"qk_norm"`` (normalise q and k
      over the head dim), ``"cosine"`` (cosine similarity times a learned
      per-head temperature), ``"linear"`` (kernel feature map) or ``"sparse"``
      (a block-sparse ``Pattern``).
    num_heads: query heads N.
    num_kv_heads: key/value heads K (None = N); ``N % K == 0`` (GQA / MQA).
    head_dim: H (None = ``d_model // num_heads``).
    normalizer: a name from :mod:`attnjax.normalizers` (dense-kernel families).
    similarity: family ``"dense"``: ``"dot"`` or ``"neg_sq_euclidean"``
      (``-||q - k||^2`` scores, see :func:`attnjax.dot_product_attention`).
    qk_norm: ``"rms"``, ``"layer"`` or ``"l2"`` (family ``"qk_norm"``).
    qk_norm_placement: ``"before_rope"`` (normalise the projections, then rotate;
      OLMo 2 / Qwen 3) or ``"after_rope"`` (rotate, then the attention function
      normalises).
    qk_norm_gain: learn gains ``[H]`` for q and k after the norm.
    qk_norm_eps: epsilon of the norm (and of cosine attention).
    qk_scale: logit scale of QK-norm attention (None = ``H ** -0.5``; ``"l2"``
      usually needs a larger one).
    cosine_convention: ``"swin"``, ``"scale"`` or ``"ngpt"`` (see
      :func:`attnjax.cosine_attention`).
    temperature_init: initial temperature (None = the convention's default:
      swin ``log 10``, scale ``10``, ngpt ``1``).
    sink_logits: learn a per-head null logit ``[N]`` (gpt-oss; softmax only).
    output_gate: None, ``"elementwise"`` or ``"headwise"``: multiply each head's
      attention output by ``sigmoid(x W_g + b_g)`` before the output projection
      (Qiu et al. 2025).
    kv_bias: learn one extra key/value pair per key/value head that every query
      may attend to (Sun et al. 2024, "attention bias"); it is appended after the
      real keys, so key 0 stays the first token for sink statistics.
    window: causal sliding window: query ``i`` sees keys ``i - window .. i``.
    num_sinks: with ``window``, the first ``num_sinks`` tokens stay visible to
      every query (StreamingLLM sinks + window).
    streaming_rope: how a sinks-window decode cache rotates keys: ``"cache"``
      (StreamingLLM: keys are stored before RoPE and rotated by their position
      in the cache) or ``"absolute"`` (by their position in the sequence, which
      matches the full forward exactly). ``"cache"`` is exact for one-token
      steps; a prefill from an empty cache uses sequence positions (nothing is
      evicted yet), and a multi-token chunk on a full cache shares the shift of
      its first query.
    pattern: sparse family: ``(name, ((arg, value), ...))`` naming a factory of
      :mod:`attnjax.patterns`, e.g. ``("strided", (("stride", 4),))``.
    block_size: sparse family: block size of the block-sparse computation.
    feature_map: linear family: a name from :mod:`attnjax.feature_maps`
      (``"elu_plus_one"``, ``"relu"``, ``"identity"``, ``"squared_relu"``, or the
      random ``"favor_plus"`` / ``"trig"``, whose projection ``[m, H]`` the
      layer draws at init and keeps as a non-trained variable).
    num_features: linear family: random features m of ``favor_plus`` / ``trig``.
    stabilize_features: linear family, random maps: subtract the stop-gradient
      maxima in the full forward (Performer practice). A decode state cannot carry
      them, so decoding always uses the exact estimator; with
      ``linear_normalize="denominator"`` the constants cancel and the two agree
      up to the denominator's ``eps``.
    linear_normalize: linear family: the ``normalize`` form of
      :func:`attnjax.linear_attention`.
    chunk_size: linear family: chunk size of the chunked implementation.
    rope_theta: RoPE base, or None for no positional encoding.
    softcap: ``c`` of the ``c tanh(z / c)`` logit cap, or None.
    implementation: the attention function's ``implementation`` (None = auto).
    sow_weights: sow the full attention weights ``[B, N, T, S]`` under
      ``nnx.capture`` (costly; also switchable per call).
  """

  family: str = "dense"
  num_heads: int = 4
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  normalizer: str = "softmax"
  similarity: str = "dot"
  qk_norm: str = "rms"
  qk_norm_placement: str = "before_rope"
  qk_norm_gain: bool = True
  qk_norm_eps: float = 1e-6
  qk_scale: Optional[float] = None
  cosine_convention: str = "swin"
  temperature_init: Optional[float] = None
  sink_logits: bool = False
  output_gate: Optional[str] = None
  kv_bias: bool = False
  window: Optional[int] = None
  num_sinks: int = 0
  streaming_rope: str = "cache"
  pattern: Optional[tuple] = None
  block_size: int = 16
  feature_map: str = "elu_plus_one"
  num_features: int = 64
  stabilize_features: bool = True
  linear_normalize: str = "denominator"
  chunk_size: int = 64
  rope_theta: Optional[float] = 10000.0
  softcap: Optional[float] = None
  implementation: Optional[str] = None
  sow_weights: bool = False

  def __post_init__(self):
    _checks.check_choice("family", self.family, FAMILIES)
    _positive_int("num_heads", self.num_heads)
    _positive_int("num_kv_heads", self.num_kv_heads, allow_none=True)
    if self.num_heads % self.kv_heads != 0:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}")
    _positive_int("head_dim", self.head_dim, allow_none=True)
    if self.head_dim is not None and self.rope_theta is not None and self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE (rope_theta set)")
    _checks.check_choice("normalizer", self.normalizer, normalizers.NORMALIZERS)
    _checks.check_choice("similarity", self.similarity, dense.SIMILARITIES)
    _checks.check_choice("qk_norm", self.qk_norm, qk_norm.NORMS)
    _checks.check_choice("qk_norm_placement", self.qk_norm_placement, QK_NORM_PLACEMENTS)
    _check_type("qk_norm_gain", self.qk_norm_gain, bool, "a bool")
    _checks.check_positive_float("qk_norm_eps", self.qk_norm_eps, allow_none=False)
    _checks.check_positive_float("qk_scale", self.qk_scale)
    _checks.check_choice("cosine_convention", self.cosine_convention, qk_norm.COSINE_CONVENTIONS)
    if self.temperature_init is not None:
      _check_type("temperature_init", self.temperature_init, (int, float), "a float")
    for name in ("sink_logits", "kv_bias", "sow_weights", "stabilize_features"):
      _check_type(name, getattr(self, name), bool, "a bool")
    _checks.check_choice("output_gate", self.output_gate, OUTPUT_GATES)
    _positive_int("window", self.window, allow_none=True, minimum=0)
    _positive_int("num_sinks", self.num_sinks, minimum=0)
    _checks.check_choice("streaming_rope", self.streaming_rope, STREAMING_ROPE)
    _positive_int("block_size", self.block_size)
    _positive_int("num_features", self.num_features)
    _positive_int("chunk_size", self.chunk_size)
    _checks.check_positive_float("rope_theta", self.rope_theta)
    _checks.check_positive_float("softcap", self.softcap)
    _checks.check_choice("feature_map", self.feature_map, FEATURE_MAPS)
    _checks.check_choice("linear_normalize", self.linear_normalize, linear.NORMALIZE)
    self._check_family_options()

  def _check_family_options(self):
    family = self.family
    default = AttentionConfig.__dataclass_fields__

    def changed(name):
      return getattr(self, name) != default[name].default

    def reject(names, reason):
      for name in names:
        if changed(name):
          raise ValueError(f"{name}={getattr(self, name)!r} cannot be used with "
                           f"family={family!r}: {reason}")

    if family != "dense":
      reject(("similarity",), "only family='dense' takes another similarity")
    if family != "qk_norm":
      reject(("qk_norm", "qk_norm_placement", "qk_norm_gain", "qk_scale"),
             "QK-norm options belong to family='qk_norm'")
    if family != "cosine":
      reject(("cosine_convention", "temperature_init"),
             "temperatures belong to family='cosine'")
    if family not in ("qk_norm", "cosine"):
      reject(("qk_norm_eps",), "only the qk_norm and cosine families normalise q and k")
    if family != "linear":
      reject(("feature_map", "num_features", "stabilize_features", "linear_normalize",
              "chunk_size"),
             "feature maps belong to family='linear'")
    if family != "sparse":
      reject(("pattern", "block_size"), "patterns belong to family='sparse'")
    if family == "linear":
      reject(("normalizer", "sink_logits", "kv_bias", "window", "num_sinks", "softcap"),
             "linear attention has no softmax logits to normalise, cap, or add a "
             "null column or window to")
    if family == "linear":
      if self.implementation is not None:
        _checks.check_choice("implementation", self.implementation,
                             linear.IMPLEMENTATIONS + tuple(linear.DEPRECATED_IMPLEMENTATIONS))
    if family == "sparse":
      reject(("window", "num_sinks"),
             "use pattern=('sliding_window', ...) or ('sinks_window', ...) instead")
      reject(("kv_bias",), "sparse_attention takes no extra always-visible key column")
      if self.pattern is None:
        raise ValueError("pattern=None: family='sparse' needs pattern=(name, ((arg, value), ...))")
      self.make_pattern()
    if self.sink_logits and self.normalizer != "softmax":
      raise ValueError(
          f"sink_logits=True adds a learned null column to softmax; it cannot be combined "
          f"with normalizer={self.normalizer!r}")
    if self.num_sinks and self.window is None:
      raise ValueError(f"num_sinks={self.num_sinks} needs window (sinks + window attention)")
    if changed("streaming_rope") and not self.num_sinks:
      raise ValueError(f"streaming_rope={self.streaming_rope!r} only applies with num_sinks > 0")

  def make_pattern(self) -> "patterns.Pattern":
    """Sparse family: the configured pattern intersected with causal (decoders never look ahead)."""
    if (not isinstance(self.pattern, tuple) or len(self.pattern) != 2
        or not isinstance(self.pattern[0], str) or not isinstance(self.pattern[1], tuple)):
      raise TypeError(f"pattern must be (name, ((arg, value), ...)), got {self.pattern!r}")
    name, args = self.pattern
    _checks.check_choice("pattern name", name, PATTERNS)
    try:
      pattern = getattr(patterns, name)(**dict(args))
    except TypeError as e:
      raise TypeError(f"pattern={self.pattern!r}: bad arguments for patterns.{name}: {e}") from e
    except ValueError as e:
      raise ValueError(f"pattern={self.pattern!r}: {e}") from e
    return patterns.intersection(pattern, patterns.causal())

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def head_dim_for(self, d_model: int) -> int:
    """H for a model of width ``d_model``; checks it divides."""
    if self.head_dim is not None:
      return self.head_dim
    if d_model % self.num_heads:
      raise ValueError(f"d_model={d_model} is not divisible by num_heads={self.num_heads}; "
                       f"set head_dim")
    H = d_model // self.num_heads
    if self.rope_theta is not None and H % 2:
      raise ValueError(f"head_dim = d_model // num_heads = {H} must be even for RoPE")
    return H

  @property
  def initial_temperature(self) -> float:
    if self.temperature_init is not None:
      return float(self.temperature_init)
    return DEFAULT_TEMPERATURE[self.cosine_convention]

  def to_dict(self) -> dict[str, Any]:
    """A plain dict (JSON-serialisable); ``pattern`` becomes ``[name, {arg: value}]``."""
    out = dataclasses.asdict(self)
    if self.pattern is not None:
      out["pattern"] = [self.pattern[0], dict(self.pattern[1])]
    return out

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "AttentionConfig":
    d = dict(d)
    unknown = set(d) - set(cls.__dataclass_fields__)
    if unknown:
      raise ValueError(f"unknown AttentionConfig fields: {sorted(unknown)}")
    pattern = d.get("pattern")
    if pattern is not None:
      name, args = pattern
      args = args.items() if isinstance(args, dict) else args
      d["pattern"] = (name, tuple((k, _freeze(v)) for k, v in args))
    return cls(**d)

  def replace(self, **changes) -> "AttentionConfig":
    return dataclasses.replace(self, **changes)


def _freeze(v):
  return tuple(v) if isinstance(v, list) else v


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A pre-norm decoder-only language model.

  Attributes:
    vocab_size: V.
    d_model: D.
    num_layers: number of blocks.
    attention: the attention of every layer (unless ``layer_attention``).
    layer_attention: optional per-layer configs (a tuple of length
      ``num_layers``), e.g. alternating window and global layers.
    mlp: ``"gelu"`` or ``"swiglu"``.
    mlp_dim: hidden width (None = ``4 D`` for GELU, ``8 D / 3`` rounded up to a
      multiple of 8 for SwiGLU, equal parameter counts).
    norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm).
    norm_eps: epsilon of every norm.
    tie_embeddings: the output projection is the transposed embedding.
    dtype: compute dtype name; parameters are ``param_dtype``.
    param_dtype: parameter dtype name.
    remat: rematerialise each block in the backward pass (``nnx.remat``).
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 2
  attention: AttentionConfig = AttentionConfig()
  layer_attention: Optional[tuple[AttentionConfig, ...]] = None
  mlp: str = "gelu"
  mlp_dim: Optional[int] = None
  norm: str = "rms"
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False

  def __post_init__(self):
    _positive_int("vocab_size", self.vocab_size)
    _positive_int("d_model", self.d_model)
    _positive_int("num_layers", self.num_layers)
    _positive_int("mlp_dim", self.mlp_dim, allow_none=True)
    if not isinstance(self.attention, AttentionConfig):
      raise TypeError(f"attention must be an AttentionConfig, got {type(self.attention).__name__}")
    if self.layer_attention is not None:
      if isinstance(self.layer_attention, list):
        object.__setattr__(self, "layer_attention", tuple(self.layer_attention))
      if len(self.layer_attention) != self.num_layers:
        raise ValueError(f"layer_attention has {len(self.layer_attention)} configs for "
                         f"num_layers={self.num_layers}")
      for i, c in enumerate(self.layer_attention):
        if not isinstance(c, AttentionConfig):
          raise TypeError(
              f"layer_attention[{i}] must be an AttentionConfig, got {type(c).__name__}")
    for i in range(self.num_layers):
      self.attention_for(i).head_dim_for(self.d_model)
    _checks.check_choice("mlp", self.mlp, MLPS)
    _checks.check_choice("norm", self.norm, NORMS)
    _checks.check_positive_float("norm_eps", self.norm_eps, allow_none=False)
    _checks.check_choice("dtype", self.dtype, DTYPES)
    _checks.check_choice("param_dtype", self.param_dtype, DTYPES)
    for name in ("tie_embeddings", "remat"):
      _check_type(name, getattr(self, name), bool, "a bool")

  def attention_for(self, layer: int) -> AttentionConfig:
    return self.attention if self.layer_attention is None else self.layer_attention[layer]

  @property
  def hidden_dim(self) -> int:
    if self.mlp_dim is not None:
      return self.mlp_dim
    if self.mlp == "gelu":
      return 4 * self.d_model
    return 8 * ((8 * self.d_model // 3 + 7) // 8)

  def to_dict(self) -> dict[str, Any]:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["attention"] = self.attention.to_dict()
    if self.layer_attention is not None:
      out["layer_attention"] = [c.to_dict() for c in self.layer_attention]
    return out

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    unknown = set(d) - set(cls.__dataclass_fields__)
    if unknown:
      raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
    if "attention" in d and isinstance(d["attention"], dict):
      d["attention"] = AttentionConfig.from_dict(d["attention"])
    if d.get("layer_attention") is not None:
      d["layer_attention"] = tuple(
          c if isinstance(c, AttentionConfig) else AttentionConfig.from_dict(c)
          for c in d["layer_attention"])
    return cls(**d)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)
