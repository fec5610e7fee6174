"""Data for the experiments: tokenisers, corpora, the bigram-backcopy task, deterministic batches.

``data.from_config(config.data, seed=0).batch("train", step)`` is a ``Batch`` of
``inputs`` and ``targets`` ``[B, T]`` (``inputs[:, 0]`` = BOS), the same for a step on
every run. With ``config.data.pack = True`` each row packs whole documents and the batch
also carries ``segment_ids``, ``positions`` and loss ``weights``; with
``config.data.objective = "mlm"`` a batch is BERT's masked LM (:class:`MaskedLMBatches`). Sources
(``config.data.name``): ``shakespeare`` (default), ``text``, ``bin`` (nanoGPT) and
``bigram_backcopy`` (synthetic).

Guide: :doc:`/guides/training`, section "Data".
"""

from attnjax._src.data import (
  SOURCES,
  Batch,
  Batches,
  BigramBackcopyBatches,
  ByteTokenizer,
  CharTokenizer,
  CorpusBatches,
  MaskedLMBatches,
  TokenData,
  bigram_backcopy_chain,
  from_config,
  load_bin,
  load_shakespeare,
  load_text,
  mask_tokens,
  pack_documents,
  shakespeare_dir,
  split_documents,
  stack_batches,
  with_bos,
)

__all__ = [
  "SOURCES",
  "Batch",
  "Batches",
  "BigramBackcopyBatches",
  "ByteTokenizer",
  "CharTokenizer",
  "CorpusBatches",
  "MaskedLMBatches",
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
