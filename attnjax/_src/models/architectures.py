"""Each supported ``model_type``: its ``config.json`` as an ``nn.ModelConfig``, its tensors as ours.

Implementation behind the public module :mod:`attnjax.models.architectures`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import numpy as np

from attnjax._src.models.checkpoint import CheckpointError

# A parameter's path in nnx.to_pure_dict(state), e.g. ("blocks", 0, "mlp", "up", "kernel").
Path = tuple

# The kinds of layer, as transformers' layer_types names them.
FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # the hybrids' recurrent layers (gated DeltaNet, KDA)
LAYER_TYPES = (FULL, SLIDING, LINEAR)

# Config keys of every model type that do not change the forward pass of a causal LM.
INERT_KEYS = frozenset(
  {
    "architectures",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "initializer_range",
    "attention_dropout",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "chunk_size_feed_forward",
    "_attn_implementation",
    "attn_implementation",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "is_decoder",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "max_position_embeddings",
    "gradient_checkpointing",
    # generation settings older versions of transformers kept in config.json
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
  }
)

# Understood by every model type (checked by the loader itself).
COMMON_KEYS = frozenset(
  {"tie_word_embeddings", "pruned_heads", "add_cross_attention", "quantization_config"}
)

ACTIVATIONS = {  # transformers' ACT2FN names -> ours
  "silu": "silu",
  "swish": "silu",
  "gelu": "gelu_exact",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_fast": "gelu_tanh",
}


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one parameter of ours is read from the checkpoint.

  Attributes:
    sources: the checkpoint tensors it is made from (names after the prefix).
    shapes: the shape the config implies for each source.
    convert: ``convert(*arrays) -> array`` in our layout.
  """

  sources: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  convert: Callable[..., np.ndarray]


# ---------------------------------------------------------------------------
# Reading the config.


class Config:
  """``config.json`` with the defaults of ``transformers``' config class of its type.

  What the hooks read: ``c[key]`` (the value, else the default), ``c.int(key)``
  and ``c.flag(key)`` (checked), ``c.raw`` (the dict as written) and
  ``c.defaults``.
  """

  def __init__(self, config: dict, defaults: dict):
    self.raw, self.defaults = config, defaults

  def __getitem__(self, key):
    value = self.raw.get(key)
    return self.defaults.get(key) if value is None and key not in self.raw else value

  def int(self, key) -> int:
    value = self[key]
    if isinstance(value, bool) or not isinstance(value, int):
      raise CheckpointError(f"config.json: {key} must be an int, got {value!r}")
    return value

  def flag(self, key) -> bool:
    value = self[key]
    if value is None:
      return False
    if not isinstance(value, bool):
      raise CheckpointError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def _activation(c: Config, key: str) -> str:
  name = c[key]
  if name not in ACTIVATIONS:
    raise CheckpointError(
      f"config.json: {key}={name!r} is not supported (supported: {sorted(ACTIVATIONS)})"
    )
  return ACTIVATIONS[name]


def _rope_dicts(c: Config) -> tuple[Optional[dict], Optional[dict]]:
  """``(rope_scaling, rope_parameters)`` of the config, each an object or None."""
  scaling, params = c.raw.get("rope_scaling"), c.raw.get("rope_parameters")
  for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
    if value is not None and not isinstance(value, dict):
      raise CheckpointError(f"config.json: {name} must be an object, got {value!r}")
  return scaling, params


def _rope(c: Config, params: dict, default_theta: float, *, partial_ok: bool = False):
  """``(rope_theta, rope_scaling)`` of standardised RoPE ``params``; with ``partial_ok``,
  ``(rope_theta, rope_scaling, partial_rotary_factor)``."""
  params = dict(params)
  theta = params.pop("rope_theta", None)
  theta = default_theta if theta is None else theta
  kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  partial = params.pop("partial_rotary_factor", c["partial_rotary_factor"])
  if partial_ok:
    # Qwen3.5's multimodal RoPE: text positions give every section the same position, so
    # it is plain RoPE over the rotated dims (the sections and their order drop out).
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    whole = dict(params, rope_theta=theta, rope_type=kind, partial_rotary_factor=1.0)
    theta, scaling = _rope(c, whole, default_theta)
    return theta, scaling, 1.0 if partial is None else float(partial)
  if partial not in (None, 1, 1.0):
    raise CheckpointError(
      f"config.json: partial_rotary_factor={partial} (RoPE on part of the "
      f"head) is not supported for model_type={c.raw.get('model_type')!r}"
    )
  if kind == "default":
    if params:
      raise CheckpointError(
        f"config.json: RoPE parameters {sorted(params)} of rope_type 'default' are not understood"
      )
    return float(theta), None
  if kind not in ("linear", "llama3", "yarn"):
    raise CheckpointError(
      f"config.json: rope_type={kind!r} is not supported (supported: default, linear, llama3, yarn)"
    )
  if kind in ("llama3", "yarn"):
    params.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
  if kind == "yarn" and params.get("factor") is None:
    params["factor"] = c["max_position_embeddings"] / params["original_max_position_embeddings"]
  from attnjax._src.nn import rope as rope_lib

  try:
    scaling = rope_lib.normalize_scaling(dict(params, type=kind))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"config.json: {e}") from None
  return float(theta), scaling


def _check_common(c: Config) -> None:
  if c.raw.get("add_cross_attention"):
    raise CheckpointError(
      "config.json: add_cross_attention=true (an encoder-decoder cross-attention) is not supported"
    )
  if c.raw.get("pruned_heads"):
    raise CheckpointError(
      f"config.json: pruned_heads={c.raw['pruned_heads']} (pruned attention heads) is not supported"
    )


# ---------------------------------------------------------------------------
# Converters (numpy, in the stored dtype).


def _same(x):
  return x


def _transpose(x):
  return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _columns(start: int, stop: int):
  """A slice of the last axis (GPT-2's fused q/k/v)."""

  def convert(x):
    return np.ascontiguousarray(x[..., start:stop])

  return convert


def _every_other(offset: int):
  """gpt-oss's interleaved gate (even) / up (odd) columns."""

  def convert(x):
    return np.ascontiguousarray(x[..., offset::2])

  return convert


FP4_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 experts: bytes ``[E, out, G, 16]`` and scales ``[E, out, G]`` -> ``[E, in, out]``.

  The OCP microscaling format, as gpt-oss ships its experts.
  Each byte holds two FP4 (e2m1) values, the low nibble first; each group of
  32 values along ``in`` shares a power-of-two scale stored as a biased
  exponent (127 = 1). Returns float32 (exact: every value is an FP4 number
  times a power of two), transposed to ``[E, in = G * 32, out]`` as gpt-oss's
  unquantised experts are stored.
  """
  blocks = np.asarray(blocks, np.uint8)
  exponents = np.asarray(scales, np.int32) - 127
  values = np.empty(blocks.shape[:-1] + (blocks.shape[-1] * 2,), np.float32)
  values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  values[..., 1::2] = FP4_VALUES[blocks >> 4]
  values = np.ldexp(values, exponents[..., None])
  E, out = values.shape[:2]
  return np.ascontiguousarray(np.swapaxes(np.reshape(values, (E, out, -1)), 1, 2))


class Architecture:
  """One ``model_type``: the base every architecture subclasses.

  A subclass sets the class attributes and defines ``build``, ``layer_types``
  and ``tensors``; :func:`register` adds it to :data:`ARCHITECTURES`.

  Attributes:
    model_type: ``config.json``'s ``model_type``.
    known_as: the models it covers, for the documentation ("Llama 2/3, SmolLM").
    summary: one line of the README's table: the attnjax options it maps to.
    maps_to: the guide's row: the same in full.
    understood: the config keys ``build`` reads.
    inert: keys of this type known not to change the forward pass (besides
      ``INERT_KEYS``).
    defaults: the defaults of ``transformers``' config class of this type.
    prefixes: leading parts tensor names may carry (``"model."``), stripped.
    quantizations: the ``quantization_config`` ``quant_method`` values it reads.
  """

  model_type: ClassVar[str] = ""
  known_as: ClassVar[str] = ""
  summary: ClassVar[str] = ""
  maps_to: ClassVar[str] = ""
  understood: ClassVar[frozenset] = frozenset()
  inert: ClassVar[frozenset] = frozenset()
  defaults: ClassVar[dict] = {}
  prefixes: ClassVar[tuple[str, ...]] = ()
  quantizations: ClassVar[tuple[str, ...]] = ()
  # The output projection's name when the checkpoint stores it tied to the embedding.
  tied_names: ClassVar[tuple[str, ...]] = ("lm_head.weight",)

  def __repr__(self) -> str:
    return f"{type(self).__name__}(model_type={self.model_type!r})"

  def ignored(self, name: str) -> bool:
    """Checkpoint tensors that are not parameters (buffers older versions saved): skipped."""
    del name
    return False

  def skipped(self, config: dict, name: str) -> bool:
    """Checkpoint tensors the loader skips for this ``config`` (``ignored`` ones, and e.g.
    DeepSeek V3's multi-token-prediction layer)."""
    del config
    return self.ignored(name)

  def loaded_note(self, config: dict) -> Optional[str]:
    """A line the loader logs about what it loaded (e.g. a VLM's text model alone), or None."""
    del config
    return None

  def check_keys(self, config: dict) -> None:
    """Raises naming every config key neither understood nor known to be inert."""
    known = self.understood | self.inert | INERT_KEYS | COMMON_KEYS
    unknown = sorted(k for k in config if k not in known)
    if unknown:
      raise CheckpointError(
        f"config.json of model_type={self.model_type!r} has keys the loader does not "
        f"understand: {unknown}. They may change the computation, so the model is not "
        f"built; if a key is known not to affect the forward pass, remove it from config.json"
      )

  def quant_method(self, config: dict) -> Optional[str]:
    """``quantization_config``'s ``quant_method`` (None: not quantised); raises if not read."""
    q = config.get("quantization_config")
    if q is None:
      return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in self.quantizations:
      raise CheckpointError(
        f"config.json: quantization_config with quant_method={method!r} is not supported "
        f"for model_type={self.model_type!r} (supported: {list(self.quantizations)})"
      )
    return method

  def read_config(self, config: dict) -> Config:
    """``config`` with this type's defaults, after the checks every type shares."""
    c = Config(config, self.defaults)
    _check_common(c)
    return c

  def build(self, config: dict):
    """``config.json`` dict -> :class:`attnjax.nn.ModelConfig`."""
    raise NotImplementedError

  def layer_types(self, config: dict) -> list[str]:
    """Each layer's kind: ``"full_attention"`` or ``"sliding_attention"``."""
    raise NotImplementedError

  def tensors(self, config: dict, mcfg) -> dict:
    """``{our path: Rule}`` of every parameter of ``mcfg = build(config)``."""
    raise NotImplementedError


ARCHITECTURES: dict[str, Architecture] = {}


def register(cls: type) -> type:
  """Class decorator: adds an :class:`Architecture` subclass (one instance) to the registry."""
  for name in ("model_type", "summary", "maps_to"):
    if not getattr(cls, name):
      raise TypeError(f"{cls.__name__} must set {name} to be registered")
  if cls.model_type in ARCHITECTURES:
    raise ValueError(
      f"model_type={cls.model_type!r} is already registered ({ARCHITECTURES[cls.model_type]!r})"
    )
  ARCHITECTURES[cls.model_type] = cls()
  return cls


# ---------------------------------------------------------------------------
# GPT-2.


@register
class GPT2(Architecture):
  """GPT-2: learned positions, LayerNorm with bias, ``Conv1D`` weights already ``[in, out]``."""

  model_type = "gpt2"
  summary = (
    '`norm="layer"`, `learned_positions`, `rope_theta=None`, `mlp="gelu"`, '
    '`mlp_bias`, `qkv_bias`, `out_bias`, tied head'
  )
  maps_to = (
    '`norm="layer"` (with bias), `learned_positions=n_positions`, `rope_theta=None`, '
    '`mlp="gelu"` (`gelu_new` -> `mlp_activation="gelu_tanh"`, `gelu` -> '
    '`"gelu_exact"`), `mlp_bias`, `qkv_bias`, `out_bias`, tied head; Conv1D weights '
    'are already `[in, out]`; `scale_attn_by_inverse_layer_idx` -> dense `scale` per '
    'layer'
  )
  understood = frozenset(
    {
      "vocab_size",
      "n_positions",
      "n_embd",
      "n_layer",
      "n_head",
      "n_inner",
      "activation_function",
      "layer_norm_epsilon",
      "scale_attn_weights",
      "scale_attn_by_inverse_layer_idx",
    }
  )
  # reorder_and_upcast_attn computes the same logits in float32 (a precision choice);
  # summary_* configure the multiple-choice head of GPT2DoubleHeadsModel.
  inert = frozenset(
    {
      "n_ctx",
      "resid_pdrop",
      "embd_pdrop",
      "attn_pdrop",
      "reorder_and_upcast_attn",
      "summary_type",
      "summary_use_proj",
      "summary_activation",
      "summary_proj_to_labels",
      "summary_first_dropout",
    }
  )
  defaults = dict(
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    layer_norm_epsilon=1e-5,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    tie_word_embeddings=True,
  )
  prefixes = ("transformer.",)

  def ignored(self, name: str) -> bool:
    # The causal-mask buffers older versions saved with each attention layer.
    return name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")

  def layer_types(self, config: dict) -> list[str]:
    return [FULL] * self.read_config(config).int("n_layer")

  def build(self, config: dict):
    from attnjax._src.nn.config import AttentionConfig, ModelConfig

    c = self.read_config(config)
    D, N, L = c.int("n_embd"), c.int("n_head"), c.int("n_layer")
    if D % N:
      raise CheckpointError(f"config.json: n_embd={D} is not divisible by n_head={N}")
    H = D // N
    activation = _activation(c, "activation_function")
    if activation == "silu":
      raise CheckpointError(
        "config.json: activation_function='silu' is not supported for gpt2 (its MLP is ungated)"
      )
    layers = []
    for i in range(L):
      scale = H**-0.5 if c.flag("scale_attn_weights") else 1.0
      if c.flag("scale_attn_by_inverse_layer_idx"):
        scale /= float(i + 1)
      layers.append(
        AttentionConfig(
          num_heads=N,
          head_dim=H,
          rope_theta=None,
          qkv_bias=True,
          out_bias=True,
          scale=None if scale == H**-0.5 else scale,
        )
      )
    same = all(a == layers[0] for a in layers)
    return ModelConfig(
      vocab_size=c.int("vocab_size"),
      d_model=D,
      num_layers=L,
      attention=layers[0],
      layer_attention=None if same else tuple(layers),
      mlp="gelu",
      mlp_dim=c["n_inner"] or 4 * D,
      mlp_activation=activation,
      mlp_bias=True,
      norm="layer",
      norm_eps=float(c["layer_norm_epsilon"]),
      tie_embeddings=c.flag("tie_word_embeddings"),
      learned_positions=c.int("n_positions"),
    )

  def tensors(self, config: dict, mcfg) -> dict:
    D, V, I, P = mcfg.d_model, mcfg.vocab_size, mcfg.hidden_dim, mcfg.learned_positions
    rules: dict[Path, Rule] = {
      ("embed", "embedding"): Rule(("wte.weight",), ((V, D),), _same),
      ("position_embed", "embedding"): Rule(("wpe.weight",), ((P, D),), _same),
      ("final_norm", "scale"): Rule(("ln_f.weight",), ((D,),), _same),
      ("final_norm", "bias"): Rule(("ln_f.bias",), ((D,),), _same),
    }
    if not mcfg.tie_embeddings:
      rules[("head", "kernel")] = Rule(("lm_head.weight",), ((V, D),), _transpose)
    for i in range(mcfg.num_layers):
      pre, blk = f"h.{i}.", ("blocks", i)
      for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
        rules[blk + (ours, "scale")] = Rule((f"{pre}{theirs}.weight",), ((D,),), _same)
        rules[blk + (ours, "bias")] = Rule((f"{pre}{theirs}.bias",), ((D,),), _same)
      # Conv1D stores [in, out]: our kernels' layout. c_attn's columns are q, k, v.
      for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        cols = _columns(j * D, (j + 1) * D)
        rules[blk + ("attention", proj, "kernel")] = Rule(
          (f"{pre}attn.c_attn.weight",), ((D, 3 * D),), cols
        )
        rules[blk + ("attention", proj, "bias")] = Rule(
          (f"{pre}attn.c_attn.bias",), ((3 * D,),), cols
        )
      for ours, theirs, shape in (
        (("attention", "o_proj"), "attn.c_proj", (D, D)),
        (("mlp", "up"), "mlp.c_fc", (D, I)),
        (("mlp", "down"), "mlp.c_proj", (I, D)),
      ):
        rules[blk + ours + ("kernel",)] = Rule((f"{pre}{theirs}.weight",), (shape,), _same)
        rules[blk + ours + ("bias",)] = Rule((f"{pre}{theirs}.bias",), ((shape[1],),), _same)
    return rules


# ---------------------------------------------------------------------------
# Llama-style decoders: the Llama base and its hooks.


def _alternating(L: int) -> list[str]:
  """Sliding and full layers in turn, sliding first (Gemma 2, gpt-oss)."""
  return [SLIDING if i % 2 == 0 else FULL for i in range(L)]


def _qk_norm(c: Config, scope: str, gain_offset: float) -> dict[str, Any]:
  """``family="qk_norm"``: RMSNorm of q and k with gains, before RoPE, over ``scope``."""
  return dict(
    family="qk_norm",
    qk_norm="rms",
    qk_norm_eps=float(c["rms_norm_eps"]),
    qk_norm_gain=True,
    qk_norm_placement="before_rope",
    qk_norm_scope=scope,
    qk_norm_gain_offset=gain_offset,
  )


class LlamaStyle(Architecture):
  """The Llama decoder; each Llama-style model type overrides the hooks where it differs.

  Config hooks (``c`` is the config with this type's ``defaults``):
  ``default_layer_types`` (when the config has no ``layer_types``), ``window``,
  ``rope_parameters``, ``head_dim``, ``attention_bias``, ``attention_options``
  (the family and its options), ``mlp`` and ``model_options`` (norms, embedding
  scale, final softcap). Tensor hooks: ``attention_tensors``, ``norm_names``
  and ``mlp_tensors``. ``build`` and ``tensors`` put them together.
  """

  understood = frozenset(
    {
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_hidden_layers",
      "num_attention_heads",
      "num_key_value_heads",
      "head_dim",
      "hidden_act",
      "rms_norm_eps",
      "rope_theta",
      "rope_scaling",
      "rope_parameters",
      "partial_rotary_factor",
    }
  )
  defaults = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    max_position_embeddings=2048,
  )
  prefixes = ("model.",)
  activation_key: ClassVar[str] = "hidden_act"
  rope_theta: ClassVar[float] = 10000.0
  # The layer types this model type has (the hybrids: full and linear attention).
  layer_kinds: ClassVar[tuple[str, ...]] = (FULL, SLIDING)
  # (ours, theirs) of each block's norms: pre-norm.
  norm_names: ClassVar[tuple] = (
    ("attn_norm", "input_layernorm"),
    ("mlp_norm", "post_attention_layernorm"),
  )

  def ignored(self, name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")

  # Config hooks.

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    del c
    return [FULL] * num_layers

  def window(self, c: Config, layer_type: str) -> Optional[int]:
    """attnjax's ``window`` (``W - 1``) of a layer, from ``transformers``' ``sliding_window`` W."""
    W = c["sliding_window"] if layer_type == SLIDING else None
    if W is None:
      return None
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
      raise CheckpointError(f"config.json: sliding_window must be a positive int, got {W!r}")
    return W - 1

  def rope_parameters(self, c: Config, layer_type: str) -> tuple[dict, float]:
    """``(parameters, default rope_theta)`` of a layer type; ``rope_scaling`` (older) wins."""
    del layer_type
    scaling, params = _rope_dicts(c)
    chosen = scaling or params or c.defaults.get("rope_parameters") or {}
    return dict(chosen), c.raw.get("rope_theta", self.rope_theta)

  def layer_rope(self, c: Config, layer_type: str) -> tuple[Optional[float], Optional[tuple]]:
    """``(rope_theta, rope_scaling)`` of a layer type."""
    return _rope(c, *self.rope_parameters(c, layer_type))

  def head_dim(self, c: Config, d_model: int, num_heads: int) -> int:
    return c["head_dim"] or d_model // num_heads

  def attention_bias(self, c: Config) -> tuple[bool, bool]:
    """``(qkv_bias, out_bias)``."""
    bias = c.flag("attention_bias")
    return bias, bias

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    """``AttentionConfig`` options of a layer type (``family`` among them, default dense)."""
    del c, layer_type
    return {}

  def mlp(self, c: Config) -> dict[str, Any]:
    """``ModelConfig``'s MLP fields: gated, SwiGLU for SiLU, else GeGLU-style."""
    activation = _activation(c, self.activation_key)
    if activation == "silu":
      return dict(mlp="swiglu", mlp_dim=c.int("intermediate_size"))
    return dict(mlp="geglu", mlp_activation=activation, mlp_dim=c.int("intermediate_size"))

  def model_options(self, c: Config, d_model: int) -> dict[str, Any]:
    """The other ``ModelConfig`` fields: norms, embedding scale, final softcap."""
    del c, d_model
    return dict(norm="rms", norm_placement="pre")

  # Tensor hooks (names after the prefix; ``pre`` ends with a dot).

  def attention_tensors(
    self, config: dict, pre: str, path: Path, a, d_model: int
  ) -> dict[Path, Rule]:
    """The rules of one attention layer ``a`` (its ``AttentionConfig``) at ``path``;
    ``config`` is the checkpoint's ``config.json`` (its quantisation, its RoPE layout)."""
    del config
    N, K, H, D = a.num_heads, a.kv_heads, a.head_dim_for(d_model), d_model
    rules: dict[Path, Rule] = {}
    for proj, rows in (("q_proj", N * H), ("k_proj", K * H), ("v_proj", K * H)):
      rules[path + (proj, "kernel")] = Rule((f"{pre}{proj}.weight",), ((rows, D),), _transpose)
      if a.qkv_bias:
        rules[path + (proj, "bias")] = Rule((f"{pre}{proj}.bias",), ((rows,),), _same)
    rules[path + ("o_proj", "kernel")] = Rule((f"{pre}o_proj.weight",), ((D, N * H),), _transpose)
    if a.out_bias:
      rules[path + ("o_proj", "bias")] = Rule((f"{pre}o_proj.bias",), ((D,),), _same)
    if a.family == "qk_norm":
      projection = a.qk_norm_scope == "projection"
      for name, heads in (("q", N), ("k", K)):
        rules[path + (f"{name}_gain",)] = Rule(
          (f"{pre}{name}_norm.weight",), ((heads * H if projection else H,),), _same
        )
    return rules

  def mlp_tensors(self, config: dict, pre: str, path: Path, mcfg) -> dict[Path, Rule]:
    """The rules of one block's MLP at ``path``."""
    del config
    D, I = mcfg.d_model, mcfg.hidden_dim
    rules: dict[Path, Rule] = {}
    for proj, ours, shape in (
      ("gate_proj", "gate", (I, D)),
      ("up_proj", "up", (I, D)),
      ("down_proj", "down", (D, I)),
    ):
      rules[path + (ours, "kernel")] = Rule((f"{pre}{proj}.weight",), (shape,), _transpose)
      if mcfg.mlp_bias:
        rules[path + (ours, "bias")] = Rule((f"{pre}{proj}.bias",), ((shape[0],),), _same)
    return rules

  # Put together.

  def _layer_types(self, c: Config) -> list[str]:
    L = c.int("num_hidden_layers")
    types = c.raw.get("layer_types")
    if types is None:
      types = self.default_layer_types(c, L)
    if not isinstance(types, list) or len(types) != L:
      raise CheckpointError(
        f"config.json: layer_types must list num_hidden_layers={L} entries, got {types!r}"
      )
    for t in types:
      if t not in self.layer_kinds:
        raise CheckpointError(
          f"config.json: layer_types entry {t!r} is not a layer type model_type="
          f"{self.model_type!r} has (supported: {', '.join(self.layer_kinds)})"
        )
    return list(types)

  def layer_types(self, config: dict) -> list[str]:
    return self._layer_types(self.read_config(config))

  def build(self, config: dict):
    from attnjax._src.nn.config import AttentionConfig, ModelConfig

    c = self.read_config(config)
    D, N = c.int("hidden_size"), c.int("num_attention_heads")
    K = c["num_key_value_heads"] or N
    H = self.head_dim(c, D, N)
    if c.raw.get("rope_interleaved"):
      raise CheckpointError(
        "config.json: rope_interleaved=true (RoPE on interleaved pairs) is "
        "not how transformers computes this model; not supported"
      )
    if c.raw.get("use_bidirectional_attention"):
      raise CheckpointError(
        "config.json: use_bidirectional_attention=true (an encoder) is not "
        "supported; a causal language model is loaded"
      )
    mlp = self.mlp(c)
    qkv_bias, out_bias = self.attention_bias(c)
    layers = []
    for layer_type in self._layer_types(c):
      theta, scaling = self.layer_rope(c, layer_type)
      options = dict(self.attention_options(c, layer_type))
      window = self.window(c, layer_type)
      if window is not None:
        options["window"] = window
      family = options.pop("family", "dense")
      common = dict(
        num_heads=N,
        num_kv_heads=K,
        head_dim=H,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
      )
      common.update(options)  # a layer type's own heads, dims, RoPE (the hybrids' linear layers)
      try:
        layers.append(AttentionConfig(family, **common))
      except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {layer_type} layers: {e}") from None
    same = all(a == layers[0] for a in layers)
    return ModelConfig(
      vocab_size=c.int("vocab_size"),
      d_model=D,
      num_layers=len(layers),
      attention=layers[0],
      layer_attention=None if same else tuple(layers),
      norm_eps=float(c["rms_norm_eps"]),
      tie_embeddings=c.flag("tie_word_embeddings"),
      **mlp,
      **self.model_options(c, D),
    )

  def tensors(self, config: dict, mcfg) -> dict:
    D, V = mcfg.d_model, mcfg.vocab_size
    rules: dict[Path, Rule] = {
      ("embed", "embedding"): Rule(("embed_tokens.weight",), ((V, D),), _same),
      ("final_norm", "scale"): Rule(("norm.weight",), ((D,),), _same),
    }
    if not mcfg.tie_embeddings:
      rules[("head", "kernel")] = Rule(("lm_head.weight",), ((V, D),), _transpose)
    for i in range(mcfg.num_layers):
      pre, blk = f"layers.{i}.", ("blocks", i)
      rules.update(
        self.attention_tensors(
          config, pre + "self_attn.", blk + ("attention",), mcfg.attention_for(i), D
        )
      )
      for ours, theirs in self.norm_names:
        rules[blk + (ours, "scale")] = Rule((f"{pre}{theirs}.weight",), ((D,),), _same)
      rules.update(self.mlp_tensors(config, pre + "mlp.", blk + ("mlp",), mcfg))
    return rules


# ---------------------------------------------------------------------------
# The Llama-style model types, each its differences from the base.


@register
class Llama(LlamaStyle):
  """Llama 2/3 and SmolLM: the base, with ``mlp_bias``."""

  model_type = "llama"
  known_as = "Llama 2/3, SmolLM"
  summary = '`norm="rms"`, `mlp="swiglu"`, GQA, `rope_scaling` (`linear`, `llama3`, `yarn`)'
  maps_to = (
    '`norm="rms"`, `mlp="swiglu"`, `num_kv_heads` (GQA), `rope_theta` + '
    '`rope_scaling` (`linear`, `llama3`, `yarn`), `attention_bias` -> '
    '`qkv_bias`/`out_bias`, `mlp_bias`, tied or untied'
  )
  understood = LlamaStyle.understood | {"attention_bias", "mlp_bias", "rope_interleaved"}
  # pretraining_tp sliced Llama 2's matmuls (the same sums); SmolLM's configs carry nanotron's
  # is_llama_config and rope_interleaved, which transformers does not read (false: checked).
  inert = frozenset({"pretraining_tp", "is_llama_config"})

  def mlp(self, c: Config) -> dict[str, Any]:
    return dict(super().mlp(c), mlp_bias=c.flag("mlp_bias"))


@register
class Mistral(LlamaStyle):
  """Mistral: a sliding window on every layer."""

  model_type = "mistral"
  summary = "as llama, `window=sliding_window - 1` on every layer"
  maps_to = "as llama, `window = sliding_window - 1` on every layer"
  understood = LlamaStyle.understood | {"sliding_window"}
  defaults = dict(
    LlamaStyle.defaults,
    max_position_embeddings=4096 * 32,
    num_key_value_heads=8,
    sliding_window=4096,
  )

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    return [FULL if c["sliding_window"] is None else SLIDING] * num_layers


@register
class Qwen2(LlamaStyle):
  """Qwen 2: q/k/v biases; windows from ``max_window_layers`` with ``use_sliding_window``."""

  model_type = "qwen2"
  summary = "as llama with `qkv_bias`; windows from `max_window_layers`"
  maps_to = (
    "as llama, `qkv_bias=True`; with `use_sliding_window`, windows on the layers from "
    "`max_window_layers` (`layer_attention`)"
  )
  understood = LlamaStyle.understood | {
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
  }
  defaults = dict(
    LlamaStyle.defaults,
    max_position_embeddings=32768,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
  )

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    windowed = c.flag("use_sliding_window") and c["sliding_window"] is not None
    first = c.int("max_window_layers") if windowed else num_layers
    return [SLIDING if i >= first else FULL for i in range(num_layers)]

  def window(self, c: Config, layer_type: str) -> Optional[int]:
    # sliding_window counts only with use_sliding_window.
    return super().window(c, layer_type) if c.flag("use_sliding_window") else None

  def attention_bias(self, c: Config) -> tuple[bool, bool]:
    return True, False


@register
class Qwen3(Qwen2):
  """Qwen 3: Qwen 2's windows, RMSNorm of q and k per head, ``attention_bias``."""

  model_type = "qwen3"
  summary = 'as llama, `family="qk_norm"` (per head); windows as qwen2'
  maps_to = (
    '`family="qk_norm"` (RMSNorm per head, before RoPE, gains `[H]`), explicit '
    '`head_dim`, windows as qwen2'
  )
  understood = Qwen2.understood | {"attention_bias"}
  defaults = dict(Qwen2.defaults, head_dim=128)

  def attention_bias(self, c: Config) -> tuple[bool, bool]:
    return LlamaStyle.attention_bias(self, c)

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    return _qk_norm(c, "head", 0.0)


@register
class Gemma2(LlamaStyle):
  """Gemma 2: ``(1 + w)`` sandwich norms, GeGLU, scaled embedding, softcaps, alternating windows."""

  model_type = "gemma2"
  summary = (
    '`norm="rms_plus_one"`, `norm_placement="sandwich"`, `mlp="geglu"`, '
    '`embed_scale`, `scale`, `softcap`, `final_softcap`, alternating windows'
  )
  maps_to = (
    '`norm="rms_plus_one"` (`(1 + w)`, float32), `norm_placement="sandwich"`, '
    '`mlp="geglu"`, `embed_scale=sqrt(D)`, dense '
    '`scale=query_pre_attn_scalar ** -0.5`, `softcap`, `final_softcap`, alternating '
    'window / global layers'
  )
  understood = LlamaStyle.understood | {
    "attention_bias",
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
  }
  # Gemma's modelling reads hidden_activation; older configs also carry an unused hidden_act.
  inert = frozenset({"hidden_act", "cache_implementation", "sliding_window_size"})
  defaults = dict(
    LlamaStyle.defaults,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
    max_position_embeddings=8192,
  )
  activation_key = "hidden_activation"
  norm_names = (
    ("attn_norm", "input_layernorm"),
    ("attn_post_norm", "post_attention_layernorm"),
    ("mlp_norm", "pre_feedforward_layernorm"),
    ("mlp_post_norm", "post_feedforward_layernorm"),
  )

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    return _alternating(num_layers)

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    options: dict[str, Any] = {"scale": float(c["query_pre_attn_scalar"]) ** -0.5}
    if c["attn_logit_softcapping"] is not None:
      options["softcap"] = float(c["attn_logit_softcapping"])
    return options

  def model_options(self, c: Config, d_model: int) -> dict[str, Any]:
    options: dict[str, Any] = dict(
      norm="rms_plus_one", norm_placement="sandwich", embed_scale=float(d_model) ** 0.5
    )
    if c["final_logit_softcapping"] is not None:
      options["final_softcap"] = float(c["final_logit_softcapping"])
    return options


@register
class Gemma3Text(Gemma2):
  """Gemma 3 (text): Gemma 2 with QK-norm, local / global RoPE and a window pattern."""

  model_type = "gemma3_text"
  summary = 'as gemma2 with `family="qk_norm"`, local / global RoPE'
  maps_to = (
    'as gemma2 with `family="qk_norm"` (`qk_norm_gain_offset=1`, `scale`), local / '
    'global `rope_theta` and `rope_scaling` per layer, `sliding_window_pattern`'
  )
  understood = Gemma2.understood | {
    "rope_local_base_freq",
    "sliding_window_pattern",
    "_sliding_window_pattern",
  }
  defaults = dict(
    Gemma2.defaults,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    max_position_embeddings=131072,
  )
  rope_theta = 1_000_000.0
  local_rope_theta: ClassVar[float] = 10_000.0

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    pattern = c.raw.get("sliding_window_pattern", c.raw.get("_sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]

  def rope_parameters(self, c: Config, layer_type: str) -> tuple[dict, float]:
    """``rope_parameters`` nested by layer type; older configs scale only the full layers
    and give the sliding ones their own base (``rope_local_base_freq``)."""
    scaling, params = _rope_dicts(c)
    nested = params if params and any(isinstance(v, dict) for v in params.values()) else {}
    chosen = dict(nested.get(layer_type) or {})
    if layer_type == SLIDING:
      return chosen, c.raw.get("rope_local_base_freq", self.local_rope_theta)
    if scaling is not None:
      chosen.update(scaling)
    return chosen, c.raw.get("rope_theta", self.rope_theta)

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    options = super().attention_options(c, layer_type)
    return dict(options, **_qk_norm(c, "head", 1.0))


@register
class Olmo2(LlamaStyle):
  """OLMo 2: RMSNorm of the whole q and k projections, post-norm blocks."""

  model_type = "olmo2"
  summary = '`family="qk_norm"` with `qk_norm_scope="projection"`, `norm_placement="post"`'
  maps_to = (
    '`family="qk_norm"` with `qk_norm_scope="projection"` (RMSNorm over all heads\' '
    '`N H` before the split), `norm_placement="post"`'
  )
  understood = LlamaStyle.understood | {"attention_bias"}
  defaults = dict(LlamaStyle.defaults, rms_norm_eps=1e-5)
  norm_names = (
    ("attn_post_norm", "post_attention_layernorm"),
    ("mlp_post_norm", "post_feedforward_layernorm"),
  )

  def head_dim(self, c: Config, d_model: int, num_heads: int) -> int:
    return d_model // num_heads  # head_dim is not a key of its config

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    return _qk_norm(c, "projection", 0.0)

  def model_options(self, c: Config, d_model: int) -> dict[str, Any]:
    return dict(norm="rms", norm_placement="post")


@register
class GptOss(LlamaStyle):
  """gpt-oss: sink logits, alternating windows, YaRN, top-k experts (MXFP4 or not)."""

  model_type = "gpt_oss"
  summary = (
    '`sink_logits=True`, alternating windows, yarn RoPE, `mlp="moe"` (top-k routing, '
    'exact), MXFP4 experts dequantised'
  )
  maps_to = (
    '`sink_logits=True`, alternating windows, `rope_scaling` yarn, '
    '`qkv_bias`/`out_bias`, `mlp="moe"` (`num_experts`, `experts_per_token`, '
    '`moe_alpha`, `moe_limit`: gpt-oss\'s clamped SwiGLU with top-k routing, computed '
    'exactly); MXFP4 experts are dequantised'
  )
  understood = LlamaStyle.understood | {
    "attention_bias",
    "sliding_window",
    "layer_types",
    "num_local_experts",
    "num_experts_per_tok",
    "swiglu_alpha",
    "swiglu_limit",
  }
  # gpt-oss's own names beside transformers' (experts_per_token), the router's training loss.
  inert = frozenset(
    {"router_aux_loss_coef", "output_router_logits", "experts_per_token", "initial_context_length"}
  )
  defaults = dict(
    LlamaStyle.defaults,
    rms_norm_eps=1e-5,
    attention_bias=True,
    head_dim=64,
    sliding_window=128,
    num_local_experts=128,
    num_experts_per_tok=4,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    max_position_embeddings=131072,
    rope_parameters=dict(
      rope_type="yarn",
      factor=32.0,
      beta_fast=32.0,
      beta_slow=1.0,
      truncate=False,
      original_max_position_embeddings=4096,
    ),
  )
  quantizations = ("mxfp4",)
  rope_theta = 150000.0

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    return _alternating(num_layers)

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    return {"sink_logits": True}

  def mlp(self, c: Config) -> dict[str, Any]:
    _activation(c, self.activation_key)  # checked, though the experts' SwiGLU is fixed
    return dict(
      mlp="moe",
      mlp_dim=c.int("intermediate_size"),
      num_experts=c.int("num_local_experts"),
      experts_per_token=c.int("num_experts_per_tok"),
      moe_alpha=float(c["swiglu_alpha"]),
      moe_limit=None if c["swiglu_limit"] is None else float(c["swiglu_limit"]),
    )

  def attention_tensors(
    self, config: dict, pre: str, path: Path, a, d_model: int
  ) -> dict[Path, Rule]:
    rules = super().attention_tensors(config, pre, path, a, d_model)
    if a.sink_logits:
      rules[path + ("sink_logits",)] = Rule((f"{pre}sinks",), ((a.num_heads,),), _same)
    return rules

  def mlp_tensors(self, config: dict, pre: str, path: Path, mcfg) -> dict[Path, Rule]:
    E, D, I = mcfg.num_experts, mcfg.d_model, mcfg.hidden_dim
    ex = f"{pre}experts."
    rules = {
      path + ("router", "kernel"): Rule((f"{pre}router.weight",), ((E, D),), _transpose),
      path + ("router", "bias"): Rule((f"{pre}router.bias",), ((E,),), _same),
      path + ("gate_bias",): Rule((f"{ex}gate_up_proj_bias",), ((E, 2 * I),), _every_other(0)),
      path + ("up_bias",): Rule((f"{ex}gate_up_proj_bias",), ((E, 2 * I),), _every_other(1)),
      path + ("down_bias",): Rule((f"{ex}down_proj_bias",), ((E, D),), _same),
    }
    if self.quant_method(config) == "mxfp4":
      rules.update(_mxfp4_expert_rules(ex, path, E, D, I))
      return rules
    gate_up = ((f"{ex}gate_up_proj",), ((E, D, 2 * I),))
    rules[path + ("gate",)] = Rule(*gate_up, _every_other(0))
    rules[path + ("up",)] = Rule(*gate_up, _every_other(1))
    rules[path + ("down",)] = Rule((f"{ex}down_proj",), ((E, I, D),), _same)
    return rules


def _mxfp4_expert_rules(ex: str, path: Path, E: int, D: int, I: int) -> dict[Path, Rule]:
  """gpt-oss's experts in MXFP4 (``*_blocks`` and ``*_scales``), dequantised as they are read."""
  if D % 32 or I % 32:
    raise CheckpointError(
      f"config.json: mxfp4 experts need hidden_size={D} and "
      f"intermediate_size={I} to be multiples of 32"
    )
  gate_up = (
    (f"{ex}gate_up_proj_blocks", f"{ex}gate_up_proj_scales"),
    ((E, 2 * I, D // 32, 16), (E, 2 * I, D // 32)),
  )
  down = (
    (f"{ex}down_proj_blocks", f"{ex}down_proj_scales"),
    ((E, D, I // 32, 16), (E, D, I // 32)),
  )
  return {
    path + ("gate",): Rule(*gate_up, lambda b, s: _every_other(0)(dequantize_mxfp4(b, s))),
    path + ("up",): Rule(*gate_up, lambda b, s: _every_other(1)(dequantize_mxfp4(b, s))),
    path + ("down",): Rule(*down, dequantize_mxfp4),
  }


# ---------------------------------------------------------------------------
# Encoders: BERT, RoBERTa, ModernBERT (nn.EncoderLM).


def _heads(c: Config, model_type: str, supported: tuple[str, str]) -> bool:
  """True for the masked-LM head, False for the bare encoder, from ``architectures``."""
  names = c.raw.get("architectures") or [supported[1]]
  if not isinstance(names, list) or len(names) != 1 or names[0] not in supported:
    raise CheckpointError(
      f"config.json: architectures={names!r} lists a head the loader does not support for "
      f"model_type={model_type!r} (supported heads: {', '.join(supported)}; an encoder is "
      f"loaded with its masked-LM head or bare)"
    )
  return names[0] == supported[1]


def _linear_rules(rules: dict, ours: Path, theirs: str, shape: tuple, bias: bool) -> None:
  """A ``torch.nn.Linear`` ``[out, in]`` weight (and bias) as our ``[in, out]`` kernel."""
  rules[ours + ("kernel",)] = Rule((f"{theirs}.weight",), (shape,), _transpose)
  if bias:
    rules[ours + ("bias",)] = Rule((f"{theirs}.bias",), ((shape[0],),), _same)


def _norm_rules(rules: dict, ours: Path, theirs: str, D: int, bias: bool) -> None:
  rules[ours + ("scale",)] = Rule((f"{theirs}.weight",), ((D,),), _same)
  if bias:
    rules[ours + ("bias",)] = Rule((f"{theirs}.bias",), ((D,),), _same)


@register
class Bert(Architecture):
  """BERT: learned positions and token types, post-LN blocks, GELU, biases, MLM head or pooler."""

  model_type = "bert"
  known_as = "BertModel, BertForMaskedLM"
  summary = (
    '`nn.EncoderLM`: `norm_placement="post_residual"`, `token_types`, `learned_positions`, '
    "`embed_norm`, MLM head or pooler"
  )
  maps_to = (
    '`nn.EncoderConfig`: `is_causal=False`, `norm="layer"`, `norm_placement="post_residual"` '
    "(BERT's post-LN), `embed_norm`, `token_types=type_vocab_size`, "
    "`learned_positions=max_position_embeddings`, `rope_theta=None`, `mlp=\"gelu\"` with "
    "biases (`hidden_act`), `qkv_bias`, `out_bias`; `architectures` `BertForMaskedLM` -> "
    "`mlm_head` (tied, `output_bias`), `BertModel` -> `pooler`"
  )
  heads: ClassVar[tuple[str, str]] = ("BertModel", "BertForMaskedLM")
  understood = frozenset(
    {
      "vocab_size",
      "hidden_size",
      "num_hidden_layers",
      "num_attention_heads",
      "intermediate_size",
      "hidden_act",
      "max_position_embeddings",
      "type_vocab_size",
      "layer_norm_eps",
      "position_embedding_type",
      "is_decoder",
    }
  )
  inert = frozenset({"hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"})
  defaults = dict(
    hidden_act="gelu",
    max_position_embeddings=512,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    pad_token_id=0,
    tie_word_embeddings=True,
  )
  prefixes = ("bert.",)
  tied_names = ("cls.predictions.decoder.weight",)
  head_prefix: ClassVar[str] = "cls.predictions."

  def ignored(self, name: str) -> bool:
    # Buffers older versions saved; the decoder's bias is cls.predictions.bias again.
    return name.endswith("embeddings.position_ids") or name == "cls.predictions.decoder.bias"

  def layer_types(self, config: dict) -> list[str]:
    return [FULL] * self.read_config(config).int("num_hidden_layers")

  def positions(self, c: Config) -> dict[str, Any]:
    """RoBERTa's offset positions (BERT: none)."""
    del c
    return {}

  def build(self, config: dict):
    from attnjax._src.nn.config import AttentionConfig, EncoderConfig

    c = self.read_config(config)
    mlm = _heads(c, self.model_type, self.heads)
    if c.flag("is_decoder"):
      raise CheckpointError(
        f"config.json: is_decoder=true (a causal {self.model_type}) is not supported; "
        f"the encoder is loaded"
      )
    kind = c.raw.get("position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
      raise CheckpointError(
        f"config.json: position_embedding_type={kind!r} is not supported (supported: absolute)"
      )
    D, N = c.int("hidden_size"), c.int("num_attention_heads")
    if D % N:
      raise CheckpointError(f"config.json: hidden_size={D} is not divisible by {N} heads")
    activation = _activation(c, "hidden_act")
    if activation == "silu":
      raise CheckpointError(
        f"config.json: hidden_act='silu' is not supported for {self.model_type} (ungated MLP)"
      )
    attention = AttentionConfig(
      num_heads=N, head_dim=D // N, rope_theta=None, qkv_bias=True, out_bias=True, is_causal=False
    )
    return EncoderConfig(
      vocab_size=c.int("vocab_size"),
      d_model=D,
      num_layers=c.int("num_hidden_layers"),
      attention=attention,
      mlp="gelu",
      mlp_dim=c.int("intermediate_size"),
      mlp_activation=activation,
      mlp_bias=True,
      norm="layer",
      norm_eps=float(c["layer_norm_eps"]),
      norm_placement="post_residual",
      tie_embeddings=c.flag("tie_word_embeddings"),
      learned_positions=c.int("max_position_embeddings"),
      token_types=c.int("type_vocab_size"),
      embed_norm=True,
      mlm_head=mlm,
      head_activation=activation,
      pooler=not mlm,
      pad_token_id=c["pad_token_id"],
      **self.positions(c),
    )

  def tensors(self, config: dict, mcfg) -> dict:
    D, V, I = mcfg.d_model, mcfg.vocab_size, mcfg.hidden_dim
    rules: dict[Path, Rule] = {
      ("embed", "embedding"): Rule(("embeddings.word_embeddings.weight",), ((V, D),), _same),
      ("position_embed", "embedding"): Rule(
        ("embeddings.position_embeddings.weight",), ((mcfg.learned_positions, D),), _same
      ),
      ("token_type_embed", "embedding"): Rule(
        ("embeddings.token_type_embeddings.weight",), ((mcfg.token_types, D),), _same
      ),
    }
    _norm_rules(rules, ("embed_norm",), "embeddings.LayerNorm", D, True)
    for i in range(mcfg.num_layers):
      pre, blk = f"encoder.layer.{i}.", ("blocks", i)
      for ours, theirs in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        _linear_rules(
          rules, blk + ("attention", ours), f"{pre}attention.self.{theirs}", (D, D), True
        )
      _linear_rules(
        rules, blk + ("attention", "o_proj"), f"{pre}attention.output.dense", (D, D), True
      )
      _norm_rules(rules, blk + ("attn_post_norm",), f"{pre}attention.output.LayerNorm", D, True)
      _linear_rules(rules, blk + ("mlp", "up"), f"{pre}intermediate.dense", (I, D), True)
      _linear_rules(rules, blk + ("mlp", "down"), f"{pre}output.dense", (D, I), True)
      _norm_rules(rules, blk + ("mlp_post_norm",), f"{pre}output.LayerNorm", D, True)
    if mcfg.pooler:
      _linear_rules(rules, ("pooler",), "pooler.dense", (D, D), True)
    if mcfg.mlm_head:
      self.head_rules(rules, mcfg)
    return rules

  def head_rules(self, rules: dict, mcfg) -> None:
    D, V, h = mcfg.d_model, mcfg.vocab_size, self.head_prefix
    _linear_rules(rules, ("head_dense",), f"{h}transform.dense", (D, D), True)
    _norm_rules(rules, ("head_norm",), f"{h}transform.LayerNorm", D, True)
    rules[("output_bias",)] = Rule((f"{h}bias",), ((V,),), _same)
    if not mcfg.tie_embeddings:
      rules[("head", "kernel")] = Rule((f"{h}decoder.weight",), ((V, D),), _transpose)


@register
class Roberta(Bert):
  """RoBERTa: BERT's encoder; positions offset past ``padding_idx``; its ``lm_head``."""

  model_type = "roberta"
  known_as = "RobertaModel, RobertaForMaskedLM"
  summary = "as bert, `position_offset=pad_token_id + 1`"
  maps_to = (
    "as bert; positions numbered from `padding_idx + 1` over the tokens that are not "
    "`pad_token_id` (`position_offset`, padding at `padding_idx`); `lm_head` -> the MLM head"
  )
  heads = ("RobertaModel", "RobertaForMaskedLM")
  defaults = dict(Bert.defaults, pad_token_id=1, layer_norm_eps=1e-12)
  prefixes = ("roberta.",)
  tied_names = ("lm_head.decoder.weight",)

  def ignored(self, name: str) -> bool:
    return name.endswith("embeddings.position_ids") or name == "lm_head.decoder.bias"

  def positions(self, c: Config) -> dict[str, Any]:
    return dict(position_offset=c.int("pad_token_id") + 1)

  def head_rules(self, rules: dict, mcfg) -> None:
    D, V = mcfg.d_model, mcfg.vocab_size
    _linear_rules(rules, ("head_dense",), "lm_head.dense", (D, D), True)
    _norm_rules(rules, ("head_norm",), "lm_head.layer_norm", D, True)
    rules[("output_bias",)] = Rule(("lm_head.bias",), ((V,),), _same)
    if not mcfg.tie_embeddings:
      rules[("head", "kernel")] = Rule(("lm_head.decoder.weight",), ((V, D),), _transpose)


@register
class ModernBert(Architecture):
  """ModernBERT: pre-LN, rotary, alternating global and local (sliding-window) layers, GeGLU."""

  model_type = "modernbert"
  known_as = "ModernBertModel, ModernBertForMaskedLM"
  summary = (
    "`nn.EncoderLM`: pre-norm without the first attention norm, `norm_bias`, RoPE per layer "
    'type, symmetric `window` on the local layers, `mlp="geglu"`, no biases'
  )
  maps_to = (
    '`nn.EncoderConfig`: `is_causal=False`, `norm="layer"` with `norm_bias`, pre-norm, '
    "`first_attn_norm=False` (layer 0 reads the normed embeddings), `embed_norm`, "
    "`rope_theta` per layer type (`rope_parameters`, or `global_rope_theta` / "
    "`local_rope_theta`), `window=local_attention // 2` (both sides) on the "
    '`sliding_attention` layers (every `global_attn_every_n_layers`-th is global), '
    '`mlp="geglu"` (the first half of `Wi` is activated), `attention_bias` / `mlp_bias`, '
    "MLM head (`classifier_bias`, `classifier_activation`, `decoder_bias`)"
  )
  heads: ClassVar[tuple[str, str]] = ("ModernBertModel", "ModernBertForMaskedLM")
  understood = frozenset(
    {
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_hidden_layers",
      "num_attention_heads",
      "hidden_activation",
      "norm_eps",
      "norm_bias",
      "attention_bias",
      "mlp_bias",
      "layer_types",
      "rope_parameters",
      "rope_scaling",
      "global_rope_theta",
      "local_rope_theta",
      "local_attention",
      "global_attn_every_n_layers",
      "decoder_bias",
      "classifier_bias",
      "classifier_activation",
    }
  )
  # Dropouts, initialisation, flash-attention and classifier settings, prediction sparsity
  # (which positions transformers computes, not their values).
  inert = frozenset(
    {
      "initializer_cutoff_factor",
      "embedding_dropout",
      "mlp_dropout",
      "classifier_dropout",
      "classifier_pooling",
      "deterministic_flash_attn",
      "sparse_prediction",
      "sparse_pred_ignore_index",
      "cls_token_id",
      "reference_compile",
      "repad_logits_with_grad",
    }
  )
  defaults = dict(
    hidden_activation="gelu",
    norm_eps=1e-5,
    norm_bias=False,
    attention_bias=False,
    mlp_bias=False,
    local_attention=128,
    global_attn_every_n_layers=3,
    global_rope_theta=160000.0,
    local_rope_theta=10000.0,
    decoder_bias=True,
    classifier_bias=False,
    classifier_activation="gelu",
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    pad_token_id=50283,
  )
  prefixes = ("model.",)
  tied_names = ("decoder.weight",)

  def _layer_types(self, c: Config) -> list[str]:
    L = c.int("num_hidden_layers")
    types = c.raw.get("layer_types")
    if types is None:
      every = c.int("global_attn_every_n_layers")
      types = [SLIDING if i % every else FULL for i in range(L)]
    if not isinstance(types, list) or len(types) != L or any(t not in LAYER_TYPES for t in types):
      raise CheckpointError(
        f"config.json: layer_types must list num_hidden_layers={L} entries of "
        f"{LAYER_TYPES}, got {types!r}"
      )
    return list(types)

  def layer_types(self, config: dict) -> list[str]:
    return self._layer_types(self.read_config(config))

  def _theta(self, c: Config, layer_type: str) -> float:
    _, params = _rope_dicts(c)
    own = (params or {}).get(layer_type) or {}
    default = c["global_rope_theta"] if layer_type == FULL else c["local_rope_theta"]
    theta, scaling = _rope(c, own, default)
    if scaling is not None:
      raise CheckpointError(
        f"config.json: rope_parameters[{layer_type!r}] scales RoPE; not supported for modernbert"
      )
    return theta

  def build(self, config: dict):
    from attnjax._src.nn.config import AttentionConfig, EncoderConfig

    c = self.read_config(config)
    mlm = _heads(c, self.model_type, self.heads)
    if c.raw.get("rope_scaling"):
      raise CheckpointError("config.json: rope_scaling is not supported for modernbert")
    D, N = c.int("hidden_size"), c.int("num_attention_heads")
    if D % N:
      raise CheckpointError(f"config.json: hidden_size={D} is not divisible by {N} heads")
    bias = c.flag("attention_bias")
    window = c.int("local_attention") // 2
    layers = []
    for layer_type in self._layer_types(c):
      layers.append(
        AttentionConfig(
          num_heads=N,
          head_dim=D // N,
          rope_theta=self._theta(c, layer_type),
          qkv_bias=bias,
          out_bias=bias,
          is_causal=False,
          window=window if layer_type == SLIDING else None,
        )
      )
    same = all(a == layers[0] for a in layers)
    return EncoderConfig(
      vocab_size=c.int("vocab_size"),
      d_model=D,
      num_layers=len(layers),
      attention=layers[0],
      layer_attention=None if same else tuple(layers),
      mlp="geglu",
      mlp_dim=c.int("intermediate_size"),
      mlp_activation=_activation(c, "hidden_activation"),
      mlp_bias=c.flag("mlp_bias"),
      norm="layer",
      norm_eps=float(c["norm_eps"]),
      norm_bias=c.flag("norm_bias"),
      norm_placement="pre",
      first_attn_norm=False,
      tie_embeddings=c.flag("tie_word_embeddings"),
      token_types=None,
      embed_norm=True,
      mlm_head=mlm,
      head_activation=_activation(c, "classifier_activation"),
      head_bias=c.flag("classifier_bias"),
      output_bias=c.flag("decoder_bias"),
      pad_token_id=c["pad_token_id"],
    )

  def tensors(self, config: dict, mcfg) -> dict:
    D, V, I, nb = mcfg.d_model, mcfg.vocab_size, mcfg.hidden_dim, mcfg.norm_bias
    rules: dict[Path, Rule] = {
      ("embed", "embedding"): Rule(("embeddings.tok_embeddings.weight",), ((V, D),), _same)
    }
    _norm_rules(rules, ("embed_norm",), "embeddings.norm", D, nb)
    _norm_rules(rules, ("final_norm",), "final_norm", D, nb)
    for i in range(mcfg.num_layers):
      pre, blk = f"layers.{i}.", ("blocks", i)
      a = mcfg.attention_for(i)
      for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        # Wqkv's rows are q, k, v, each [N * H] (heads major), as ours.
        rows = slice(j * D, (j + 1) * D)
        rules[blk + ("attention", proj, "kernel")] = Rule(
          (f"{pre}attn.Wqkv.weight",), ((3 * D, D),), lambda x, r=rows: _transpose(x[r])
        )
        if a.qkv_bias:
          rules[blk + ("attention", proj, "bias")] = Rule(
            (f"{pre}attn.Wqkv.bias",), ((3 * D,),), lambda x, r=rows: np.ascontiguousarray(x[r])
          )
      _linear_rules(rules, blk + ("attention", "o_proj"), f"{pre}attn.Wo", (D, D), a.out_bias)
      if i > 0 or mcfg.first_attn_norm:
        _norm_rules(rules, blk + ("attn_norm",), f"{pre}attn_norm", D, nb)
      _norm_rules(rules, blk + ("mlp_norm",), f"{pre}mlp_norm", D, nb)
      # Wi's rows: the activated half (our gate), then the linear half (our up).
      for j, ours in enumerate(("gate", "up")):
        rows = slice(j * I, (j + 1) * I)
        rules[blk + ("mlp", ours, "kernel")] = Rule(
          (f"{pre}mlp.Wi.weight",), ((2 * I, D),), lambda x, r=rows: _transpose(x[r])
        )
        if mcfg.mlp_bias:
          rules[blk + ("mlp", ours, "bias")] = Rule(
            (f"{pre}mlp.Wi.bias",), ((2 * I,),), lambda x, r=rows: np.ascontiguousarray(x[r])
          )
      _linear_rules(rules, blk + ("mlp", "down"), f"{pre}mlp.Wo", (D, I), mcfg.mlp_bias)
    if mcfg.mlm_head:
      _linear_rules(rules, ("head_dense",), "head.dense", (D, D), mcfg.head_bias)
      _norm_rules(rules, ("head_norm",), "head.norm", D, nb)
      if mcfg.output_bias:
        rules[("output_bias",)] = Rule(("decoder.bias",), ((V,),), _same)
      if not mcfg.tie_embeddings:
        rules[("head", "kernel")] = Rule(("decoder.weight",), ((V, D),), _transpose)
    return rules


# DeepSeek V2 / V3: multi-head latent attention and routed experts.

FP8_BLOCK = (128, 128)


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block=FP8_BLOCK) -> np.ndarray:
  """DeepSeek V3's FP8 weights: ``w [out, in]`` (float8 e4m3) times the scale of its
  ``block`` (``weight_scale_inv [ceil(out / 128), ceil(in / 128)]``), as float32."""
  out, cols = w.shape
  rows, blocks = -(-out // block[0]), -(-cols // block[1])
  if tuple(scale_inv.shape) != (rows, blocks):
    raise CheckpointError(
      f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not tile a weight of shape "
      f"{(out, cols)} in blocks of {tuple(block)} (expected {(rows, blocks)})"
    )
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], 0), block[1], 1)
  return np.asarray(w, np.float32) * scale[:out, :cols]


def _rope_rows(order: np.ndarray, head: int, d_nope: int, d_rope: int):
  """A converter permuting, in each ``head``-row group, the last ``d_rope`` rows by ``order``
  (a weight ``[heads * head, in]``: the rope part's output columns)."""

  def convert(x):
    x = np.asarray(x)
    rows = np.arange(x.shape[0]).reshape(-1, head)
    rows[:, d_nope:] = rows[:, d_nope:][:, order]
    return x[rows.reshape(-1)]

  return convert


def _then(first, second):
  return lambda *a: second(first(*a))


@register
class DeepseekV3(LlamaStyle):
  """DeepSeek V3 / R1: MLA (``q_lora_rank``), sigmoid routing with a choice bias, FP8."""

  model_type = "deepseek_v3"
  known_as = "DeepSeek V3, R1"
  summary = (
    '`family="mla"`, `mlp="moe"` (sigmoid router, groups, shared experts, first dense '
    "layers), FP8 blocks dequantised, MTP layer skipped"
  )
  maps_to = (
    '`family="mla"` (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, '
    "`qk_rope_head_dim`, `v_head_dim`; interleaved RoPE as a permutation of the rope "
    "columns at load; YaRN `mscale_all_dim` in the logit scale), `mlp=\"moe\"` with "
    '`moe_experts="swiglu"`, `moe_router="sigmoid"`, `moe_score_bias` '
    "(`e_score_correction_bias`), `moe_groups`/`moe_group_topk`, `moe_normalize`, "
    "`moe_scale`, `moe_shared_dim`, `moe_first_dense` (`first_k_dense_replace`); FP8 "
    "128x128 blocks (`weight_scale_inv`) dequantised; the MTP layer skipped"
  )
  understood = LlamaStyle.understood | {
    "attention_bias",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "n_shared_experts",
    "routed_scaling_factor",
    "norm_topk_prob",
    "first_k_dense_replace",
    "rope_interleave",
    "num_nextn_predict_layers",
    "topk_method",
    "scoring_func",
    "moe_layer_freq",
    "ep_size",
    "mlp_bias",
  }
  inert = frozenset({"pretraining_tp", "output_router_logits", "aux_loss_alpha", "seq_aux"})
  defaults = dict(
    LlamaStyle.defaults,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=3,
    rope_interleave=True,
    num_nextn_predict_layers=0,
    moe_layer_freq=1,
  )
  quantizations = ("fp8",)
  router = "sigmoid"
  experts_key = "n_routed_experts"

  def skipped(self, config: dict, name: str) -> bool:
    # The multi-token-prediction layers follow the decoder's: transformers never reads them.
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
      return int(parts[1]) >= int(config.get("num_hidden_layers", 0)) or self.ignored(name)
    return self.ignored(name)

  def head_dim(self, c: Config, d_model: int, num_heads: int) -> int:
    return c.int("qk_nope_head_dim") + c.int("qk_rope_head_dim")

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      value = c[key]
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"config.json: {key} must be a positive int, got {value!r}")
    if c.int("qk_rope_head_dim") % 2:
      raise CheckpointError(
        f"config.json: qk_rope_head_dim={c['qk_rope_head_dim']} must be even (RoPE pairs)"
      )
    q_lora = c["q_lora_rank"]
    return dict(
      family="mla",
      q_lora_rank=None if q_lora is None else c.int("q_lora_rank"),
      kv_lora_rank=c.int("kv_lora_rank"),
      qk_nope_head_dim=c.int("qk_nope_head_dim"),
      qk_rope_head_dim=c.int("qk_rope_head_dim"),
      v_head_dim=c.int("v_head_dim"),
    )

  def mlp(self, c: Config) -> dict[str, Any]:
    if _activation(c, self.activation_key) != "silu":
      raise CheckpointError(
        f"config.json: hidden_act={c['hidden_act']!r}: DeepSeek's MLPs are SwiGLU"
      )
    if c.raw.get("mlp_bias"):
      raise CheckpointError("config.json: mlp_bias=true (biased DeepSeek MLPs) is not supported")
    if c["moe_layer_freq"] not in (None, 1):
      raise CheckpointError(f"config.json: moe_layer_freq={c['moe_layer_freq']} is not supported")
    E, shared = c.int(self.experts_key), c["n_shared_experts"]
    return dict(
      mlp="moe",
      mlp_dim=c.int("moe_intermediate_size"),
      dense_mlp_dim=c.int("intermediate_size"),
      num_experts=E,
      experts_per_token=c.int("num_experts_per_tok"),
      moe_experts="swiglu",
      moe_router_bias=False,
      moe_shared_dim=None if not shared else shared * c.int("moe_intermediate_size"),
      moe_first_dense=c.int("first_k_dense_replace"),
      **self.router_options(c, E),
    )

  def router_options(self, c: Config, E: int) -> dict[str, Any]:
    return dict(
      moe_router="sigmoid",
      moe_score_bias=True,
      moe_groups=c.int("n_group"),
      moe_group_topk=c.int("topk_group"),
      moe_normalize=c.flag("norm_topk_prob"),
      moe_scale=float(c["routed_scaling_factor"]),
    )

  def layer_types(self, config: dict) -> list[str]:
    return [FULL] * self.read_config(config).int("num_hidden_layers")

  def interleaved(self, config: dict) -> bool:
    return bool(self.read_config(config)["rope_interleave"])

  def _fp8(self, config: dict) -> bool:
    return self.quant_method(config) == "fp8"

  def _linear(self, config: dict, name: str, shape: tuple, then=None) -> Rule:
    """A ``[out, in]`` weight as our ``[in, out]`` kernel; FP8 blocks dequantised first."""
    after = _transpose if then is None else _then(then, _transpose)
    if not self._fp8(config):
      return Rule((name,), (shape,), after)
    block = tuple((config.get("quantization_config") or {}).get("weight_block_size") or FP8_BLOCK)
    scale = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    dequant = lambda w, s: dequantize_fp8_blocks(w, s, block)
    return Rule((name, name + "_scale_inv"), (shape, scale), _then(dequant, after))

  def attention_tensors(
    self, config: dict, pre: str, path: Path, a, d_model: int
  ) -> dict[Path, Rule]:
    D, N = d_model, a.num_heads
    R, d_n, d_r, d_v = a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    order = np.arange(d_r)
    if self.interleaved(config):
      from attnjax._src.nn.mla_spec import interleave_permutation

      order = interleave_permutation(d_r)
    q_rows = _rope_rows(order, d_n + d_r, d_n, d_r)
    kv_rows = _rope_rows(order, R + d_r, R, d_r)
    rules: dict[Path, Rule] = {}
    if a.q_lora_rank is None:
      rules[path + ("q_proj", "kernel")] = self._linear(
        config, f"{pre}q_proj.weight", (N * (d_n + d_r), D), q_rows
      )
    else:
      r = a.q_lora_rank
      rules[path + ("q_a_proj", "kernel")] = self._linear(config, f"{pre}q_a_proj.weight", (r, D))
      rules[path + ("q_a_norm", "scale")] = Rule((f"{pre}q_a_layernorm.weight",), ((r,),), _same)
      rules[path + ("q_b_proj", "kernel")] = self._linear(
        config, f"{pre}q_b_proj.weight", (N * (d_n + d_r), r), q_rows
      )
      if a.qkv_bias:
        rules[path + ("q_a_proj", "bias")] = Rule((f"{pre}q_a_proj.bias",), ((r,),), _same)
    rules[path + ("kv_a_proj", "kernel")] = self._linear(
      config, f"{pre}kv_a_proj_with_mqa.weight", (R + d_r, D), kv_rows
    )
    if a.qkv_bias:
      rules[path + ("kv_a_proj", "bias")] = Rule(
        (f"{pre}kv_a_proj_with_mqa.bias",), ((R + d_r,),), kv_rows
      )
    rules[path + ("kv_a_norm", "scale")] = Rule((f"{pre}kv_a_layernorm.weight",), ((R,),), _same)
    rules[path + ("kv_b_proj", "kernel")] = self._linear(
      config, f"{pre}kv_b_proj.weight", (N * (d_n + d_v), R)
    )
    rules[path + ("o_proj", "kernel")] = self._linear(config, f"{pre}o_proj.weight", (D, N * d_v))
    if a.out_bias:
      rules[path + ("o_proj", "bias")] = Rule((f"{pre}o_proj.bias",), ((D,),), _same)
    if a.sink_logits:
      rules[path + ("sink_logits",)] = Rule((f"{pre}sinks",), ((N,),), _same)
    return rules

  def mlp_tensors(self, config: dict, pre: str, path: Path, mcfg) -> dict[Path, Rule]:
    layer = int(pre.split(".")[1])
    D = mcfg.d_model
    rules: dict[Path, Rule] = {}

    def swiglu(prefix: str, at: Path, I: int) -> None:
      for proj, ours, shape in (
        ("gate_proj", "gate", (I, D)),
        ("up_proj", "up", (I, D)),
        ("down_proj", "down", (D, I)),
      ):
        rules[at + (ours, "kernel")] = self._linear(config, f"{prefix}{proj}.weight", shape)

    if layer < mcfg.moe_first_dense:
      swiglu(pre, path, mcfg.dense_mlp_dim or mcfg.hidden_dim)
      return rules
    E, I = mcfg.num_experts, mcfg.hidden_dim
    rules[path + ("router", "kernel")] = Rule((f"{pre}gate.weight",), ((E, D),), _transpose)
    if mcfg.moe_score_bias:
      rules[path + ("score_bias",)] = Rule(
        (f"{pre}gate.e_score_correction_bias",), ((E,),), lambda b: np.asarray(b, np.float32)
      )
    for ours, proj, shape in (
      ("gate", "gate_proj", (I, D)),
      ("up", "up_proj", (I, D)),
      ("down", "down_proj", (D, I)),
    ):
      # One rule per expert, stacked into [E, in, out]: sources in expert order.
      each = [self._linear(config, f"{pre}experts.{e}.{proj}.weight", shape) for e in range(E)]
      per = len(each[0].sources)
      rules[path + (ours,)] = Rule(
        tuple(src for r in each for src in r.sources),
        tuple(sh for r in each for sh in r.shapes),
        lambda *xs, convert=each[0].convert, per=per: np.stack(
          [convert(*xs[i : i + per]) for i in range(0, len(xs), per)]
        ),
      )
    if mcfg.moe_shared_dim is not None:
      swiglu(f"{pre}shared_experts.", path + ("shared",), mcfg.moe_shared_dim)
    return rules


@register
class DeepseekV2(DeepseekV3):
  """DeepSeek V2: MLA with the complex RoPE form, softmax routing, no renormalisation."""

  model_type = "deepseek_v2"
  known_as = "DeepSeek V2, V2-Lite"
  summary = (
    '`family="mla"`, `mlp="moe"` (softmax router, greedy or group-limited, shared '
    "experts, first dense layers)"
  )
  maps_to = (
    '`family="mla"` as deepseek_v3 (the complex RoPE form as a permutation of the rope '
    'columns at load), `mlp="moe"` with `moe_router="softmax"` (`greedy`, or '
    "`group_limited_greedy` by group maxima: `moe_groups`/`moe_group_topk`), no "
    "renormalisation, `moe_scale`, `moe_shared_dim`, `moe_first_dense`"
  )
  understood = DeepseekV3.understood - {"rope_interleave", "norm_topk_prob"}
  # transformers' DeepSeek V2 never renormalises (norm_topk_prob).
  inert = DeepseekV3.inert | {"norm_topk_prob"}
  defaults = dict(
    DeepseekV3.defaults,
    q_lora_rank=None,
    topk_method="greedy",
    n_group=None,
    topk_group=None,
    n_shared_experts=None,
    routed_scaling_factor=1.0,
    first_k_dense_replace=0,
  )
  quantizations = ()

  def interleaved(self, config: dict) -> bool:
    return True  # the complex form pairs adjacent dimensions

  def router_options(self, c: Config, E: int) -> dict[str, Any]:
    method = c["topk_method"]
    if method not in ("greedy", "group_limited_greedy"):
      raise CheckpointError(
        f"config.json: topk_method={method!r} is not supported (greedy, group_limited_greedy)"
      )
    grouped = method == "group_limited_greedy"
    return dict(
      moe_router="softmax",
      moe_groups=c.int("n_group") if grouped else 1,
      moe_group_topk=c.int("topk_group") if grouped else None,
      moe_scale=float(c["routed_scaling_factor"]),
    )


# ---------------------------------------------------------------------------
# Hybrids: linear-attention layers beside full ones (Qwen3-Next, Qwen3.5, Kimi Linear).


def _rows(groups: int, width: int, parts: tuple[int, ...], index: int):
  """A converter taking part ``index`` of each of ``groups`` row groups of ``width`` rows cut
  into ``parts`` (Qwen3-Next's ``[q | k | v | z]`` per key head), transposed to ``[in, out]``."""
  start = sum(parts[:index])

  def convert(x):
    x = np.asarray(x).reshape((groups, width) + x.shape[1:])
    return _transpose(np.reshape(x[:, start : start + parts[index]], (-1,) + x.shape[2:]))

  return convert


def _vector_rows(groups: int, width: int, parts: tuple[int, ...], index: int):
  """As :func:`_rows` for a bias (no transpose)."""
  start = sum(parts[:index])

  def convert(x):
    x = np.asarray(x).reshape(groups, width)
    return np.ascontiguousarray(x[:, start : start + parts[index]].reshape(-1))

  return convert


def _conv_taps(start: int, stop: int):
  """A depthwise ``conv1d.weight [C, 1, W]``'s channels ``start:stop`` as our short
  convolution's ``[W, C']``, lag 0 first (torch's last tap multiplies the current token)."""

  def convert(w):
    return np.ascontiguousarray(np.asarray(w)[start:stop, 0, ::-1].T)

  return convert


def _per_expert(pre: str, E: int, I: int, D: int) -> dict[str, Rule]:
  """Experts stored one by one (``experts.{e}.gate_proj.weight [I, D]``, ...; as
  ``save_pretrained`` and the released checkpoints write them), stacked ``[E, in, out]``."""
  rules = {}
  for ours, proj, shape in (
    ("gate", "gate_proj", (I, D)),
    ("up", "up_proj", (I, D)),
    ("down", "down_proj", (D, I)),
  ):
    names = tuple(f"{pre}experts.{e}.{proj}.weight" for e in range(E))
    rules[ours] = Rule(names, (shape,) * E, lambda *xs: np.stack([_transpose(x) for x in xs]))
  return rules


def _zeros(shape: tuple):
  """A parameter the checkpoint implies is zero (a bias transformers' layer does not have)."""
  return lambda: np.zeros(shape, np.float32)


def _positive_int(c: Config, key: str) -> int:
  value = c[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise CheckpointError(f"config.json: {key} must be a positive int, got {value!r}")
  return value


class Hybrid(LlamaStyle):
  """The hybrids' base: layers of ``layer_types`` ``full_attention`` and ``linear_attention``.

  The linear layers are a delta-rule family (``linear_family``) with their own heads and
  dims, no RoPE, and a short convolution; hooks: ``linear_options`` and
  ``linear_tensors``.
  """

  layer_kinds = (FULL, LINEAR)
  linear_prefix: ClassVar[str] = "linear_attn."

  def default_layer_types(self, c: Config, num_layers: int) -> list[str]:
    interval = c.raw.get("full_attention_interval", 4)
    return [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]

  def linear_options(self, c: Config) -> dict[str, Any]:
    raise NotImplementedError

  def layer_rope(self, c: Config, layer_type: str):
    if layer_type == LINEAR:
      return None, None
    theta, scaling, _ = _rope(c, *self.rope_parameters(c, layer_type), partial_ok=True)
    return theta, scaling

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    if layer_type == LINEAR:
      return self.linear_options(c)
    return self.full_options(c)

  def full_options(self, c: Config) -> dict[str, Any]:
    raise NotImplementedError

  def skipped(self, config: dict, name: str) -> bool:
    return name.startswith("mtp.") or self.ignored(name)

  def attention_tensors(self, config, pre, path, a, d_model):
    if a.family in ("gated_deltanet", "kda"):
      return self.linear_tensors(config, pre.replace("self_attn.", self.linear_prefix), path, a)
    return self.full_tensors(config, pre, path, a, d_model)

  def full_tensors(self, config, pre, path, a, d_model):
    return super().attention_tensors(config, pre, path, a, d_model)

  def linear_tensors(self, config, pre, path, a) -> dict[Path, Rule]:
    raise NotImplementedError


@register
class Qwen3Next(Hybrid):
  """Qwen3-Next: gated DeltaNet layers (Hv value heads over Hk query/key heads), gated
  full attention with partial RoPE and ``(1 + w)`` norms, a softmax MoE with a gated shared
  expert."""

  model_type = "qwen3_next"
  known_as = "Qwen3-Next"
  summary = (
    '`gated_deltanet` (value-head grouping) and `qk_norm` + `output_gate` layers, partial '
    'RoPE, `norm="rms_plus_one"`, `mlp="moe"` (softmax router, gated shared expert, '
    "`mlp_only_layers`); MTP skipped"
  )
  maps_to = (
    '`linear_attention` layers: `family="gated_deltanet"` with `value_grouping` '
    "(`linear_num_value_heads` over `linear_num_key_heads`), `value_dim`, `short_conv` "
    "(`in_proj_qkvz` / `in_proj_ba` de-interleaved per key head, conv taps reversed); "
    '`full_attention` layers: `family="qk_norm"` (`(1 + w)` gains), `output_gate='
    '"elementwise"` (the per-head `[query | gate]` halves of `q_proj`), `rope_dim` '
    "(`partial_rotary_factor`); `norm=\"rms_plus_one\"`; `mlp=\"moe\"` with "
    '`moe_router="softmax"`, `moe_normalize` (`norm_topk_prob`), `moe_shared_gate`, '
    "`moe_dense_layers` (`mlp_only_layers`, `decoder_sparse_step`); `mtp.*` skipped"
  )
  understood = LlamaStyle.understood | {
    "attention_bias",
    "layer_types",
    "full_attention_interval",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "decoder_sparse_step",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "num_experts",
    "norm_topk_prob",
    "mlp_only_layers",
  }
  inert = frozenset({"output_router_logits", "router_aux_loss_coef"})
  defaults = dict(
    LlamaStyle.defaults,
    head_dim=256,
    partial_rotary_factor=0.25,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    decoder_sparse_step=1,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts_per_tok=10,
    num_experts=512,
    norm_topk_prob=True,
    mlp_only_layers=[],
  )
  # Separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5) or fused per key head.
  fused_projections: ClassVar[bool] = True

  def full_options(self, c: Config) -> dict[str, Any]:
    H = self.head_dim(c, c.int("hidden_size"), c.int("num_attention_heads"))
    theta, scaling, partial = _rope(c, *self.rope_parameters(c, FULL), partial_ok=True)
    rope_dim = int(H * partial)
    return dict(
      _qk_norm(c, "head", 1.0),
      output_gate="elementwise",
      rope_theta=theta,
      rope_scaling=scaling,
      rope_dim=None if rope_dim == H else rope_dim,
    )

  def linear_options(self, c: Config) -> dict[str, Any]:
    Hk, Hv = _positive_int(c, "linear_num_key_heads"), _positive_int(c, "linear_num_value_heads")
    if Hv % Hk:
      raise CheckpointError(
        f"config.json: linear_num_value_heads={Hv} must be a multiple of "
        f"linear_num_key_heads={Hk} (each key head serves Hv / Hk value heads)"
      )
    W = _positive_int(c, "linear_conv_kernel_dim")
    if W < 2:
      raise CheckpointError(f"config.json: linear_conv_kernel_dim={W} must be at least 2")
    return dict(
      family="gated_deltanet",
      num_heads=Hv,
      num_kv_heads=Hk,
      head_dim=_positive_int(c, "linear_key_head_dim"),
      value_grouping=True,
      value_dim=_positive_int(c, "linear_value_head_dim"),
      short_conv=W,
      output_norm_eps=float(c["rms_norm_eps"]),
      rope_theta=None,
      rope_scaling=None,
      qkv_bias=False,
      out_bias=False,
    )

  def model_options(self, c: Config, d_model: int) -> dict[str, Any]:
    return dict(norm="rms_plus_one", norm_placement="pre")

  def moe_layers(self, c: Config) -> list[bool]:
    """Which layers have the mixture of experts."""
    L, step = c.int("num_hidden_layers"), _positive_int(c, "decoder_sparse_step")
    only = c["mlp_only_layers"] or []
    if not isinstance(only, list) or any(
      isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in only
    ):
      raise CheckpointError(
        f"config.json: mlp_only_layers must list layer indices below num_hidden_layers={L}, "
        f"got {only!r}"
      )
    experts = c["num_experts"] or 0
    return [experts > 0 and i not in only and (i + 1) % step == 0 for i in range(L)]

  def normalize_routing(self, c: Config) -> bool:
    return c.flag("norm_topk_prob")

  def mlp(self, c: Config) -> dict[str, Any]:
    if _activation(c, self.activation_key) != "silu":
      raise CheckpointError(f"config.json: hidden_act={c['hidden_act']!r}: Qwen's MLPs are SwiGLU")
    moe = self.moe_layers(c)
    if not any(moe):
      return dict(mlp="swiglu", mlp_dim=c.int("intermediate_size"))
    shared = c["shared_expert_intermediate_size"] or None
    return dict(
      mlp="moe",
      mlp_dim=c.int("moe_intermediate_size"),
      dense_mlp_dim=c["intermediate_size"],
      num_experts=c.int("num_experts"),
      experts_per_token=c.int("num_experts_per_tok"),
      moe_experts="swiglu",
      moe_router="softmax",
      moe_router_bias=False,
      moe_normalize=self.normalize_routing(c),
      moe_shared_dim=shared,
      moe_shared_gate=shared is not None,
      moe_dense_layers=tuple(i for i, m in enumerate(moe) if not m),
    )

  def full_tensors(self, config, pre, path, a, d_model):
    D, N, K, H = d_model, a.num_heads, a.kv_heads, a.head_dim_for(d_model)
    halves = (H, H)
    rules: dict[Path, Rule] = {
      path + ("q_proj", "kernel"): Rule(
        (f"{pre}q_proj.weight",), ((2 * N * H, D),), _rows(N, 2 * H, halves, 0)
      ),
      path + ("gate_proj", "kernel"): Rule(
        (f"{pre}q_proj.weight",), ((2 * N * H, D),), _rows(N, 2 * H, halves, 1)
      ),
    }
    if a.qkv_bias:
      rules[path + ("q_proj", "bias")] = Rule(
        (f"{pre}q_proj.bias",), ((2 * N * H,),), _vector_rows(N, 2 * H, halves, 0)
      )
      rules[path + ("gate_proj", "bias")] = Rule(
        (f"{pre}q_proj.bias",), ((2 * N * H,),), _vector_rows(N, 2 * H, halves, 1)
      )
    else:  # transformers' gate has no bias: ours is zero
      rules[path + ("gate_proj", "bias")] = Rule((), (), _zeros((N * H,)))
    for proj in ("k_proj", "v_proj"):
      rules[path + (proj, "kernel")] = Rule((f"{pre}{proj}.weight",), ((K * H, D),), _transpose)
      if a.qkv_bias:
        rules[path + (proj, "bias")] = Rule((f"{pre}{proj}.bias",), ((K * H,),), _same)
    rules[path + ("o_proj", "kernel")] = Rule((f"{pre}o_proj.weight",), ((D, N * H),), _transpose)
    if a.out_bias:
      rules[path + ("o_proj", "bias")] = Rule((f"{pre}o_proj.bias",), ((D,),), _same)
    for name in ("q", "k"):
      rules[path + (f"{name}_gain",)] = Rule((f"{pre}{name}_norm.weight",), ((H,),), _same)
    return rules

  def linear_tensors(self, config, pre, path, a) -> dict[Path, Rule]:
    c = self.read_config(config)
    D = c.int("hidden_size")
    Hv, Hk, Dk = a.num_heads, a.kv_heads, a.head_dim
    Dv, W = a.value_dim, a.short_conv
    r = Hv // Hk
    rules = self.linear_inputs(pre, path, D, Hk, Hv, Dk, Dv)
    key, conv = Hk * Dk, 2 * Hk * Dk + Hv * Dv
    for ours, (start, stop) in (
      ("q_conv", (0, key)),
      ("k_conv", (key, 2 * key)),
      ("v_conv", (2 * key, conv)),
    ):
      rules[path + (ours,)] = Rule(
        (f"{pre}conv1d.weight",), ((conv, 1, W),), _conv_taps(start, stop)
      )
    f32 = lambda x: np.asarray(x, np.float32)
    rules[path + ("dt_bias",)] = Rule((f"{pre}dt_bias",), ((Hv,),), f32)
    rules[path + ("A_log",)] = Rule((f"{pre}A_log",), ((Hv,),), f32)
    rules[path + ("out_norm_gain",)] = Rule((f"{pre}norm.weight",), ((Dv,),), _same)
    rules[path + ("o_proj", "kernel")] = Rule(
      (f"{pre}out_proj.weight",), ((D, Hv * Dv),), _transpose
    )
    del r
    return rules

  def linear_inputs(self, pre, path, D, Hk, Hv, Dk, Dv) -> dict[Path, Rule]:
    """The q, k, v, output-gate (z), beta (b) and decay (a) projections."""
    r = Hv // Hk
    qkvz = (Dk, Dk, r * Dv, r * Dv)
    width = sum(qkvz)
    source = ((f"{pre}in_proj_qkvz.weight",), ((Hk * width, D),))
    rules = {
      path + (ours, "kernel"): Rule(*source, _rows(Hk, width, qkvz, i))
      for i, ours in enumerate(("q_proj", "k_proj", "v_proj", "g_proj"))
    }
    ba = ((f"{pre}in_proj_ba.weight",), ((2 * Hv, D),))
    rules[path + ("beta_proj", "kernel")] = Rule(*ba, _rows(Hk, 2 * r, (r, r), 0))
    rules[path + ("dt_proj", "kernel")] = Rule(*ba, _rows(Hk, 2 * r, (r, r), 1))
    return rules

  def mlp_tensors(self, config, pre, path, mcfg) -> dict[Path, Rule]:
    layer = int(pre.split(".")[1])
    D = mcfg.d_model
    if not mcfg.is_moe_layer(layer):
      I = mcfg.dense_mlp_dim or mcfg.hidden_dim
      return self.swiglu_tensors(pre, path, D, I)
    E, I = mcfg.num_experts, mcfg.hidden_dim
    rules: dict[Path, Rule] = {
      path + ("router", "kernel"): Rule((f"{pre}gate.weight",), ((E, D),), _transpose)
    }
    for ours, rule in _per_expert(pre, E, I, D).items():
      rules[path + (ours,)] = rule
    rules.update(self.shared_tensors(pre, path, mcfg))
    return rules

  def shared_tensors(self, pre, path, mcfg) -> dict[Path, Rule]:
    rules = {}
    if mcfg.moe_shared_dim is not None:
      rules.update(
        self.swiglu_tensors(
          f"{pre}shared_expert.", path + ("shared",), mcfg.d_model, mcfg.moe_shared_dim
        )
      )
    if mcfg.moe_shared_gate:
      rules[path + ("shared_gate", "kernel")] = Rule(
        (f"{pre}shared_expert_gate.weight",), ((1, mcfg.d_model),), _transpose
      )
    return rules

  @staticmethod
  def swiglu_tensors(pre: str, path: Path, D: int, I: int) -> dict[Path, Rule]:
    rules = {}
    for proj, ours, shape in (
      ("gate_proj", "gate", (I, D)),
      ("up_proj", "up", (I, D)),
      ("down_proj", "down", (D, I)),
    ):
      rules[path + (ours, "kernel")] = Rule((f"{pre}{proj}.weight",), (shape,), _transpose)
    return rules


@register
class Qwen35Text(Qwen3Next):
  """Qwen3.5's text model: Qwen3-Next's layers with separate linear-attention projections,
  text-position mRoPE (plain RoPE) and a dense SwiGLU MLP."""

  model_type = "qwen3_5_text"
  known_as = "Qwen3.5 (text)"
  summary = "as qwen3_next with separate `in_proj_qkv/z/b/a`, mRoPE as RoPE, dense SwiGLU"
  maps_to = (
    "as qwen3_next: `in_proj_qkv` (`[q | k | v]`), `in_proj_z`, `in_proj_b`, `in_proj_a` "
    "read as they are; mRoPE with text positions is plain RoPE on `rope_dim`; "
    '`mlp="swiglu"`; `mtp.*` skipped'
  )
  understood = LlamaStyle.understood | {
    "attention_bias",
    "layer_types",
    "full_attention_interval",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
  }
  inert = frozenset()
  defaults = dict(Qwen3Next.defaults, num_experts=0)

  def linear_inputs(self, pre, path, D, Hk, Hv, Dk, Dv) -> dict[Path, Rule]:
    qkv = (Hk * Dk, Hk * Dk, Hv * Dv)
    source = ((f"{pre}in_proj_qkv.weight",), ((sum(qkv), D),))
    rules = {
      path + (ours, "kernel"): Rule(*source, _rows(1, sum(qkv), qkv, i))
      for i, ours in enumerate(("q_proj", "k_proj", "v_proj"))
    }
    for ours, theirs, rows in (
      ("g_proj", "z", Hv * Dv),
      ("beta_proj", "b", Hv),
      ("dt_proj", "a", Hv),
    ):
      rules[path + (ours, "kernel")] = Rule(
        (f"{pre}in_proj_{theirs}.weight",), ((rows, D),), _transpose
      )
    return rules


@register
class Qwen35MoeText(Qwen35Text):
  """Qwen3.5 MoE's text model: every layer a softmax MoE that always renormalises."""

  model_type = "qwen3_5_moe_text"
  known_as = "Qwen3.5 MoE (text)"
  summary = "as qwen3_5_text with `mlp=\"moe\"` on every layer (always renormalised)"
  maps_to = (
    'as qwen3_5_text, `mlp="moe"` on every layer: softmax router, `moe_normalize=True` '
    "always (transformers renormalises whatever `norm_topk_prob` says), gated shared expert"
  )
  understood = Qwen35Text.understood | {
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "num_experts",
  }
  # transformers' Qwen3.5 MoE router always renormalises: a norm_topk_prob some configs
  # carry (false or absent) changes nothing, and reading it as false corrupts decoding.
  inert = frozenset({"output_router_logits", "router_aux_loss_coef", "norm_topk_prob"})
  defaults = dict(Qwen3Next.defaults, num_experts=256, num_experts_per_tok=8)

  def normalize_routing(self, c: Config) -> bool:
    return True

  def moe_layers(self, c: Config) -> list[bool]:
    return [True] * c.int("num_hidden_layers")


@register
class Qwen35(Qwen35Text):
  """Qwen3.5's vision-language checkpoint: its text model alone (``model.language_model.*``)."""

  model_type = "qwen3_5"
  known_as = "Qwen3.5 (VLM checkpoint, text model)"
  summary = "the text model (`model.language_model.*`) of a Qwen3.5 VLM, as qwen3_5_text"
  maps_to = (
    "`text_config` loaded as qwen3_5_text from `model.language_model.*`; the vision tower "
    "(`model.visual.*`) is not loaded, which one log line says"
  )
  prefixes = ("model.language_model.", "model.")
  inert_top = frozenset(
    {
      "vision_config",
      "image_token_id",
      "video_token_id",
      "vision_start_token_id",
      "vision_end_token_id",
    }
  )

  def text_config(self, config: dict) -> dict:
    text = config.get("text_config")
    if not isinstance(text, dict):
      raise CheckpointError("config.json: model_type='qwen3_5' needs a text_config object")
    text = dict(text)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return text

  def check_keys(self, config: dict) -> None:
    known = {"text_config"} | self.inert_top | INERT_KEYS | COMMON_KEYS
    unknown = sorted(k for k in config if k not in known)
    if unknown:
      raise CheckpointError(
        f"config.json of model_type='qwen3_5' has keys the loader does not understand: {unknown}"
      )
    super().check_keys(self.text_config(config))

  def read_config(self, config: dict) -> Config:
    return super().read_config(self.text_config(config) if "text_config" in config else config)

  def skipped(self, config: dict, name: str) -> bool:
    return name.startswith(("mtp.", "visual.")) or self.ignored(name)

  def loaded_note(self, config: dict) -> Optional[str]:
    return (
      "qwen3_5 checkpoint: loaded its text model alone (model.language_model.*); the "
      "vision tower (model.visual.*) is not loaded"
    )


@register
class KimiLinear(DeepseekV3):
  """Kimi Linear: KDA layers (per-channel decay, low-rank sigmoid output gate) beside MLA
  layers without RoPE, DeepSeek V3's MoE with fused experts."""

  model_type = "kimi_linear"
  known_as = "Kimi Linear"
  summary = '`kda` and `mla` (no RoPE) layers, `mlp="moe"` as deepseek_v3 (`mlp_layer_types`)'
  maps_to = (
    '`linear_attention` layers: `family="kda"` (`f_a_proj`/`f_b_proj` decay, `dt_bias`, '
    "`A_log`, `short_conv`, `output_gate_activation=\"sigmoid\"` with `output_gate_rank`); "
    '`full_attention` layers: `family="mla"` with `rope_theta=None`; `mlp="moe"` as '
    "deepseek_v3 (sigmoid router, `e_score_correction_bias`, groups, shared experts, fused "
    "`gate_up_proj`), `moe_dense_layers` from `mlp_layer_types`"
  )
  understood = (DeepseekV3.understood - {"rope_interleave", "num_nextn_predict_layers"}) | {
    "layer_types",
    "mlp_layer_types",
    "linear_head_dim",
    "linear_num_heads",
    "linear_conv_kernel_dim",
    "num_local_experts",
    "num_experts",
    "linear_attn_config",
    "qk_head_dim",
  }
  # head_dim: transformers sets it to qk_rope_head_dim and never reads it.
  inert = DeepseekV3.inert | {"model_max_length", "head_dim"}
  defaults = dict(
    DeepseekV3.defaults,
    q_lora_rank=None,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.446,
    rms_norm_eps=1e-5,
    linear_head_dim=128,
    linear_num_heads=32,
    linear_conv_kernel_dim=4,
    num_local_experts=256,
  )
  quantizations = ()
  layer_kinds = (FULL, LINEAR)
  experts_key = "num_local_experts"
  # transformers' KimiLinearConfig.attribute_map: config.json stores the right-hand names.
  aliases: ClassVar[dict[str, str]] = {
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
  }

  def read_config(self, config: dict) -> Config:
    raw = dict(config)
    for ours, stored in self.aliases.items():
      if stored in raw and ours not in raw:
        raw[ours] = raw.pop(stored)
    return super().read_config(raw)

  def check_keys(self, config: dict) -> None:
    raw = dict(config)
    for ours, stored in self.aliases.items():
      if stored in raw:
        raw[ours] = raw.pop(stored)
    super().check_keys(raw)

  def skipped(self, config: dict, name: str) -> bool:
    return self.ignored(name)

  def _layer_types(self, c: Config) -> list[str]:
    if c.raw.get("layer_types") is None:
      raise CheckpointError("config.json: kimi_linear needs layer_types")
    return super()._layer_types(c)

  def layer_types(self, config: dict) -> list[str]:
    # Its own (KDA and MLA layers), not DeepSeek V3's all-full list: attention= targets them.
    return self._layer_types(self.read_config(config))

  def attention_options(self, c: Config, layer_type: str) -> dict[str, Any]:
    if layer_type == FULL:
      return dict(super().attention_options(c, layer_type), rope_theta=None, rope_scaling=None)
    N, H = _positive_int(c, "linear_num_heads"), _positive_int(c, "linear_head_dim")
    W = _positive_int(c, "linear_conv_kernel_dim")
    if W < 2:
      raise CheckpointError(f"config.json: linear_conv_kernel_dim={W} must be at least 2")
    return dict(
      family="kda",
      num_heads=N,
      num_kv_heads=N,
      head_dim=H,
      short_conv=W,
      output_norm_eps=float(c["rms_norm_eps"]),
      output_gate_activation="sigmoid",
      output_gate_rank=H,
      rope_theta=None,
      rope_scaling=None,
      qkv_bias=False,
      out_bias=False,
    )

  def mlp(self, c: Config) -> dict[str, Any]:
    kinds = c.raw.get("mlp_layer_types")
    L = c.int("num_hidden_layers")
    if not isinstance(kinds, list) or len(kinds) != L or set(kinds) - {"dense", "sparse"}:
      raise CheckpointError(
        f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each of the "
        f"num_hidden_layers={L} layers, got {kinds!r}"
      )
    c.raw.setdefault("first_k_dense_replace", 0)
    out = super().mlp(Config(dict(c.raw, first_k_dense_replace=0), c.defaults))
    out["moe_dense_layers"] = tuple(i for i, k in enumerate(kinds) if k == "dense")
    return out

  def attention_tensors(self, config, pre, path, a, d_model):
    if a.family != "kda":
      return super().attention_tensors(config, pre, path, a, d_model)
    D, N, H = d_model, a.num_heads, a.head_dim
    r = H
    rules: dict[Path, Rule] = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
      rules[path + (proj, "kernel")] = Rule((f"{pre}{proj}.weight",), ((N * H, D),), _transpose)
    W = a.short_conv
    for name in ("q", "k", "v"):  # the released layout: one depthwise conv each
      rules[path + (f"{name}_conv",)] = Rule(
        (f"{pre}{name}_conv1d.weight",), ((N * H, 1, W),), _conv_taps(0, N * H)
      )
    f32 = lambda x: np.asarray(x, np.float32).reshape(-1)
    for ours, theirs, shape in (
      (("f_down", "kernel"), "f_a_proj.weight", (H, D)),
      (("f_up", "kernel"), "f_b_proj.weight", (N * H, H)),
      (("beta_proj", "kernel"), "b_proj.weight", (N, D)),
      (("g_down", "kernel"), "g_a_proj.weight", (r, D)),
      (("g_up", "kernel"), "g_b_proj.weight", (N * H, r)),
      (("o_proj", "kernel"), "o_proj.weight", (D, N * H)),
    ):
      rules[path + ours] = Rule((f"{pre}{theirs}",), (shape,), _transpose)
    rules[path + ("dt_bias",)] = Rule((f"{pre}dt_bias",), ((N * H,),), f32)
    rules[path + ("A_log",)] = Rule((f"{pre}A_log",), ((1, 1, N, 1),), f32)
    rules[path + ("out_norm_gain",)] = Rule((f"{pre}o_norm.weight",), ((H,),), _same)
    return rules

  def mlp_tensors(self, config, pre, path, mcfg) -> dict[Path, Rule]:
    layer = int(pre.split(".")[1])
    pre = pre.replace(".mlp.", ".block_sparse_moe.")  # the released checkpoints' names
    D = mcfg.d_model
    if not mcfg.is_moe_layer(layer):
      return Qwen3Next.swiglu_tensors(pre, path, D, mcfg.dense_mlp_dim or mcfg.hidden_dim)
    E, I = mcfg.num_experts, mcfg.hidden_dim
    rules: dict[Path, Rule] = {
      path + ("router", "kernel"): Rule((f"{pre}gate.weight",), ((E, D),), _transpose),
      path + ("score_bias",): Rule(
        (f"{pre}gate.e_score_correction_bias",), ((E,),), lambda b: np.asarray(b, np.float32)
      ),
    }
    for ours, proj, shape in (("gate", "w1", (I, D)), ("up", "w3", (I, D)), ("down", "w2", (D, I))):
      names = tuple(f"{pre}experts.{e}.{proj}.weight" for e in range(E))
      rules[path + (ours,)] = Rule(
        names, (shape,) * E, lambda *xs: np.stack([_transpose(x) for x in xs])
      )
    if mcfg.moe_shared_dim is not None:
      rules.update(
        Qwen3Next.swiglu_tensors(
          f"{pre}shared_experts.", path + ("shared",), D, mcfg.moe_shared_dim
        )
      )
    return rules


# ---------------------------------------------------------------------------
# The registry's views.

SUPPORTED = tuple(ARCHITECTURES)  # the registered model types, in registration order


def architecture(config: dict) -> Architecture:
  """The :class:`Architecture` of a ``config.json`` dict (CheckpointError naming SUPPORTED)."""
  model_type = config.get("model_type")
  if model_type not in ARCHITECTURES:
    raise CheckpointError(
      f"config.json: model_type={model_type!r} is not supported; "
      f"attnjax.models.SUPPORTED = {tuple(ARCHITECTURES)}"
    )
  return ARCHITECTURES[model_type]


def architecture_table(detail: str = "maps_to") -> str:
  """The markdown table of the registered architectures, as the documentation shows it.

  Args:
    detail: ``"maps_to"`` (the guide's table, with ``known_as``) or ``"summary"``
      (the README's).
  """
  if detail not in ("maps_to", "summary"):
    raise ValueError(f"detail must be 'maps_to' or 'summary', got {detail!r}")
  rows = ["| `model_type` | attnjax options it maps to |", "|---|---|"]
  for arch in ARCHITECTURES.values():
    name = f"`{arch.model_type}`"
    if arch.known_as and detail == "maps_to":
      name += f" ({arch.known_as})"
    rows.append(f"| {name} | {getattr(arch, detail)} |")
  return "\n".join(rows) + "\n"
