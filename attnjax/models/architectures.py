"""Each supported ``model_type``: its ``config.json`` as an ``nn.ModelConfig``, its tensors as ours.

An :class:`Architecture` is a small mapping onto the one decoder of
:mod:`attnjax.nn`, not a copy of the transformer: ``build`` reads the config
keys it understands into a :class:`~attnjax.nn.ModelConfig`, ``tensors`` names,
for every parameter of that model, the checkpoint tensor it comes from, the
shape the config implies for that tensor and how to turn it into our layout
(``nn.Linear``'s ``[out, in]`` transposed to our ``[in, out]``, GPT-2's
``Conv1D`` ``[in, 3 out]`` split into q, k, v, gpt-oss's interleaved gate/up
experts split, MXFP4 experts dequantised). Every config key is either
understood or listed as not affecting the forward pass; any other key is an
error, so nothing that changes the computation is ignored silently.

The reference for each architecture is Hugging Face ``transformers`` (its
``modeling_<type>.py``); how they map:

- RoPE: ``transformers``' ``rotate_half`` pairs dimension ``d`` with ``d + H/2``,
  as :func:`attnjax.nn.apply_rope` does, so q/k weights load as they are;
  ``rope_parameters`` (or the older ``rope_theta`` + ``rope_scaling``) become
  ``rope_theta`` / ``rope_scaling`` per layer.
- Sliding windows: ``transformers`` lets query ``i`` see keys ``j > i - W``
  (``W`` keys, itself included): attnjax's ``window = W - 1``.
- Norm weights: Gemma's ``(1 + w)`` RMSNorm is the norm kind ``"rms_plus_one"``
  (and ``qk_norm_gain_offset=1`` for its QK norm), so ``w`` loads as stored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from attnjax.models.checkpoint import CheckpointError

# A parameter's path in nnx.to_pure_dict(state), e.g. ("blocks", 0, "mlp", "up", "kernel").
Path = tuple

# Config keys of every model type that do not change the forward pass of a causal LM.
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
    "dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "attention_dropout", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "_attn_implementation",
    "attn_implementation", "_attn_implementation_autoset", "_experts_implementation",
    "is_decoder", "is_encoder_decoder", "tie_encoder_decoder", "cross_attention_hidden_size",
    "max_position_embeddings", "gradient_checkpointing",
    # generation settings older versions of transformers kept in config.json
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})

# Understood by every model type (checked by the loader itself).
COMMON_KEYS = frozenset({"tie_word_embeddings", "pruned_heads", "add_cross_attention",
                         "quantization_config"})

ACTIVATIONS = {  # transformers' ACT2FN names -> ours
    "silu": "silu", "swish": "silu",
    "gelu": "gelu_exact",
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
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


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One ``model_type``.

  Attributes:
    model_type: ``config.json``'s ``model_type``.
    understood: the config keys ``build`` reads.
    inert: keys of this type known not to change the forward pass (besides
      ``INERT_KEYS``).
    build: ``config dict -> nn.ModelConfig``.
    tensors: ``(config dict, nn.ModelConfig) -> {our path: Rule}``.
    prefixes: leading parts tensor names may carry (``"model."``), stripped.
    ignored: ``name -> bool``: checkpoint tensors that are not parameters
      (buffers older versions saved) and are skipped.
  """

  model_type: str
  understood: frozenset
  inert: frozenset
  build: Callable[[dict], Any]
  tensors: Callable[[dict, Any], dict]
  prefixes: tuple[str, ...]
  ignored: Callable[[str], bool] = lambda name: False

  def check_keys(self, config: dict) -> None:
    """Raises naming every config key neither understood nor known to be inert."""
    known = self.understood | self.inert | INERT_KEYS | COMMON_KEYS
    unknown = sorted(k for k in config if k not in known)
    if unknown:
      raise CheckpointError(
          f"config.json of model_type={self.model_type!r} has keys the loader does not "
          f"understand: {unknown}. They may change the computation, so the model is not "
          f"built; if a key is known not to affect the forward pass, remove it from config.json")


# ---------------------------------------------------------------------------
# Reading the config.


class _Config:
  """``config.json`` with the defaults of ``transformers``' config class of its type."""

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


def _activation(c: _Config, key: str) -> str:
  name = c[key]
  if name not in ACTIVATIONS:
    raise CheckpointError(f"config.json: {key}={name!r} is not supported (supported: "
                          f"{sorted(ACTIVATIONS)})")
  return ACTIVATIONS[name]


def _rope_parameters(c: _Config, style: "_Style", layer_type: str) -> tuple[dict, float]:
  """``(parameters, default rope_theta)`` of one layer type, as ``transformers`` reads them.

  ``rope_scaling`` (older configs) wins over ``rope_parameters``, which may be
  nested by layer type (Gemma 3). Gemma 3's older configs scale only the full
  attention layers and give the sliding ones their own base
  (``rope_local_base_freq``).
  """
  scaling, params = c.raw.get("rope_scaling"), c.raw.get("rope_parameters")
  for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
    if value is not None and not isinstance(value, dict):
      raise CheckpointError(f"config.json: {name} must be an object, got {value!r}")
  if isinstance(style.default_theta, dict):  # gemma3_text
    local = layer_type == "sliding_attention"
    nested = params if params and any(isinstance(v, dict) for v in params.values()) else {}
    if local:
      default = c.raw.get("rope_local_base_freq", style.default_theta["local"])
      return dict(nested.get(layer_type) or {}), default
    default = c.raw.get("rope_theta", style.default_theta["global"])
    chosen = dict(nested.get(layer_type) or {})
    if scaling is not None:
      chosen.update(scaling)
    return chosen, default
  chosen = scaling or params or style.defaults.get("rope_parameters") or {}
  return dict(chosen), c.raw.get("rope_theta", style.default_theta)


def _rope(c: _Config, params: dict, default_theta: float):
  """``(rope_theta, rope_scaling)`` of standardised RoPE ``params``."""
  params = dict(params)
  theta = params.pop("rope_theta", None)
  theta = default_theta if theta is None else theta
  kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  partial = params.pop("partial_rotary_factor", c.raw.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise CheckpointError(f"config.json: partial_rotary_factor={partial} (RoPE on part of the "
                          f"head) is not supported for model_type={c.raw.get('model_type')!r}")
  if kind == "default":
    if params:
      raise CheckpointError(f"config.json: RoPE parameters {sorted(params)} of rope_type "
                            f"'default' are not understood")
    return float(theta), None
  if kind not in ("linear", "llama3", "yarn"):
    raise CheckpointError(f"config.json: rope_type={kind!r} is not supported (supported: "
                          f"default, linear, llama3, yarn)")
  if kind in ("llama3", "yarn"):
    params.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
  if kind == "yarn" and params.get("factor") is None:
    params["factor"] = c["max_position_embeddings"] / params["original_max_position_embeddings"]
  from attnjax.nn import rope as rope_lib

  try:
    scaling = rope_lib.normalize_scaling(dict(params, type=kind))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"config.json: {e}") from None
  return float(theta), scaling


def _check_common(c: _Config) -> None:
  if c.raw.get("add_cross_attention"):
    raise CheckpointError("config.json: add_cross_attention=true (an encoder-decoder "
                          "cross-attention) is not supported")
  if c.raw.get("pruned_heads"):
    raise CheckpointError(f"config.json: pruned_heads={c.raw['pruned_heads']} (pruned "
                          f"attention heads) is not supported")


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


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


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


# ---------------------------------------------------------------------------
# Llama-style decoders (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, olmo2, gpt_oss).


@dataclasses.dataclass(frozen=True)
class _Style:
  """What distinguishes one Llama-style model type from another."""

  defaults: dict
  bias: str = "config"            # "config" (attention_bias), "qkv" (Qwen 2), "none"
  mlp_bias_key: bool = False      # Llama's mlp_bias
  activation_key: str = "hidden_act"
  qk_norm: Optional[str] = None   # None, "head", "head_plus_one" (Gemma 3), "projection"
  gemma: bool = False             # (1 + w) norms, sandwich norms, sqrt(D) embedding scale, softcaps
  placement: str = "pre"
  windows: str = "none"           # "none", "all" (Mistral), "layer_types"
  qwen_windows: bool = False      # sliding_window only with use_sliding_window
  head_dim_key: bool = True
  default_theta: Any = 10000.0
  moe: bool = False


def _layer_types(c: _Config, style: _Style) -> list[str]:
  L = c.int("num_hidden_layers")
  types = c.raw.get("layer_types")
  if types is None:
    if style.qwen_windows:
      window = c["sliding_window"] if c.flag("use_sliding_window") else None
      types = ["sliding_attention" if window is not None and i >= c.int("max_window_layers")
               else "full_attention" for i in range(L)]
    elif style.gemma and c.raw.get("model_type") == "gemma3_text":
      pattern = c.raw.get("sliding_window_pattern", c.raw.get("_sliding_window_pattern", 6))
      types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    elif style.windows == "layer_types":  # gemma2, gpt_oss: alternate, sliding first
      types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    else:
      types = ["full_attention"] * L
  if not isinstance(types, list) or len(types) != L:
    raise CheckpointError(f"config.json: layer_types must list num_hidden_layers={L} entries, "
                          f"got {types!r}")
  for t in types:
    if t not in ("sliding_attention", "full_attention"):
      raise CheckpointError(f"config.json: layer_types entry {t!r} is not supported "
                            f"(supported: sliding_attention, full_attention)")
  return types


def _window(c: _Config, style: _Style, layer_type: str) -> Optional[int]:
  """attnjax's ``window`` (``W - 1``) of a layer, from ``transformers``' ``sliding_window`` W."""
  if style.windows == "none":
    return None
  W = c["sliding_window"]
  if style.qwen_windows and not c.flag("use_sliding_window"):
    W = None
  if style.windows == "layer_types" and layer_type != "sliding_attention":
    return None
  if W is None:
    return None
  if isinstance(W, bool) or not isinstance(W, int) or W < 1:
    raise CheckpointError(f"config.json: sliding_window must be a positive int, got {W!r}")
  return W - 1


def _build_llama_style(style: _Style):
  def build(raw: dict):
    from attnjax import nn

    c = _Config(raw, style.defaults)
    _check_common(c)
    D, N = c.int("hidden_size"), c.int("num_attention_heads")
    K = c["num_key_value_heads"] or N
    H = (c["head_dim"] if style.head_dim_key else None) or D // N
    if c.raw.get("rope_interleaved"):
      raise CheckpointError("config.json: rope_interleaved=true (RoPE on interleaved pairs) is "
                            "not how transformers computes this model; not supported")
    if c.raw.get("use_bidirectional_attention"):
      raise CheckpointError("config.json: use_bidirectional_attention=true (an encoder) is not "
                            "supported; a causal language model is loaded")
    activation = _activation(c, style.activation_key)
    eps = float(c["rms_norm_eps"])
    qkv_bias = out_bias = False
    if style.bias == "config":
      qkv_bias = out_bias = c.flag("attention_bias")
    elif style.bias == "qkv":
      qkv_bias = True
    types = _layer_types(c, style)
    layers = []
    for i, layer_type in enumerate(types):
      theta, scaling = _rope(c, *_rope_parameters(c, style, layer_type))
      options: dict[str, Any] = {}
      window = _window(c, style, layer_type)
      if window is not None:
        options["window"] = window
      family = "dense"
      if style.qk_norm is not None:
        family = "qk_norm"
        options.update(qk_norm="rms", qk_norm_eps=eps, qk_norm_gain=True,
                       qk_norm_placement="before_rope",
                       qk_norm_scope="projection" if style.qk_norm == "projection" else "head",
                       qk_norm_gain_offset=1.0 if style.qk_norm == "head_plus_one" else 0.0)
      if style.gemma:
        scale = float(c["query_pre_attn_scalar"]) ** -0.5
        options["qk_scale" if family == "qk_norm" else "scale"] = scale
        if c["attn_logit_softcapping"] is not None:
          options["softcap"] = float(c["attn_logit_softcapping"])
      if style.moe:
        options["sink_logits"] = True
      layers.append(nn.AttentionConfig(family, num_heads=N, num_kv_heads=K, head_dim=H,
                                       rope_theta=theta, rope_scaling=scaling, qkv_bias=qkv_bias,
                                       out_bias=out_bias, **options))
    mlp: dict[str, Any] = dict(mlp_dim=c.int("intermediate_size"))
    if style.moe:
      mlp.update(mlp="moe", num_experts=c.int("num_local_experts"),
                 experts_per_token=c.int("num_experts_per_tok"),
                 moe_alpha=float(c["swiglu_alpha"]),
                 moe_limit=None if c["swiglu_limit"] is None else float(c["swiglu_limit"]))
    elif activation == "silu":
      mlp.update(mlp="swiglu")
    else:
      mlp.update(mlp="geglu", mlp_activation=activation)
    if style.mlp_bias_key:
      mlp["mlp_bias"] = c.flag("mlp_bias")
    extra: dict[str, Any] = {}
    if style.gemma:
      extra["embed_scale"] = float(D) ** 0.5
      if c["final_logit_softcapping"] is not None:
        extra["final_softcap"] = float(c["final_logit_softcapping"])
    same = all(a == layers[0] for a in layers)
    return nn.ModelConfig(
        vocab_size=c.int("vocab_size"), d_model=D, num_layers=len(layers), attention=layers[0],
        layer_attention=None if same else tuple(layers),
        norm="rms_plus_one" if style.gemma else "rms", norm_eps=eps,
        norm_placement=style.placement, tie_embeddings=c.flag("tie_word_embeddings"),
        **mlp, **extra)

  return build


def _llama_style_tensors(style: _Style):
  def tensors(raw: dict, mcfg) -> dict:
    D, V = mcfg.d_model, mcfg.vocab_size
    rules: dict[Path, Rule] = {
        ("embed", "embedding"): Rule(("embed_tokens.weight",), ((V, D),), _same),
        ("final_norm", "scale"): Rule(("norm.weight",), ((D,),), _same),
    }
    if not mcfg.tie_embeddings:
      rules[("head", "kernel")] = Rule(("lm_head.weight",), ((V, D),), _transpose)
    quantized = _mxfp4(raw)
    for i in range(mcfg.num_layers):
      a = mcfg.attention_for(i)
      N, K, H = a.num_heads, a.kv_heads, a.head_dim_for(D)
      pre, blk = f"layers.{i}.", ("blocks", i)
      attn = pre + "self_attn."
      for proj, rows in (("q_proj", N * H), ("k_proj", K * H), ("v_proj", K * H)):
        rules[blk + ("attention", proj, "kernel")] = Rule(
            (f"{attn}{proj}.weight",), ((rows, D),), _transpose)
        if a.qkv_bias:
          rules[blk + ("attention", proj, "bias")] = Rule((f"{attn}{proj}.bias",), ((rows,),),
                                                          _same)
      rules[blk + ("attention", "o_proj", "kernel")] = Rule(
          (f"{attn}o_proj.weight",), ((D, N * H),), _transpose)
      if a.out_bias:
        rules[blk + ("attention", "o_proj", "bias")] = Rule((f"{attn}o_proj.bias",), ((D,),),
                                                            _same)
      if a.family == "qk_norm":
        projection = a.qk_norm_scope == "projection"
        for name, heads in (("q", N), ("k", K)):
          rules[blk + ("attention", f"{name}_gain")] = Rule(
              (f"{attn}{name}_norm.weight",), ((heads * H if projection else H,),), _same)
      if a.sink_logits:
        rules[blk + ("attention", "sink_logits")] = Rule((f"{attn}sinks",), ((N,),), _same)
      norms = {"pre": (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")),
               "sandwich": (("attn_norm", "input_layernorm"),
                            ("attn_post_norm", "post_attention_layernorm"),
                            ("mlp_norm", "pre_feedforward_layernorm"),
                            ("mlp_post_norm", "post_feedforward_layernorm")),
               "post": (("attn_post_norm", "post_attention_layernorm"),
                        ("mlp_post_norm", "post_feedforward_layernorm"))}[mcfg.norm_placement]
      for ours, theirs in norms:
        rules[blk + (ours, "scale")] = Rule((f"{pre}{theirs}.weight",), ((D,),), _same)
      I = mcfg.hidden_dim
      if mcfg.mlp == "moe":
        rules.update(_moe_rules(pre, blk, mcfg, quantized))
        continue
      for proj, ours, shape in (("gate_proj", "gate", (I, D)), ("up_proj", "up", (I, D)),
                                ("down_proj", "down", (D, I))):
        rules[blk + ("mlp", ours, "kernel")] = Rule((f"{pre}mlp.{proj}.weight",), (shape,),
                                                    _transpose)
        if mcfg.mlp_bias:
          rules[blk + ("mlp", ours, "bias")] = Rule((f"{pre}mlp.{proj}.bias",), ((shape[0],),),
                                                    _same)
    return rules

  return tensors


def _mxfp4(raw: dict) -> bool:
  q = raw.get("quantization_config")
  if q is None:
    return False
  method = q.get("quant_method") if isinstance(q, dict) else None
  if method != "mxfp4" or raw.get("model_type") != "gpt_oss":
    raise CheckpointError(f"config.json: quantization_config with quant_method={method!r} is "
                          f"not supported (only gpt-oss's mxfp4 experts are dequantised)")
  return True


def _moe_rules(pre: str, blk: tuple, mcfg, quantized: bool) -> dict:
  E, D, I = mcfg.num_experts, mcfg.d_model, mcfg.hidden_dim
  ex = f"{pre}mlp.experts."
  rules = {
      blk + ("mlp", "router", "kernel"): Rule((f"{pre}mlp.router.weight",), ((E, D),), _transpose),
      blk + ("mlp", "router", "bias"): Rule((f"{pre}mlp.router.bias",), ((E,),), _same),
      blk + ("mlp", "gate_bias"): Rule((f"{ex}gate_up_proj_bias",), ((E, 2 * I),), _every_other(0)),
      blk + ("mlp", "up_bias"): Rule((f"{ex}gate_up_proj_bias",), ((E, 2 * I),), _every_other(1)),
      blk + ("mlp", "down_bias"): Rule((f"{ex}down_proj_bias",), ((E, D),), _same),
  }
  if not quantized:
    rules[blk + ("mlp", "gate")] = Rule((f"{ex}gate_up_proj",), ((E, D, 2 * I),), _every_other(0))
    rules[blk + ("mlp", "up")] = Rule((f"{ex}gate_up_proj",), ((E, D, 2 * I),), _every_other(1))
    rules[blk + ("mlp", "down")] = Rule((f"{ex}down_proj",), ((E, I, D),), _same)
    return rules
  if D % 32 or I % 32:
    raise CheckpointError(f"config.json: mxfp4 experts need hidden_size={D} and "
                          f"intermediate_size={I} to be multiples of 32")
  gate_up = ((f"{ex}gate_up_proj_blocks", f"{ex}gate_up_proj_scales"),
             ((E, 2 * I, D // 32, 16), (E, 2 * I, D // 32)))
  down = ((f"{ex}down_proj_blocks", f"{ex}down_proj_scales"),
          ((E, D, I // 32, 16), (E, D, I // 32)))
  rules[blk + ("mlp", "gate")] = Rule(*gate_up,
                                      lambda b, s: _every_other(0)(dequantize_mxfp4(b, s)))
  rules[blk + ("mlp", "up")] = Rule(*gate_up,
                                    lambda b, s: _every_other(1)(dequantize_mxfp4(b, s)))
  rules[blk + ("mlp", "down")] = Rule(*down, dequantize_mxfp4)
  return rules


_LLAMA_KEYS = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                         "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                         "partial_rotary_factor"})
_QWEN_WINDOW_KEYS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                               "layer_types"})


def _llama_style(model_type: str, style: _Style, understood: set, inert: set = frozenset()):
  return Architecture(
      model_type=model_type, understood=frozenset(_LLAMA_KEYS | understood),
      inert=frozenset(inert), build=_build_llama_style(style),
      tensors=_llama_style_tensors(style), prefixes=("model.",),
      ignored=lambda name: name.endswith("rotary_emb.inv_freq"))


_LLAMA_DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, max_position_embeddings=2048)

ARCHITECTURES: dict[str, Architecture] = {}


def _register(arch: Architecture) -> None:
  ARCHITECTURES[arch.model_type] = arch


# pretraining_tp sliced Llama 2's matmuls (the same sums); SmolLM's configs carry nanotron's
# is_llama_config and rope_interleaved, which transformers does not read (false: checked).
_register(_llama_style("llama", _Style(defaults=_LLAMA_DEFAULTS, mlp_bias_key=True),
                       {"attention_bias", "mlp_bias", "rope_interleaved"},
                       {"pretraining_tp", "is_llama_config"}))
_register(_llama_style(
    "mistral", _Style(defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=4096 * 32,
                                    num_key_value_heads=8, sliding_window=4096),
                      bias="none", windows="all"),
    {"sliding_window"}))
_register(_llama_style(
    "qwen2", _Style(defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=32768,
                                  use_sliding_window=False, sliding_window=4096,
                                  max_window_layers=28),
                    bias="qkv", windows="layer_types", qwen_windows=True),
    set(_QWEN_WINDOW_KEYS)))
_register(_llama_style(
    "qwen3", _Style(defaults=dict(_LLAMA_DEFAULTS, max_position_embeddings=32768, head_dim=128,
                                  use_sliding_window=False, sliding_window=4096,
                                  max_window_layers=28),
                    qk_norm="head", windows="layer_types", qwen_windows=True),
    set(_QWEN_WINDOW_KEYS) | {"attention_bias"}))
_GEMMA_KEYS = {"attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
               "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
               "use_bidirectional_attention"}
# Gemma's modelling reads hidden_activation; older configs also carry an unused hidden_act.
_GEMMA_INERT = {"hidden_act", "cache_implementation", "sliding_window_size"}
_register(_llama_style(
    "gemma2", _Style(defaults=dict(_LLAMA_DEFAULTS, hidden_activation="gelu_pytorch_tanh",
                                   tie_word_embeddings=True, head_dim=256,
                                   query_pre_attn_scalar=256, sliding_window=4096,
                                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                   max_position_embeddings=8192),
                     activation_key="hidden_activation", gemma=True, placement="sandwich",
                     windows="layer_types"),
    _GEMMA_KEYS, _GEMMA_INERT))
_register(_llama_style(
    "gemma3_text", _Style(defaults=dict(_LLAMA_DEFAULTS, hidden_activation="gelu_pytorch_tanh",
                                        tie_word_embeddings=True, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=4096,
                                        final_logit_softcapping=None,
                                        attn_logit_softcapping=None,
                                        max_position_embeddings=131072),
                          activation_key="hidden_activation", gemma=True, placement="sandwich",
                          windows="layer_types", qk_norm="head_plus_one",
                          default_theta={"global": 1_000_000.0, "local": 10_000.0}),
    _GEMMA_KEYS | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
    _GEMMA_INERT))
_register(_llama_style(
    "olmo2", _Style(defaults=dict(_LLAMA_DEFAULTS, rms_norm_eps=1e-5), qk_norm="projection",
                    placement="post", head_dim_key=False),
    {"attention_bias"}))
_register(_llama_style(
    "gpt_oss", _Style(defaults=dict(_LLAMA_DEFAULTS, rms_norm_eps=1e-5, attention_bias=True,
                                    head_dim=64, sliding_window=128, num_local_experts=128,
                                    num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                                    max_position_embeddings=131072,
                                    rope_parameters=dict(rope_type="yarn", factor=32.0,
                                                         beta_fast=32.0, beta_slow=1.0,
                                                         truncate=False,
                                                         original_max_position_embeddings=4096)),
                      windows="layer_types", moe=True, default_theta=150000.0),
    {"attention_bias", "sliding_window", "layer_types", "num_local_experts",
     "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"},
    # gpt-oss's own names beside transformers' (experts_per_token), the router's training loss.
    {"router_aux_loss_coef", "output_router_logits", "experts_per_token",
     "initial_context_length"}))


# ---------------------------------------------------------------------------
# GPT-2.


_GPT2_DEFAULTS = dict(n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                      activation_function="gelu_new", layer_norm_epsilon=1e-5,
                      scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                      tie_word_embeddings=True)


def _build_gpt2(raw: dict):
  from attnjax import nn

  c = _Config(raw, _GPT2_DEFAULTS)
  _check_common(c)
  D, N, L = c.int("n_embd"), c.int("n_head"), c.int("n_layer")
  if D % N:
    raise CheckpointError(f"config.json: n_embd={D} is not divisible by n_head={N}")
  H = D // N
  activation = _activation(c, "activation_function")
  if activation == "silu":
    raise CheckpointError("config.json: activation_function='silu' is not supported for gpt2 "
                          "(its MLP is ungated)")
  layers = []
  for i in range(L):
    scale = H ** -0.5 if c.flag("scale_attn_weights") else 1.0
    if c.flag("scale_attn_by_inverse_layer_idx"):
      scale /= float(i + 1)
    layers.append(nn.AttentionConfig(num_heads=N, head_dim=H, rope_theta=None, qkv_bias=True,
                                     out_bias=True, scale=None if scale == H ** -0.5 else scale))
  same = all(a == layers[0] for a in layers)
  return nn.ModelConfig(
      vocab_size=c.int("vocab_size"), d_model=D, num_layers=L, attention=layers[0],
      layer_attention=None if same else tuple(layers), mlp="gelu",
      mlp_dim=c["n_inner"] or 4 * D, mlp_activation=activation, mlp_bias=True, norm="layer",
      norm_eps=float(c["layer_norm_epsilon"]), tie_embeddings=c.flag("tie_word_embeddings"),
      learned_positions=c.int("n_positions"))


def _gpt2_tensors(raw: dict, mcfg) -> dict:
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
      rules[blk + ("attention", proj, "kernel")] = Rule((f"{pre}attn.c_attn.weight",),
                                                        ((D, 3 * D),), cols)
      rules[blk + ("attention", proj, "bias")] = Rule((f"{pre}attn.c_attn.bias",), ((3 * D,),),
                                                      cols)
    for ours, theirs, shape in ((("attention", "o_proj"), "attn.c_proj", (D, D)),
                                (("mlp", "up"), "mlp.c_fc", (D, I)),
                                (("mlp", "down"), "mlp.c_proj", (I, D))):
      rules[blk + ours + ("kernel",)] = Rule((f"{pre}{theirs}.weight",), (shape,), _same)
      rules[blk + ours + ("bias",)] = Rule((f"{pre}{theirs}.bias",), ((shape[1],),), _same)
  return rules


def _gpt2_buffer(name: str) -> bool:
  # The causal-mask buffers older versions saved with each attention layer.
  return name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")


_register(Architecture(
    model_type="gpt2",
    understood=frozenset({"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                          "activation_function", "layer_norm_epsilon", "scale_attn_weights",
                          "scale_attn_by_inverse_layer_idx"}),
    # reorder_and_upcast_attn computes the same logits in float32 (a precision choice);
    # summary_* configure the multiple-choice head of GPT2DoubleHeadsModel.
    inert=frozenset({"n_ctx", "resid_pdrop", "embd_pdrop", "attn_pdrop", "reorder_and_upcast_attn",
                     "summary_type", "summary_use_proj", "summary_activation",
                     "summary_proj_to_labels", "summary_first_dropout"}),
    build=_build_gpt2, tensors=_gpt2_tensors, prefixes=("transformer.",), ignored=_gpt2_buffer))


SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2",
             "gpt_oss")
assert set(SUPPORTED) == set(ARCHITECTURES)


def architecture(config: dict) -> Architecture:
  """The :class:`Architecture` of a ``config.json`` dict (CheckpointError naming SUPPORTED)."""
  model_type = config.get("model_type")
  if model_type not in ARCHITECTURES:
    raise CheckpointError(f"config.json: model_type={model_type!r} is not supported; "
                          f"attnjax.models.SUPPORTED = {SUPPORTED}")
  return ARCHITECTURES[model_type]


__all__ = ["ARCHITECTURES", "Architecture", "CheckpointError", "Rule", "SUPPORTED",
           "architecture", "dequantize_mxfp4"]
