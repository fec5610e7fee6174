"""Character and byte tokenisers, each with a BOS id that starts every sequence.

Both are small, exact and reversible on their alphabet, so bits per character
(or per byte) follow directly from the cross-entropy.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Characters of a fixed alphabet; id 0 is BOS, id 1 is UNK, then the alphabet.

  Attributes:
    alphabet: the characters, in id order (built sorted by ``from_text``).
  """

  alphabet: str

  BOS = 0
  UNK = 1

  @classmethod
  def from_text(cls, text: str) -> "CharTokenizer":
    return cls("".join(sorted(set(text))))

  @property
  def vocab_size(self) -> int:
    return len(self.alphabet) + 2

  @property
  def bos_id(self) -> int:
    return self.BOS

  def encode(self, text: str) -> np.ndarray:
    """Ids of ``text`` (no BOS; the batcher adds it), uint16 or uint32 as the vocabulary needs."""
    table = {c: i + 2 for i, c in enumerate(self.alphabet)}
    dtype = np.uint16 if self.vocab_size < 2**16 else np.uint32
    return np.fromiter((table.get(c, self.UNK) for c in text), dtype=dtype, count=len(text))

  def decode(self, ids) -> str:
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i >= 2:
        out.append(self.alphabet[i - 2])
      elif i == self.UNK:
        out.append("\ufffd")
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0 to 255 are bytes, 256 is BOS."""

  @property
  def vocab_size(self) -> int:
    """The vocabulary size, 257 (the 256 bytes and BOS)."""
    return 257

  @property
  def bos_id(self) -> int:
    """The BOS id, 256."""
    return 256

  def encode(self, text: str) -> np.ndarray:
    """``text``'s UTF-8 bytes as uint16 ids ``[len]``."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

  def decode(self, ids) -> str:
    """The text of byte ids (BOS dropped; invalid UTF-8 replaced)."""
    data = bytes(i for i in np.asarray(ids).reshape(-1).tolist() if i < 256)
    return data.decode("utf-8", errors="replace")


TOKENIZERS = ("char", "byte")
