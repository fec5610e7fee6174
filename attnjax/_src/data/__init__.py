"""Data for the experiments: tokenisers, corpora, the bigram-backcopy task, deterministic batches.

Implementation behind the public module :mod:`attnjax.data`.
"""

from __future__ import annotations

from typing import Any, Union

from attnjax._src.data.batches import Batch
from attnjax._src.data.batches import BigramBackcopyBatches
from attnjax._src.data.batches import CorpusBatches
from attnjax._src.data.batches import bigram_backcopy_chain
from attnjax._src.data.batches import pack_documents
from attnjax._src.data.batches import stack_batches
from attnjax._src.data.batches import with_bos
from attnjax._src.data.corpus import TokenData
from attnjax._src.data.masked_lm import MaskedLMBatches, mask_tokens
from attnjax._src.data.corpus import load_bin
from attnjax._src.data.corpus import load_shakespeare
from attnjax._src.data.corpus import load_text
from attnjax._src.data.corpus import shakespeare_dir
from attnjax._src.data.corpus import split_documents
from attnjax._src.data.tokenizers import ByteTokenizer
from attnjax._src.data.tokenizers import CharTokenizer

Batches = Union[CorpusBatches, BigramBackcopyBatches]

SOURCES = ("shakespeare", "text", "bin", "bigram_backcopy")


def from_config(cfg: Any, *, seed: int) -> Batches:
  """The batches a ``config.data`` ConfigDict describes (keys of :func:`attnjax.train.base_config`).

  Args:
    cfg: the ``data`` group of a run config.
    seed: the run's seed; every batch is a pure function of it, the split and the step.

  Returns:
    A :class:`.CorpusBatches` (``shakespeare``, ``text``, ``bin``) or a
    :class:`.BigramBackcopyBatches`; ``batch(split, step)`` gives a :class:`.Batch`.

  Raises:
    ValueError: an unknown ``data.name``, a ``seq_len`` below 2, a ``batch_size`` below 1,
      a missing ``data.path``, or ``pack=True`` on the synthetic task.
    FileNotFoundError: a ``data.path`` that does not exist.
  """
  name = cfg.name
  if name not in SOURCES:
    raise ValueError(f"data.name={name!r} is not one of: {', '.join(SOURCES)}")
  if cfg.seq_len < 2:
    raise ValueError(f"data.seq_len must be >= 2 (BOS + one token), got {cfg.seq_len}")
  if cfg.batch_size < 1:
    raise ValueError(f"data.batch_size must be >= 1, got {cfg.batch_size}")
  pack = bool(cfg.get("pack", False))
  if name == "bigram_backcopy":
    if pack:
      raise ValueError(
        "data.pack=True needs a corpus of documents; data.name='bigram_backcopy' has none"
      )
    return BigramBackcopyBatches(
      vocab_size=cfg.bb_vocab_size,
      num_triggers=cfg.bb_num_triggers,
      seq_len=cfg.seq_len,
      batch_size=cfg.batch_size,
      seed=seed,
      task_seed=cfg.bb_task_seed,
      concentration=cfg.bb_concentration,
    )
  if name == "shakespeare":
    tokens = load_shakespeare(tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction)
  elif name == "text":
    if not cfg.path:
      raise ValueError("data.path must name a text file or folder when data.name='text'")
    tokens = load_text(cfg.path, tokenizer=cfg.tokenizer, val_fraction=cfg.val_fraction)
  else:
    if not cfg.path:
      raise ValueError("data.path must name a folder with train.bin/val.bin when data.name='bin'")
    tokens = load_bin(cfg.path, vocab_size=cfg.vocab_size, dtype=cfg.bin_dtype)
  batches = CorpusBatches(
    tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=seed, pack=pack
  )
  if cfg.get("objective", "causal") == "mlm":
    if pack:
      raise ValueError("data.pack=True: the masked-LM objective reads unpacked windows")
    return MaskedLMBatches(batches, rate=cfg.get("mask_rate", 0.15), seed=seed)
  return batches


__all__ = [
  "Batch",
  "Batches",
  "BigramBackcopyBatches",
  "ByteTokenizer",
  "CharTokenizer",
  "CorpusBatches",
  "MaskedLMBatches",
  "SOURCES",
  "TokenData",
  "bigram_backcopy_chain",
  "from_config",
  "load_bin",
  "load_shakespeare",
  "load_text",
  "mask_tokens",
  "pack_documents",
  "shakespeare_dir",
  "split_documents",
  "stack_batches",
  "with_bos",
]
