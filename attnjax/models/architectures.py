"""Each supported ``model_type``: its ``config.json`` as an ``nn.ModelConfig``, its tensors as ours.

An :class:`Architecture` maps a checkpoint onto the one decoder of :mod:`attnjax.nn`:
``build`` reads the config keys it understands (any key neither understood nor listed as
not affecting the forward pass is an error), ``layer_types`` names each layer's kind and
``tensors`` where each parameter comes from and how to turn it into our layout.
:class:`LlamaStyle` is the Llama decoder with hooks; each Llama-style model type is one
subclass registered with :func:`register`. :data:`ARCHITECTURES`, :data:`SUPPORTED` and
the documentation's tables (:func:`architecture_table`) come from the registry.

Guide: :doc:`/guides/models` (how to add one; how ``transformers`` conventions map).
"""

from attnjax._src.models.architectures import (
  ARCHITECTURES,
  FULL,
  GPT2,
  LAYER_TYPES,
  SLIDING,
  SUPPORTED,
  Architecture,
  CheckpointError,
  Config,
  Gemma2,
  Gemma3Text,
  GptOss,
  Llama,
  LlamaStyle,
  Mistral,
  Olmo2,
  Qwen2,
  Qwen3,
  Rule,
  architecture,
  architecture_table,
  dequantize_mxfp4,
  register,
)

__all__ = [
  "ARCHITECTURES",
  "FULL",
  "GPT2",
  "LAYER_TYPES",
  "SLIDING",
  "SUPPORTED",
  "Architecture",
  "CheckpointError",
  "Config",
  "Gemma2",
  "Gemma3Text",
  "GptOss",
  "Llama",
  "LlamaStyle",
  "Mistral",
  "Olmo2",
  "Qwen2",
  "Qwen3",
  "Rule",
  "architecture",
  "architecture_table",
  "dequantize_mxfp4",
  "register",
]
