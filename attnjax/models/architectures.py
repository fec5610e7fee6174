"""Each supported ``model_type``: its ``config.json`` as an ``nn.ModelConfig``, its tensors as ours.

An :class:`Architecture` is a small mapping onto the one decoder of
:mod:`attnjax.nn`, not a copy of the transformer: ``build`` reads the config
keys it understands into a :class:`~attnjax.nn.ModelConfig`, ``layer_types``
names each layer's kind (``"full_attention"`` or ``"sliding_attention"``, as
``transformers`` does), and ``tensors`` names, for every parameter, the
checkpoint tensor it comes from, the shape the config implies and how to turn
it into our layout. Every config key is either understood or listed as not
affecting the forward pass; any other key is an error, so nothing that changes
the computation is ignored silently.

:class:`LlamaStyle` is the Llama decoder with hooks (layer types, windows,
RoPE, attention options, biases, MLP, norms, tensor names); each Llama-style
model type is one subclass overriding the hooks where it differs, registered
with :func:`register`. :data:`ARCHITECTURES` and :data:`SUPPORTED` come from
the registry, and so do the documentation's tables (:func:`architecture_table`).
How to add one: ``docs/guides/models.md``.

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

from attnjax._src.models.architectures import (ARCHITECTURES, FULL, GPT2, LAYER_TYPES, SLIDING,
                                               SUPPORTED, Architecture, CheckpointError, Config,
                                               Gemma2, Gemma3Text, GptOss, Llama, LlamaStyle,
                                               Mistral, Olmo2, Qwen2, Qwen3, Rule, architecture,
                                               architecture_table, dequantize_mxfp4, register)

__all__ = ["ARCHITECTURES", "FULL", "GPT2", "LAYER_TYPES", "SLIDING", "SUPPORTED", "Architecture",
    "CheckpointError", "Config", "Gemma2", "Gemma3Text", "GptOss", "Llama", "LlamaStyle",
    "Mistral", "Olmo2", "Qwen2", "Qwen3", "Rule", "architecture", "architecture_table",
    "dequantize_mxfp4", "register"]
