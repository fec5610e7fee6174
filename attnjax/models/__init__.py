"""Pretrained checkpoints (Hugging Face format) as the project's own ``nn.TransformerLM``.

:func:`from_pretrained` reads ``config.json`` and ``*.safetensors`` (optionally another
``attention=`` config, or sharded over a ``mesh=`` as it is read) into an
``nn.TransformerLM``; ``SUPPORTED`` lists the ``model_type``s, one registered class each
in :mod:`attnjax.models.architectures`. The tests hold the logits, the per-head sink mass
and greedy generation equal to ``transformers``' eager forward; no torch, no network.
:func:`tokenizer` opens a checkpoint's ``tokenizer.json`` (the optional ``tokenizers``
package).

Guide: :doc:`/guides/models`.
"""

from attnjax._src.models.architectures import ARCHITECTURES, SUPPORTED, dequantize_mxfp4
from attnjax._src.models.checkpoint import Checkpoint, CheckpointError
from attnjax._src.models.loader import from_pretrained, logical_rules, override_attention, tokenizer
from attnjax._src.models.perplexity import token_nll
from attnjax._src.old_names import models as __getattr__  # noqa: F401 (PEP 562)

__all__ = [
  "ARCHITECTURES",
  "Checkpoint",
  "CheckpointError",
  "SUPPORTED",
  "dequantize_mxfp4",
  "from_pretrained",
  "logical_rules",
  "override_attention",
  "token_nll",
  "tokenizer",
]
