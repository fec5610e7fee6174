"""Pretrained checkpoints (Hugging Face format) as the project's own ``nn.TransformerLM``.

Implementation behind the public module :mod:`attnjax.models`.
"""

from __future__ import annotations

import os

from attnjax._src.models import probe
from attnjax._src.models.architectures import ARCHITECTURES, SUPPORTED, dequantize_mxfp4
from attnjax._src.models.checkpoint import Checkpoint, CheckpointError
from attnjax._src.models.loader import from_pretrained, logical_rules, override_attention


def tokenizer(path: str):
  """The ``tokenizers.Tokenizer`` of a checkpoint directory's ``tokenizer.json``.

  Raises:
    ImportError: the optional ``tokenizers`` package is not installed.
    FileNotFoundError: the directory has no ``tokenizer.json``.
  """
  file = os.path.join(os.fspath(path), "tokenizer.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(
      f"{file} does not exist: text needs the checkpoint's tokenizer "
      f"(copy its tokenizer.json into {os.fspath(path)!r}, e.g. from the "
      f"model's Hugging Face repository), or pass token ids instead (a "
      f".npy or .bin file)"
    )
  try:
    from tokenizers import Tokenizer
  except ImportError:
    raise ImportError(
      f"reading text through {file} needs the 'tokenizers' package (pip install "
      f"'attnjax[pretrained]', or pip install tokenizers); or pass token ids "
      f"(a .npy or .bin file)"
    ) from None
  return Tokenizer.from_file(file)


__all__ = [
  "ARCHITECTURES",
  "Checkpoint",
  "CheckpointError",
  "SUPPORTED",
  "dequantize_mxfp4",
  "from_pretrained",
  "logical_rules",
  "override_attention",
  "probe",
  "tokenizer",
]
