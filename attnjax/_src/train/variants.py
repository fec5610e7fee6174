"""Named attention variants: the arms of the experiments, as ``attnjax.nn.AttentionConfig`` fields.

Implementation behind the public module :mod:`attnjax.train.variants`.
"""

from __future__ import annotations

import difflib
from typing import Any, Optional

# name -> (AttentionConfig fields, one-line description for reports)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
  "dense": ({"family": "dense"}, "softmax, dot product (baseline)"),
  "qk_layernorm": ({"family": "qk_norm", "qk_norm": "layer"}, "QK LayerNorm (Wortsman/Dehghani)"),
  "qk_rmsnorm": ({"family": "qk_norm", "qk_norm": "rms"}, "QK RMSNorm"),
  "cosine": ({"family": "cosine"}, "cosine similarity x learned temperature"),
  "sigmoid": ({"family": "dense", "normalizer": "sigmoid"}, "sigmoid, bias -log n (Ramapuram)"),
  "softmax_one": ({"family": "dense", "normalizer": "softmax_one"}, "softmax + 1 (Miller)"),
  "softpick": ({"family": "dense", "normalizer": "softpick"}, "softpick (Zuhri)"),
  "relu": ({"family": "dense", "normalizer": "relu"}, "relu(z) / n, ReLU attention (Wortsman)"),
  "clipped_softmax": (
    {"family": "dense", "normalizer": "clipped_softmax"},
    "clipped softmax, zeta 1, gamma -0.025 (Bondarenko)",
  ),
  "sink_logits": (
    {"family": "dense", "sink_logits": True},
    "learned null logit per head (gpt-oss)",
  ),
  "gated": ({"family": "dense", "output_gate": "elementwise"}, "sigmoid output gate (Qiu)"),
  "linear": (
    {"family": "linear", "feature_map": "elu_plus_one", "linear_normalize": "denominator"},
    "elu+1 linear, normalised",
  ),
  "linear_rmsnorm": (
    {"family": "linear", "feature_map": "elu_plus_one", "linear_normalize": "output_rms"},
    "elu+1 linear, output RMS-normalised (Qin)",
  ),
  "window": (
    {"family": "dense", "window": 16},
    "softmax, causal sliding window of 16 (keys i-16..i)",
  ),
  "alibi": ({"family": "dense", "alibi": True}, "softmax, ALiBi biases instead of RoPE (Press)"),
  "linear_unnorm": (
    {"family": "linear", "feature_map": "elu_plus_one", "linear_normalize": "none"},
    "elu+1 linear, unnormalised",
  ),
  "retnet": ({"family": "retnet"}, "RetNet retention, fixed decay per head (Sun)"),
  "mamba2": ({"family": "mamba2_decay"}, "linear, Mamba-2 data-dependent decay (Dao & Gu)"),
  "gla": ({"family": "gla"}, "gated linear attention, gate per key channel (Yang)"),
  "deltanet": ({"family": "deltanet", "short_conv": 4}, "DeltaNet, delta rule (Schlag, Yang)"),
  "gated_deltanet": (
    {"family": "gated_deltanet", "short_conv": 4},
    "Gated DeltaNet, delta rule + decay (Yang)",
  ),
  "block_select": (
    {"family": "block_select", "block_size": 8, "top_k": 2},
    "content-selected blocks: own + top 2 earlier 8-token blocks (MoBA, Lu)",
  ),
  "compressed": (
    {"family": "compressed", "stride": 4, "window": 16},
    "memory-compressed: strided-conv keys (stride 4) + raw window 16 (keys "
    "i-16..i) (Liu, NSA); "
    "its F-Attn is the weight on compressed block 0 (tokens 0-3)",
  ),
  "nsa": (
    {
      "family": "nsa",
      "block_length": 8,
      "stride": 4,
      "selection_block": 8,
      "num_selected": 4,
      "num_initial": 1,
      "num_local": 2,
      "window": 8,
    },
    "Native Sparse Attention: learned compression (l=8, d=4), 4 selected 8-token blocks, "
    "window 8, gated (Yuan)",
  ),
  "dsa": (
    {"family": "dsa", "top_k": 16, "index_heads": 2, "index_head_dim": 8},
    "DeepSeek sparse attention: top 16 keys by a 2-head lightning indexer (KL-trained)",
  ),
  "dilated": (
    {
      "family": "sparse",
      "pattern": ("dilated_window", (("window", 16), ("dilation", 4))),
      "block_size": 16,
    },
    "softmax, dilated window of 16 keys, dilation 4 (Longformer)",
  ),
  "mla": (
    {"family": "mla"},
    "multi-head latent attention: latent of D/2, rope key of H/2, keys H, values H "
    "(DeepSeek V2/V3)",
  ),
}

# The arms of `compare`, the README's main job.
COMPARE = (
  "dense",
  "qk_layernorm",
  "cosine",
  "sigmoid",
  "linear",
  "gated",
  "sink_logits",
  "nsa",
  "dsa",
)

# The gated and delta-rule linear families (attnjax._src.nn.gated_spec): arms of the
# gpu/tpu presets of compare, sinks and lr_sweep. The cpu presets leave them out
# (their documented run times and the README's main job stay as they were); add
# them there with --config.sweep.variants.
GATED = ("retnet", "mamba2", "gla", "deltanet", "gated_deltanet")

# Arms of the gpu/tpu presets of compare and sinks beside GATED; a cpu preset runs them when
# named (--config.sweep.variants=dense,mla).
LATENT = ("mla",)

# Variants designed not to form an attention sink on the first token: a null column
# (softmax_one, sink logits), rows that need not sum to one (sigmoid, softpick) or an output
# gate. The sink checks of compare and sinks hold each to at most half of dense softmax's
# first-token weight.
SINK_FREE = ("softmax_one", "sink_logits", "gated", "sigmoid", "softpick")


def check_variants(
  setting: Any, *, key: str = "sweep.variants", empty_ok: bool = False
) -> list[str]:
  """The variant names of a setting, each checked against ``names()`` (:data:`.VARIANTS`
  and the registered normalisers).

  The one place the experiments check their arms' variant names (compare, sinks, lr_sweep).

  Args:
    setting: comma-separated text (``"dense,qk_layernorm"``) or a sequence of names.
    key: the setting's name, for messages.
    empty_ok: accept an empty setting (an optional list of arms).

  Returns:
    The names, in order.

  Raises:
    ValueError: an unknown name (the message names it, a close known name, and every known
      variant), or an empty setting unless ``empty_ok``.
  """
  items = setting.split(",") if isinstance(setting, str) else list(setting)
  out = [str(n).strip() for n in items if str(n).strip()]
  valid = names()
  known = ", ".join(sorted(valid))
  if not out and not empty_ok:
    raise ValueError(f"{key} is empty: name at least one variant; known variants: {known}")
  for name in out:
    if name not in valid:
      close = difflib.get_close_matches(name, valid, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ValueError(f"{key}: {name!r} is not a variant{hint}; known variants: {known}")
  return out


def names() -> tuple[str, ...]:
  """Every valid variant: the keys of :data:`.VARIANTS`, then each registered normaliser
  (:func:`attnjax.normalizers.names`, the live registry) that is not one of them, as a
  dense arm of its own (``{"family": "dense", "normalizer": name}``)."""
  from attnjax._src import normalizers

  return tuple(VARIANTS) + tuple(n for n in normalizers.names() if n not in VARIANTS)


def _sizes(options: dict[str, Any], d_model: int, num_heads: int) -> dict[str, Any]:
  """MLA's ranks and head dims from the model's: with ``H = d_model / num_heads``, a latent
  of ``d_model / 2``, ``d_n = d_r = H / 2`` (keys of ``H``, as the dense arms') and
  ``d_v = H``; its cache holds ``d_model / 2 + H / 2`` numbers per token, a quarter of the
  ``2 d_model`` of the dense arms' (plus ``H / 2``)."""
  if options.get("family") != "mla":
    return {}
  H = d_model // num_heads
  d_r = 2 * max(1, H // 4)  # even, for RoPE's pairs
  return dict(
    kv_lora_rank=max(1, d_model // 2),
    qk_nope_head_dim=max(1, H - d_r),
    qk_rope_head_dim=d_r,
    v_head_dim=max(1, H),
  )


def attention_kwargs(
  name: str, *, d_model: Optional[int] = None, num_heads: Optional[int] = None
) -> dict[str, Any]:
  """The attention options of a variant (keywords of :class:`attnjax.nn.AttentionConfig`).

  Args:
    name: a key of :data:`.VARIANTS`, or a registered normaliser's name (dense attention
      with that normaliser: a normaliser of one's own is an arm of ``compare`` once
      registered, e.g. by a module the config's ``imports`` names).
    d_model: the model's width; with ``num_heads``, sizes a variant whose sizes follow the
      model's (``mla``: its latent and head dims), which otherwise keeps its family's
      defaults.
    num_heads: the model's query heads.

  Returns:
    A new dict of options.

  Raises:
    ValueError: an unknown variant (the message lists the valid ones).
  """
  if name in VARIANTS:
    options = dict(VARIANTS[name][0])
  elif name in names():
    options = {"family": "dense", "normalizer": name}
  else:
    raise ValueError(
      f"variant={name!r} is not one of: {', '.join(sorted(names()))} (a normaliser of your "
      f"own is a variant once registered: attnjax.normalizers.register, imported through the "
      f"config's imports)"
    )
  if d_model is not None and num_heads is not None:
    options.update(_sizes(options, d_model, num_heads))
  return options


def describe(name: str) -> str:
  """A variant's one-line description for reports (the name itself if unknown)."""
  if name in VARIANTS:
    return VARIANTS[name][1]
  from attnjax._src import normalizers

  nz = normalizers.REGISTRY.get(name)
  return name if nz is None else f"normalizer {name!r}" + (f" ({nz.source})" if nz.source else "")
