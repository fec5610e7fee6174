"""Named attention variants: the arms of the experiments, as ``attnjax.nn.AttentionConfig`` fields.

``config.variant = "cosine"`` selects one; :func:`attention_kwargs` gives the
fields passed to ``AttentionConfig``. Names follow EXPERIMENTS.md.
"""

from __future__ import annotations

from typing import Any

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
    "sink_logits": ({"family": "dense", "sink_logits": True}, "learned null logit per head (gpt-oss)"),
    "gated": ({"family": "dense", "output_gate": "elementwise"}, "sigmoid output gate (Qiu)"),
    "linear": ({"family": "linear", "feature_map": "elu_plus_one",
                "linear_normalize": "denominator"},
               "elu+1 linear, normalised"),
    "linear_rmsnorm": ({"family": "linear", "feature_map": "elu_plus_one",
                        "linear_normalize": "output_rms"}, "elu+1 linear, output RMS-normalised (Qin)"),
    "window": ({"family": "dense", "window": 16}, "softmax, causal sliding window of 16"),
    "alibi": ({"family": "dense", "alibi": True}, "softmax, ALiBi biases instead of RoPE (Press)"),
    "linear_unnorm": ({"family": "linear", "feature_map": "elu_plus_one",
                       "linear_normalize": "none"},
                      "elu+1 linear, unnormalised"),
}

# The arms of `compare`, the README's main job.
COMPARE = ("dense", "qk_layernorm", "cosine", "sigmoid", "linear", "gated", "sink_logits")


def attention_kwargs(name: str) -> dict[str, Any]:
  if name not in VARIANTS:
    raise ValueError(f"variant={name!r} is not one of: {', '.join(sorted(VARIANTS))}")
  return dict(VARIANTS[name][0])


def describe(name: str) -> str:
  return VARIANTS[name][1] if name in VARIANTS else name
