"""Frozen, serialisable configurations of an attention layer and of a decoder LM.

``AttentionConfig`` holds what every attention layer has (heads, head dim,
RoPE, output gate, causality, implementation) and one family *spec*
(:mod:`attnjax.nn.specs`): a frozen dataclass of that family's options, which
also builds the family's parameters, attention call and decode cache.
``ModelConfig`` names the decoder around it. Both are hashable (a module may
key jitted code on them) and round-trip through a plain dict (``to_dict`` /
``from_dict``) for run directories; dicts written before the specs existed
(one flat record of every family's options), or before a field's rename, still
load. Invalid combinations are rejected when the config is built, with a
``ValueError`` or ``TypeError`` that names the field and the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from attnjax._src import validators, deprecation
from attnjax._src.nn import rope as rope_lib
from attnjax._src.nn import specs
from attnjax._src.nn.specs import check_int, check_type

# The families are the live registry, specs.FAMILY_SPECS (register_family adds to it).
OUTPUT_GATES = (None, "elementwise", "headwise")
MLPS = ("gelu", "swiglu", "geglu", "moe", "none")
# The activations each MLP kind takes (mlp_activation; None = the first).
MLP_ACTIVATIONS = {
  "gelu": ("gelu_tanh", "gelu_exact"),
  "geglu": ("gelu_tanh", "gelu_exact"),
  "swiglu": ("silu",),
}
NORMS = ("rms", "layer", "rms_plus_one")
MOE_EXPERTS = ("gpt_oss", "swiglu")
MOE_ROUTERS = ("topk_softmax", "softmax", "sigmoid")
NORM_PLACEMENTS = ("pre", "sandwich", "post", "post_residual")
DTYPES = ("float32", "bfloat16", "float16")

# The common fields of every layer, in order.
COMMON_FIELDS = (
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "rope_theta",
  "output_gate",
  "is_causal",
  "implementation",
  "sow_weights",
  "qkv_bias",
  "out_bias",
  "rope_scaling",
  "rope_dim",
)

# Every family option of the flat record used before the per-family specs, with its
# default there. A dict (or constructor call) written for that record may carry an
# option of another family at this default: it is ignored. Any other value is an
# error naming the field. Reading such an option from a config of another family
# gives this default, so code written against the flat record keeps working.
LEGACY_DEFAULTS: dict[str, Any] = {
  "normalizer": "softmax",
  "similarity": "dot",
  "qk_norm": "rms",
  "qk_norm_placement": "before_rope",
  "qk_norm_gain": True,
  "qk_norm_eps": 1e-6,
  "qk_scale": None,
  "cosine_convention": "swin",
  "temperature_init": None,
  "sink_logits": False,
  "kv_bias": False,
  "window": None,
  "num_sinks": 0,
  "streaming_rope": "cache",
  "pattern": None,
  "block_size": 16,
  "feature_map": "elu_plus_one",
  "num_features": 64,
  "stabilize_features": True,
  "linear_normalize": "denominator",
  "chunk_size": 64,
  "softcap": None,
}


def _spec_fields(spec_class) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(spec_class))


def _owners(name: str) -> str:
  owners = [
    f
    for f, cls in specs.FAMILY_SPECS.items()
    if name in _spec_fields(cls) or name in getattr(cls, "renamed_fields", {})
  ]
  return ", ".join(repr(f) for f in owners) or "no family"


def _build_spec(
  family: Optional[str], spec: Optional[specs.AttentionSpec], options: dict[str, Any]
) -> specs.AttentionSpec:
  """The spec of ``family`` (or ``spec`` updated) from flat family options."""
  if spec is not None:
    if not isinstance(spec, specs.AttentionSpec):
      raise TypeError(f"spec must be an attnjax.nn.specs.AttentionSpec, got {type(spec).__name__}")
    if family is not None and family != spec.family:
      raise ValueError(f"family={family!r} disagrees with spec of family {spec.family!r}")
    family, cls = spec.family, type(spec)
  else:
    family = "dense" if family is None else family
    validators.check_choice("family", family, tuple(specs.FAMILY_SPECS))
    cls = specs.FAMILY_SPECS[family]
  own = _spec_fields(cls)
  # A field's old name (QKNormSpec's qk_scale, now scale) warns once and means the new one.
  options = deprecation.renamed_in(
    "AttentionConfig", options, getattr(cls, "renamed_fields", {}), stacklevel=4
  )
  kept = {}
  for name, value in options.items():
    if name in own:
      kept[name] = value
    elif name in LEGACY_DEFAULTS:
      if value != LEGACY_DEFAULTS[name]:
        raise ValueError(
          f"{name}={value!r} cannot be used with family={family!r}: it is an "
          f"option of family {_owners(name)}"
        )
    else:
      raise TypeError(
        f"unknown AttentionConfig field {name!r} (family={family!r} takes: "
        f"{', '.join(COMMON_FIELDS + own)})"
      )
  if spec is not None:
    return dataclasses.replace(spec, **kept) if kept else spec
  return cls(**kept)


@dataclasses.dataclass(frozen=True, init=False)
class AttentionConfig:
  """One attention layer: the common options and a family spec.

  Build it from a spec, or (a convenience that dispatches to the spec) from a
  family name and that family's options as keywords:

  >>> from attnjax.nn import AttentionConfig, specs
  >>> (AttentionConfig(spec=specs.QKNormSpec(qk_norm="layer"), num_heads=8)
  ...  == AttentionConfig(family="qk_norm", qk_norm="layer", num_heads=8))   # the same
  True

  Reading a family option (``config.window``) reads the spec's field; an
  option another family owns reads its old default (``LEGACY_DEFAULTS``).

  Attributes:
    spec: the family spec (:class:`.DenseSpec`,
      ``QKNormSpec``, ``CosineSpec``, ``LinearSpec``, ``SparseSpec``, or any
      registered with :func:`.register_family`); see each for
      its options (normalisers, windows, sinks, QK norms, feature maps, patterns).
    num_heads: query heads N.
    num_kv_heads: key/value heads K (None = N); ``N % K == 0`` (GQA / MQA).
    head_dim: H (None = ``d_model // num_heads``).
    rope_theta: RoPE base, or None for no positional encoding.
    output_gate: None, ``"elementwise"`` or ``"headwise"``: multiply each head's
      attention output by ``sigmoid(x W_g + b_g)`` before the output projection
      (Qiu et al. 2025).
    is_causal: True for a decoder layer; False for an encoder (every token sees
      every token; no decode). Cross-attention is never causal.
    implementation: the attention function's ``implementation`` (None = auto);
      one of the spec's ``implementations`` (checked at build).
    sow_weights: sow the full attention weights ``[B, N, T, S]`` under
      ``nnx.capture`` (costly; also switchable per call).
    qkv_bias: the q, k and v projections have biases (GPT-2, Qwen 2, gpt-oss).
    out_bias: the output projection has a bias (GPT-2, gpt-oss).
    rope_scaling: None, or a RoPE frequency scaling (``"linear"``, ``"llama3"``,
      ``"yarn"``; ``attnjax._src.nn.rope``), given as a dict or a tuple of
      ``(key, value)`` pairs and kept as the sorted tuple (hashable); needs
      ``rope_theta``.
    rope_dim: partial RoPE: only the first ``rope_dim`` dimensions of each query and key
      head are rotated, with the frequencies of a head of that width (Qwen3-Next's
      ``partial_rotary_factor=0.25``); None = all. Even, at most the head dim; needs
      ``rope_theta``.
  """

  num_heads: int = 4
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  rope_theta: Optional[float] = 10000.0
  output_gate: Optional[Literal["elementwise", "headwise"]] = None
  is_causal: bool = True
  implementation: Optional[str] = None
  sow_weights: bool = False
  qkv_bias: bool = False
  out_bias: bool = False
  rope_scaling: Optional[tuple] = None
  rope_dim: Optional[int] = None
  spec: specs.AttentionSpec = specs.DenseSpec()

  def __init__(
    self,
    family: Optional[str] = None,
    *,
    spec: Optional[specs.AttentionSpec] = None,
    num_heads: int = 4,
    num_kv_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    rope_theta: Optional[float] = 10000.0,
    output_gate: Optional[str] = None,
    is_causal: bool = True,
    implementation: Optional[str] = None,
    sow_weights: bool = False,
    qkv_bias: bool = False,
    out_bias: bool = False,
    rope_scaling: Any = None,
    rope_dim: Optional[int] = None,
    **options: Any,
  ):
    built = _build_spec(family, spec, options)
    for name, value in (
      ("num_heads", num_heads),
      ("num_kv_heads", num_kv_heads),
      ("head_dim", head_dim),
      ("rope_theta", rope_theta),
      ("output_gate", output_gate),
      ("is_causal", is_causal),
      ("implementation", implementation),
      ("sow_weights", sow_weights),
      ("qkv_bias", qkv_bias),
      ("out_bias", out_bias),
      ("rope_scaling", rope_lib.normalize_scaling(rope_scaling)),
      ("rope_dim", rope_dim),
      ("spec", built),
    ):
      object.__setattr__(self, name, value)
    self._check()

  def _check(self):
    check_int("num_heads", self.num_heads)
    check_int("num_kv_heads", self.num_kv_heads, allow_none=True)
    if self.num_heads % self.kv_heads != 0:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}"
      )
    check_int("head_dim", self.head_dim, allow_none=True)
    if self.head_dim is not None and self.rope_theta is not None and self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE (rope_theta set)")
    validators.check_positive_float("rope_theta", self.rope_theta)
    validators.check_choice("output_gate", self.output_gate, OUTPUT_GATES)
    for name in ("is_causal", "sow_weights", "qkv_bias", "out_bias"):
      check_type(name, getattr(self, name), bool, "a bool")
    if self.rope_scaling is not None and self.rope_theta is None:
      raise ValueError(f"rope_scaling={dict(self.rope_scaling)} needs rope_theta (RoPE)")
    check_int("rope_dim", self.rope_dim, allow_none=True)
    if self.rope_dim is not None:
      if self.rope_theta is None:
        raise ValueError(f"rope_dim={self.rope_dim} (partial RoPE) needs rope_theta (RoPE)")
      if self.rope_dim % 2 or (self.head_dim is not None and self.rope_dim > self.head_dim):
        raise ValueError(
          f"rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}"
        )
      if self.family == "mla":
        raise ValueError(
          f"rope_dim={self.rope_dim}: family='mla' rotates its qk_rope_head_dim part; "
          f"leave rope_dim None"
        )
    type(self.spec).check_implementation(self.implementation)
    self.spec.check(self)

  @property
  def family(self) -> str:
    return self.spec.family

  def __getattr__(self, name: str):
    # Only called when normal lookup fails: family options live on the spec.
    if name.startswith("__") or name == "spec":
      raise AttributeError(name)
    spec = self.spec
    if name in _spec_fields(type(spec)) or isinstance(getattr(type(spec), name, None), property):
      return getattr(spec, name)
    if name in LEGACY_DEFAULTS:
      return LEGACY_DEFAULTS[name]
    raise AttributeError(f"AttentionConfig of family {spec.family!r} has no field {name!r}")

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def head_dim_for(self, d_model: int) -> int:
    """H for a model of width ``d_model``; checks it divides."""
    fixed = self.spec.fixed_head_dim()
    if fixed is not None:
      return fixed
    if self.head_dim is not None:
      return self.head_dim
    if d_model % self.num_heads:
      raise ValueError(
        f"d_model={d_model} is not divisible by num_heads={self.num_heads}; set head_dim"
      )
    H = d_model // self.num_heads
    if self.rope_theta is not None and H % 2:
      raise ValueError(f"head_dim = d_model // num_heads = {H} must be even for RoPE")
    return H

  def to_dict(self) -> dict[str, Any]:
    """A flat JSON-serialisable dict: ``family``, the common fields, the spec's fields.

    ``pattern`` becomes ``[name, {arg: value}]``.
    """
    out = {"family": self.family}
    out.update({name: getattr(self, name) for name in COMMON_FIELDS})
    if self.rope_scaling is not None:
      out["rope_scaling"] = dict(self.rope_scaling)
    out.update(self.spec.to_dict())
    return out

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "AttentionConfig":
    """Inverse of ``to_dict``; also reads the flat record written before the specs.

    An option of another family at its old default is ignored (old dicts carry
    every option); any other value, or an unknown name, raises naming the field.
    """
    d = dict(d)
    family = d.pop("family", "dense")
    validators.check_choice("family", family, tuple(specs.FAMILY_SPECS))
    # A record written before a field's rename stores its old name: read it silently (the
    # run directory is data the user cannot update, not code that should change).
    for old, new in getattr(specs.FAMILY_SPECS[family], "renamed_fields", {}).items():
      if old in d and new not in d:
        d[new] = d.pop(old)
    unknown = (
      set(d)
      - set(COMMON_FIELDS)
      - set(LEGACY_DEFAULTS)
      - set(_spec_fields(specs.FAMILY_SPECS[family]))
    )
    if unknown:
      raise ValueError(f"unknown AttentionConfig fields: {sorted(unknown)}")
    common = {name: d.pop(name) for name in COMMON_FIELDS if name in d}
    options = specs.FAMILY_SPECS[family].options_from_json(d)
    return cls(family, **common, **options)

  def replace(self, **changes) -> "AttentionConfig":
    """A copy with common fields or family options changed (``family=`` starts a new spec)."""
    common = {name: changes.pop(name, getattr(self, name)) for name in COMMON_FIELDS}
    family = changes.pop("family", self.family)
    spec = changes.pop("spec", None)
    if spec is None and family == self.family:
      spec = self.spec
    return AttentionConfig(family if spec is None else None, spec=spec, **common, **changes)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only language model (pre-norm by default).

  The defaults are attnjax's own small models; the other fields express the
  choices of pretrained architectures (:mod:`attnjax.models`).

  Attributes:
    vocab_size: V.
    d_model: D.
    num_layers: number of blocks.
    attention: the attention of every layer (unless ``layer_attention``).
    layer_attention: optional per-layer configs (a tuple of length
      ``num_layers``), e.g. alternating window and global layers.
    mlp: ``"gelu"`` (``down(act(up x))``), ``"swiglu"`` / ``"geglu"`` (gated:
      ``down(act(gate x) * up x)``), ``"moe"`` (gpt-oss's mixture of experts,
      ``attnjax._src.nn.mlp.MixtureOfExperts``) or ``"none"`` (attention-only
      blocks, as in the 1-3 layer models of Guo et al. 2024's bigram-backcopy task).
    mlp_dim: hidden width (of each expert for ``"moe"``; None = ``4 D`` for
      GELU, ``8 D / 3`` rounded up to a multiple of 8 otherwise, equal parameter counts).
    norm: ``"rms"`` (RMSNorm), ``"layer"`` (LayerNorm with bias) or
      ``"rms_plus_one"`` (Gemma's RMSNorm: gain ``1 + w``, in float32).
    norm_eps: epsilon of every norm.
    tie_embeddings: the output projection is the transposed embedding.
    dtype: compute dtype name; parameters are ``param_dtype``.
    param_dtype: parameter dtype name.
    remat: rematerialise each block in the backward pass (``nnx.remat``).
    norm_placement: ``"pre"`` (``h + f(norm(h))``), ``"sandwich"`` (``h +
      norm'(f(norm(h)))``, Gemma 2/3), ``"post"`` (``h + norm'(f(h))``, OLMo 2) or
      ``"post_residual"`` (``norm'(h + f(h))``, the original Transformer's and
      BERT's post-LN; the last block's output is the features, no final norm),
      for the attention and the MLP alike.
    mlp_activation: the MLP's activation, None = the kind's (``"gelu_tanh"`` for
      ``"gelu"`` and ``"geglu"``, ``"silu"`` for ``"swiglu"``); ``"gelu"`` and
      ``"geglu"`` also take ``"gelu_exact"`` (erf).
    mlp_bias: biases on the MLP's projections (GPT-2; Llama's ``mlp_bias``).
    num_experts: experts of ``mlp="moe"``.
    experts_per_token: experts each token is routed to (``mlp="moe"``).
    moe_alpha: sigmoid slope of the experts' SwiGLU (``mlp="moe"``; gpt-oss 1.702).
    moe_limit: clip of the experts' gate and up projections (None = none; gpt-oss 7).
    moe_experts: the experts: ``"gpt_oss"`` (clamped SwiGLU with biases, ``moe_alpha``,
      ``moe_limit``) or ``"swiglu"`` (``down(silu(gate x) * up x)``, no biases; DeepSeek).
    moe_router: how routing weights are made: ``"topk_softmax"`` (softmax over the top-k
      logits; gpt-oss), ``"softmax"`` (softmax over every expert, then the top k; DeepSeek
      V2) or ``"sigmoid"`` (sigmoid scores, chosen with ``moe_score_bias``; DeepSeek V3).
    moe_router_bias: the router's projection has a bias (gpt-oss).
    moe_groups: expert groups; only the ``moe_group_topk`` best groups are eligible (group
      score: the sum of its two best scores under ``"sigmoid"``, its best otherwise).
    moe_group_topk: groups kept (None = every group).
    moe_score_bias: a learned per-expert bias added to the scores for the choice only
      (DeepSeek V3's ``e_score_correction_bias``); the weights stay the unbiased scores.
    moe_normalize: the chosen weights are divided by their sum (``norm_topk_prob``).
    moe_scale: the routed weights' multiplier (``routed_scaling_factor``).
    moe_shared_dim: hidden width of the shared experts added to every token (one SwiGLU
      MLP), or None.
    moe_first_dense: the first layers have a dense MLP instead (``first_k_dense_replace``).
    moe_dense_layers: other layers with a dense MLP (indices; Qwen3-Next's
      ``mlp_only_layers`` and ``decoder_sparse_step``, Kimi Linear's ``mlp_layer_types``).
    moe_shared_gate: the shared experts' output is multiplied by ``sigmoid(x w)`` per token
      (``w [D, 1]``; Qwen3-Next's ``shared_expert_gate``).
    dense_mlp_dim: the dense layers' hidden width (None = ``mlp_dim``).
    learned_positions: number of learned absolute position embeddings added to
      the token embeddings (GPT-2's ``n_positions``); None = none.
    embed_scale: multiplier of the token embeddings, cast to ``param_dtype``
      first (Gemma: ``sqrt(D)``); None = none.
    final_softcap: ``c`` of ``c tanh(logits / c)`` on the output logits (Gemma 2); None = none.
    norm_bias: LayerNorm's bias (``norm="layer"``); False as ModernBERT's ``norm_bias``.
    token_types: number of learned token-type (segment) embeddings added to the
      token embeddings (BERT's ``type_vocab_size``); None = none.
    embed_norm: a norm of the summed embeddings before the first block (BERT,
      ModernBERT).
    first_attn_norm: the first block has its attention norm (``"pre"`` and
      ``"sandwich"``); False as ModernBERT, whose embeddings are already normed.
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
  norm_placement: str = "pre"
  mlp_activation: Optional[str] = None
  mlp_bias: bool = False
  num_experts: Optional[int] = None
  experts_per_token: Optional[int] = None
  moe_alpha: float = 1.702
  moe_limit: Optional[float] = 7.0
  moe_experts: str = "gpt_oss"
  moe_router: str = "topk_softmax"
  moe_router_bias: bool = True
  moe_groups: int = 1
  moe_group_topk: Optional[int] = None
  moe_score_bias: bool = False
  moe_normalize: bool = False
  moe_scale: float = 1.0
  moe_shared_dim: Optional[int] = None
  moe_first_dense: int = 0
  moe_dense_layers: tuple[int, ...] = ()
  moe_shared_gate: bool = False
  dense_mlp_dim: Optional[int] = None
  learned_positions: Optional[int] = None
  embed_scale: Optional[float] = None
  final_softcap: Optional[float] = None
  norm_bias: bool = True
  token_types: Optional[int] = None
  embed_norm: bool = False
  first_attn_norm: bool = True

  def __post_init__(self):
    if isinstance(self.moe_dense_layers, list):  # read back from JSON
      object.__setattr__(self, "moe_dense_layers", tuple(self.moe_dense_layers))
    check_int("vocab_size", self.vocab_size)
    check_int("d_model", self.d_model)
    check_int("num_layers", self.num_layers)
    check_int("mlp_dim", self.mlp_dim, allow_none=True)
    if not isinstance(self.attention, AttentionConfig):
      raise TypeError(f"attention must be an AttentionConfig, got {type(self.attention).__name__}")
    if self.layer_attention is not None:
      if isinstance(self.layer_attention, list):
        object.__setattr__(self, "layer_attention", tuple(self.layer_attention))
      if len(self.layer_attention) != self.num_layers:
        raise ValueError(
          f"layer_attention has {len(self.layer_attention)} configs for "
          f"num_layers={self.num_layers}"
        )
      for i, c in enumerate(self.layer_attention):
        if not isinstance(c, AttentionConfig):
          raise TypeError(
            f"layer_attention[{i}] must be an AttentionConfig, got {type(c).__name__}"
          )
    for i in range(self.num_layers):
      self.attention_for(i).head_dim_for(self.d_model)
    validators.check_choice("mlp", self.mlp, MLPS)
    validators.check_choice("norm", self.norm, NORMS)
    validators.check_positive_float("norm_eps", self.norm_eps, allow_none=False)
    validators.check_choice("dtype", self.dtype, DTYPES)
    validators.check_choice("param_dtype", self.param_dtype, DTYPES)
    for name in (
      "tie_embeddings",
      "remat",
      "mlp_bias",
      "norm_bias",
      "embed_norm",
      "first_attn_norm",
    ):
      check_type(name, getattr(self, name), bool, "a bool")
    validators.check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
    if self.mlp_activation is not None:
      allowed = MLP_ACTIVATIONS.get(self.mlp, ())
      if self.mlp_activation not in allowed:
        raise ValueError(
          f"mlp_activation={self.mlp_activation!r} does not apply to "
          f"mlp={self.mlp!r} (it takes: {allowed or 'none'})"
        )
    check_int("learned_positions", self.learned_positions, allow_none=True)
    check_int("token_types", self.token_types, allow_none=True)
    if not self.norm_bias and self.norm != "layer":
      raise ValueError(f"norm_bias=False applies to norm='layer' only, got norm={self.norm!r}")
    validators.check_positive_float("embed_scale", self.embed_scale)
    validators.check_positive_float("final_softcap", self.final_softcap)
    if self.mlp == "moe":
      check_int("num_experts", self.num_experts)
      check_int("experts_per_token", self.experts_per_token)
      if self.experts_per_token > self.num_experts:
        raise ValueError(
          f"experts_per_token={self.experts_per_token} exceeds num_experts={self.num_experts}"
        )
      validators.check_positive_float("moe_alpha", self.moe_alpha, allow_none=False)
      validators.check_positive_float("moe_limit", self.moe_limit)
      validators.check_choice("moe_experts", self.moe_experts, MOE_EXPERTS)
      validators.check_choice("moe_router", self.moe_router, MOE_ROUTERS)
      check_int("moe_groups", self.moe_groups)
      check_int("moe_group_topk", self.moe_group_topk, allow_none=True)
      if self.num_experts % self.moe_groups:
        raise ValueError(f"moe_groups={self.moe_groups} must divide num_experts={self.num_experts}")
      if self.moe_group_topk is not None and self.moe_group_topk > self.moe_groups:
        raise ValueError(
          f"moe_group_topk={self.moe_group_topk} exceeds moe_groups={self.moe_groups}"
        )
      validators.check_positive_float("moe_scale", self.moe_scale, allow_none=False)
      check_int("moe_shared_dim", self.moe_shared_dim, allow_none=True)
      check_int("moe_first_dense", self.moe_first_dense, minimum=0)
      check_type("moe_dense_layers", self.moe_dense_layers, tuple, "a tuple of layer indices")
      for i in self.moe_dense_layers:
        check_int("moe_dense_layers entry", i, minimum=0)
        if i >= self.num_layers:
          raise ValueError(
            f"moe_dense_layers={self.moe_dense_layers}: layer {i} is not below "
            f"num_layers={self.num_layers}"
          )
      check_type("moe_shared_gate", self.moe_shared_gate, bool, "a bool")
      if self.moe_shared_gate and self.moe_shared_dim is None:
        raise ValueError("moe_shared_gate=True needs shared experts (moe_shared_dim)")
      check_int("dense_mlp_dim", self.dense_mlp_dim, allow_none=True)
      for name in ("moe_router_bias", "moe_score_bias", "moe_normalize"):
        check_type(name, getattr(self, name), bool, "a bool")
    elif self.num_experts is not None or self.experts_per_token is not None:
      raise ValueError(
        f"num_experts={self.num_experts}, experts_per_token="
        f"{self.experts_per_token} need mlp='moe', got mlp={self.mlp!r}"
      )

  def is_moe_layer(self, layer: int) -> bool:
    """Whether block ``layer`` has the mixture of experts (else a dense MLP, or none)."""
    return (
      self.mlp == "moe" and layer >= self.moe_first_dense and layer not in self.moe_dense_layers
    )

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
        for c in d["layer_attention"]
      )
    return cls(**d)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


HEAD_ACTIVATIONS = ("gelu_exact", "gelu_tanh", "silu")


@dataclasses.dataclass(frozen=True)
class EncoderConfig(ModelConfig):
  """A bidirectional encoder LM (BERT, RoBERTa, ModernBERT): a :class:`ModelConfig` whose
  every layer has ``is_causal=False``, with a masked-LM head.

  The defaults are BERT's choices at attnjax's small size: post-LN
  (``norm_placement="post_residual"``), LayerNorm, a norm of the embeddings, two
  token types, GELU (erf) and biases; positions are RoPE (the attention default)
  unless ``learned_positions`` is set and ``rope_theta=None``.

  Attributes:
    mlm_head: the masked-LM head: ``norm(act(dense(h)))``, then the tied (or
      ``head``) output projection plus ``output_bias``. False: the encoder alone
      (``BertModel``), whose call returns the features ``[B, T, D]``.
    head_activation: the head's activation (``"gelu_exact"``, ``"gelu_tanh"``, ``"silu"``).
    head_bias: the head's dense layer has a bias (ModernBERT's ``classifier_bias``).
    output_bias: a bias ``[V]`` on the output logits (BERT's ``cls.predictions.bias``).
    pooler: BERT's pooler, ``tanh(dense(h[:, 0]))``, read by :meth:`EncoderLM.pooled`.
    pad_token_id: the padding token (RoBERTa's positions skip it); None = none.
    position_offset: None: positions ``0..T-1`` (BERT). An int: RoBERTa's
      positions, which number the tokens that are not ``pad_token_id`` from
      ``position_offset`` (its ``padding_idx + 1``) and put padding at
      ``position_offset - 1``.
  """

  attention: AttentionConfig = AttentionConfig(is_causal=False)
  mlp_activation: Optional[str] = "gelu_exact"
  mlp_bias: bool = True
  norm: str = "layer"
  norm_eps: float = 1e-12
  norm_placement: str = "post_residual"
  token_types: Optional[int] = 2
  embed_norm: bool = True
  mlm_head: bool = True
  head_activation: str = "gelu_exact"
  head_bias: bool = True
  output_bias: bool = True
  pooler: bool = False
  pad_token_id: Optional[int] = None
  position_offset: Optional[int] = None

  def __post_init__(self):
    super().__post_init__()
    for i in range(self.num_layers):
      a = self.attention_for(i)
      if a.is_causal:
        where = "attention" if self.layer_attention is None else f"layer_attention[{i}]"
        raise ValueError(
          f"{where} has is_causal=True: every layer of an EncoderConfig is bidirectional "
          f"(AttentionConfig(is_causal=False, ...))"
        )
    for name in ("mlm_head", "head_bias", "output_bias", "pooler"):
      check_type(name, getattr(self, name), bool, "a bool")
    validators.check_choice("head_activation", self.head_activation, HEAD_ACTIVATIONS)
    check_int("pad_token_id", self.pad_token_id, allow_none=True, minimum=0)
    check_int("position_offset", self.position_offset, allow_none=True, minimum=1)
    if self.position_offset is not None:
      if self.pad_token_id is None:
        raise ValueError(
          f"position_offset={self.position_offset} needs pad_token_id (RoBERTa's positions "
          f"skip the padding tokens)"
        )
      if self.learned_positions is None:
        raise ValueError(f"position_offset={self.position_offset} needs learned_positions")
