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

from __future__ import annotations

import os

from attnjax.models import probe
from attnjax.models.architectures import ARCHITECTURES, SUPPORTED, dequantize_mxfp4
from attnjax.models.checkpoint import Checkpoint, CheckpointError
from attnjax.models.loader import from_pretrained, logical_rules, override_attention


def tokenizer(path: str):
  """The ``tokenizers.Tokenizer`` of a checkpoint directory's ``tokenizer.json``.

  Raises:
    ImportError: the optional ``tokenizers`` package is not installed.
    FileNotFoundError: the directory has no ``tokenizer.json``.
  """
  file = os.path.join(os.fspath(path), "tokenizer.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{file} does not exist: text needs the checkpoint's tokenizer "
                            f"(copy its tokenizer.json into {os.fspath(path)!r}, e.g. from the "
                            f"model's Hugging Face repository), or pass token ids instead (a "
                            f".npy or .bin file)")
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise ImportError(f"reading text through {file} needs the 'tokenizers' package (pip install "
                      f"'attnjax[pretrained]', or pip install tokenizers); or pass token ids "
                      f"(a .npy or .bin file)") from None
  return Tokenizer.from_file(file)


__all__ = ["ARCHITECTURES", "Checkpoint", "CheckpointError", "SUPPORTED", "dequantize_mxfp4",
           "from_pretrained", "logical_rules", "override_attention", "probe", "tokenizer"]
