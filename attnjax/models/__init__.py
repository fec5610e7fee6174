"""Pretrained checkpoints (Hugging Face format) as the project's own ``nn.TransformerLM``.

::

  from attnjax import models, nn

  model = models.from_pretrained("path/to/checkpoint")          # config.json + *.safetensors
  logits = model(tokens)                                        # [B, T, V] float32
  stats = nn.layer_stats(model, tokens, view="sown")            # per-layer AttentionStats
  model = models.from_pretrained(path, attention={"implementation": "blockwise"})
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
  model = models.from_pretrained(path, mesh=mesh)             # sharded as it is read

``SUPPORTED`` lists the ``model_type``s, one registered class each in
``attnjax.models.architectures`` (``ARCHITECTURES``): a mapping of its
``config.json`` and tensor names onto the one decoder of :mod:`attnjax.nn`.
The reference for each is ``transformers``, whose eager forward the tests
hold the logits, the per-head sink mass and greedy generation equal to. No
torch, no network.

:func:`tokenizer` opens a checkpoint's ``tokenizer.json`` with the optional
``tokenizers`` package; ``attnjax.nn.layer_stats(model, tokens, view="streaming")``
measures sink statistics of long sequences in O(T) memory and
:func:`attnjax.models.probe.token_nll` their perplexity (``experiments/pretrained.py``).
"""

from attnjax.models import probe
from attnjax._src.models import (ARCHITECTURES, SUPPORTED, Checkpoint, CheckpointError,
                                 dequantize_mxfp4, from_pretrained, logical_rules,
                                 override_attention, tokenizer)

__all__ = ["ARCHITECTURES", "SUPPORTED", "Checkpoint", "CheckpointError", "dequantize_mxfp4",
    "from_pretrained", "logical_rules", "override_attention", "probe", "tokenizer"]
