"""Batches as a pure function of ``(seed, split, step)``, and the bigram-backcopy task.

A resumed run asks for step ``s`` and gets exactly the batch an uninterrupted
run got at step ``s``: nothing is drawn from a stateful iterator. Every
sequence starts with BOS at position 0; ``inputs[:, 0] == bos_id`` and
``targets`` are ``inputs`` shifted left by one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from attnjax._src.data.corpus import TokenData
from attnjax._src.deprecation import warn_renamed

# "heldout": fixed sequences of the validation tokens, never packed (a leading BOS each), drawn
# apart from "val"'s; the training loop's probes read them.
_SPLIT_CODE = {"train": 0, "val": 1, "heldout": 2}
# Old split names, each warning once ("probe" is the training loop's statistics only).
_RENAMED_SPLITS = {"probe": "heldout"}


def _split(split: str) -> str:
  """``split``, or the new name of a renamed one (warning once)."""
  if split in _RENAMED_SPLITS:
    new = _RENAMED_SPLITS[split]
    warn_renamed(f"batch({split!r}, ...)", f"batch({new!r}, ...)", stacklevel=3)
    return new
  return split


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
  if split not in _SPLIT_CODE:
    raise ValueError(f"split={split!r} is not one of: {', '.join(_SPLIT_CODE)}")
  if step < 0:
    raise ValueError(f"step must be >= 0, got {step}")
  return np.random.default_rng([int(seed), _SPLIT_CODE[split], int(step)])


@dataclasses.dataclass(frozen=True)
class Batch:
  """One batch of next-token prediction; every field is a numpy ``[B, T]`` array.

  Attributes:
    inputs: int32 tokens; ``inputs[:, 0]`` is BOS.
    targets: int32, ``inputs`` shifted left by one.
    segment_ids: int32 document of each input token, from 1 (packed batches,
      ``data.pack=True``; else None).
    positions: int32 position of each token in its document, its BOS at 0 (packed).
    weights: float32, 1 where the target is the next token of the same document, 0
      where it would cross into the next one (packed).
  """

  inputs: np.ndarray
  targets: np.ndarray
  segment_ids: Optional[np.ndarray] = None
  positions: Optional[np.ndarray] = None
  weights: Optional[np.ndarray] = None

  @property
  def packed(self) -> bool:
    """Whether the batch packs documents (has segment ids)."""
    return self.segment_ids is not None

  def packing(self) -> Optional[dict[str, np.ndarray]]:
    """``{"segment_ids", "positions", "weights"}`` of a packed batch, else None."""
    if not self.packed:
      return None
    return {"segment_ids": self.segment_ids, "positions": self.positions, "weights": self.weights}


def pack_documents(docs: list[np.ndarray], length: int, bos_id: int) -> Batch:
  """Packs documents, each behind a BOS, into one row of ``length + 1`` tokens -> a 1-row Batch.

  The last document is cut where the row ends; documents left over are
  dropped. Segment ids count documents from 1; positions restart at 0 on each
  BOS; a target is weighted 0 where it is the next document's BOS.

  Args:
    docs: integer token arrays, one per document, in order.
    length: ``T``, the row's input length.
    bos_id: the BOS token.

  Returns:
    A packed :class:`.Batch` of one row (every field ``[1, T]``).

  Raises:
    ValueError: the documents hold fewer than ``T + 1`` tokens with their BOS.
  """
  tokens, segments, positions = [], [], []
  for i, doc in enumerate(docs):
    seq = np.concatenate([[bos_id], np.asarray(doc, np.int64)])
    tokens.append(seq)
    segments.append(np.full(len(seq), i + 1, np.int64))
    positions.append(np.arange(len(seq)))
    if sum(len(t) for t in tokens) >= length + 1:
      break
  row = np.concatenate(tokens)[: length + 1]
  if len(row) < length + 1:
    raise ValueError(
      f"documents hold {len(row)} tokens with their BOS, fewer than seq_len + 1 = {length + 1}"
    )
  seg = np.concatenate(segments)[: length + 1]
  pos = np.concatenate(positions)[: length + 1]
  return Batch(
    inputs=row[None, :-1].astype(np.int32),
    targets=row[None, 1:].astype(np.int32),
    segment_ids=seg[None, :-1].astype(np.int32),
    positions=pos[None, :-1].astype(np.int32),
    weights=(seg[None, :-1] == seg[None, 1:]).astype(np.float32),
  )


def stack_batches(rows: list[Batch]) -> Batch:
  """Concatenates batches along the batch axis.

  Args:
    rows: :class:`.Batch` objects, all packed or all not.

  Returns:
    One :class:`.Batch` whose fields are ``[sum of B, T]``.
  """
  fields = [f.name for f in dataclasses.fields(Batch)]
  return Batch(
    **{
      name: (
        None if getattr(rows[0], name) is None else np.concatenate([getattr(r, name) for r in rows])
      )
      for name in fields
    }
  )


def with_bos(windows: np.ndarray, bos_id: int) -> Batch:
  """A batch of corpus windows behind a BOS: inputs ``[BOS, w_0, ..., w_{T-2}]``, targets ``w``.

  Args:
    windows: integer ``[B, T]`` corpus ids.
    bos_id: the BOS token.

  Returns:
    A :class:`.Batch` with ``inputs`` and ``targets`` int32 ``[B, T]``.
  """
  B = windows.shape[0]
  seq = np.concatenate([np.full((B, 1), bos_id, np.int64), windows.astype(np.int64)], axis=1)
  return Batch(inputs=seq[:, :-1].astype(np.int32), targets=seq[:, 1:].astype(np.int32))


@dataclasses.dataclass(frozen=True)
class CorpusBatches:
  """Random windows of a :class:`.TokenData` split.

  Attributes:
    data: the corpus.
    seq_len: T, tokens per sequence including the BOS at position 0.
    batch_size: B, sequences per batch (global, over all devices and hosts).
    seed: data seed; batch ``(split, step)`` depends on nothing else.
  """

  data: TokenData
  seq_len: int
  batch_size: int
  seed: int = 0
  pack: bool = False

  def __post_init__(self):
    for split in ("train", "val"):
      n = len(self.data.split(split))
      if n < self.seq_len:
        raise ValueError(
          f"data.seq_len={self.seq_len} is longer than the {split} split ({n} tokens)"
        )
    if self.pack:
      self.separator_id  # checks the corpus can be split into documents

  @property
  def separator_id(self) -> int:
    """Id of the newline that ends a document (a line) when packing."""
    tok = self.data.tokenizer
    ids = None if tok is None else np.asarray(tok.encode("\n"))
    if ids is None or ids.shape != (1,) or (hasattr(tok, "UNK") and int(ids[0]) == tok.UNK):
      raise ValueError(
        "data.pack=True splits the corpus into documents at line ends; this "
        "corpus has no tokenizer with a newline"
      )
    return int(ids[0])

  @property
  def model_vocab_size(self) -> int:
    """The model's vocabulary size (BOS included)."""
    return self.data.vocab_size

  @property
  def bos_id(self) -> int:
    return self.data.bos_id

  @property
  def unit(self) -> str:
    return self.data.unit

  def batch(
    self, split: str, step: int, *, seq_len: Optional[int] = None, batch_size: Optional[int] = None
  ) -> Batch:
    """The batch of ``split`` (``"train"``, ``"val"`` or ``"heldout"``) at ``step``;
    ``seq_len``/``batch_size`` override the defaults."""
    split = _split(split)
    T = seq_len or self.seq_len
    B = batch_size or self.batch_size
    tokens = self.data.split("val" if split == "heldout" else split)
    if len(tokens) < T:
      raise ValueError(f"seq_len={T} is longer than the {split} split ({len(tokens)} tokens)")
    starts = _rng(self.seed, split, step).integers(0, len(tokens) - T + 1, size=B)
    if self.pack and split != "heldout":  # sinks are read at a leading BOS: unpacked
      return self._packed(tokens, starts, T)
    windows = np.stack([np.asarray(tokens[s : s + T]) for s in starts])
    return with_bos(windows, self.bos_id)

  def _packed(self, tokens: np.ndarray, starts: np.ndarray, T: int) -> Batch:
    """Rows of whole lines (documents), from the first line that begins at or after each start.

    Each document is its line (newline included) behind a BOS; a row packs
    consecutive documents and cuts the last one; past the split's end it
    wraps around to its start.
    """
    sep = self.separator_id
    rows = []
    for pos in starts.tolist():
      if pos > 0 and tokens[pos - 1] != sep:  # skip to the next line start, if one is near
        ends = np.flatnonzero(np.asarray(tokens[pos : pos + 4 * T]) == sep)
        if len(ends):
          pos += int(ends[0]) + 1
      docs, filled = [], 0
      while filled < T + 1:
        if pos >= len(tokens):
          pos = 0
        window = np.asarray(tokens[pos : pos + T + 1])
        ends = np.flatnonzero(window == sep)
        doc = window if len(ends) == 0 else window[: int(ends[0]) + 1]
        docs.append(doc)
        filled += len(doc) + 1
        pos += len(doc)
      rows.append(pack_documents(docs, T, self.bos_id))
    return stack_batches(rows)


def bigram_backcopy_chain(
  vocab_size: int, num_triggers: int, *, seed: int = 0, concentration: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
  """A random bigram chain and its trigger tokens for the bigram-backcopy task.

  Args:
    vocab_size: V, number of ordinary tokens (BOS is extra, id V).
    num_triggers: how many tokens are triggers (the lowest ids, ``0..num_triggers-1``).
    seed: seed of the chain (fixed per task, independent of the training seed).
    concentration: Dirichlet concentration of each row; small values give
      sparse, language-like transitions, so the bigram part is learnable.

  Returns:
    ``(transition [V, V] float64 rows summing to one, triggers [num_triggers] int)``.
  """
  if vocab_size < 2 or not 0 < num_triggers < vocab_size:
    raise ValueError(
      f"data.bb_vocab_size={vocab_size} and data.bb_num_triggers={num_triggers}"
      " need 0 < num_triggers < vocab_size"
    )
  rng = np.random.default_rng([int(seed), 7919])
  transition = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
  return transition, np.arange(num_triggers)


@dataclasses.dataclass(frozen=True)
class BigramBackcopyBatches:
  """Bigram-backcopy sequences (Guo et al. 2024, "Active-Dormant Attention Heads").

  Each sequence is ``BOS x_1 x_2 ...``: ``x_1`` is drawn uniformly from the
  non-trigger tokens; after a non-trigger token the next one follows the
  bigram chain; after a trigger token the next one is a copy of the token
  just before the trigger. A head that copies is needed only after triggers,
  so in every other context it is idle ("dormant") and parks its attention
  on BOS, which is how sinks appear in 1-3 layer models.

  Attributes:
    vocab_size: ordinary tokens V; the model's vocabulary is V + 1 (BOS = V).
    num_triggers: trigger tokens (ids ``0..num_triggers-1``).
    seq_len: T, including BOS.
    batch_size: B.
    seed: sampling seed; batch ``(split, step)`` depends on nothing else.
    task_seed: seed of the transition matrix (the task itself).
    concentration: Dirichlet concentration of the chain's rows.
  """

  vocab_size: int = 64
  num_triggers: int = 3
  seq_len: int = 64
  batch_size: int = 32
  seed: int = 0
  task_seed: int = 0
  concentration: float = 0.1

  @property
  def bos_id(self) -> int:
    return self.vocab_size

  @property
  def model_vocab_size(self) -> int:
    """The model's vocabulary size (the V ordinary tokens and BOS)."""
    return self.vocab_size + 1

  @property
  def unit(self) -> str:
    return "token"

  def chain(self) -> tuple[np.ndarray, np.ndarray]:
    return bigram_backcopy_chain(
      self.vocab_size, self.num_triggers, seed=self.task_seed, concentration=self.concentration
    )

  def batch(
    self, split: str, step: int, *, seq_len: Optional[int] = None, batch_size: Optional[int] = None
  ) -> Batch:
    split = _split(split)
    T = seq_len or self.seq_len
    B = batch_size or self.batch_size
    transition, triggers = self.chain()
    cumulative = np.cumsum(transition, axis=1)
    is_trigger = np.zeros(self.vocab_size, bool)
    is_trigger[triggers] = True
    rng = _rng(self.seed, split, step)
    uniforms = rng.random((B, T))
    tokens = np.zeros((B, T), np.int64)
    first = rng.integers(self.num_triggers, self.vocab_size, size=B)
    tokens[:, 0] = first
    for t in range(1, T):
      cur = tokens[:, t - 1]
      drawn = np.minimum(
        (cumulative[cur] < uniforms[:, t : t + 1]).sum(axis=1), self.vocab_size - 1
      )
      prev = tokens[:, t - 2] if t >= 2 else cur
      tokens[:, t] = np.where(is_trigger[cur], prev, drawn)
    return with_bos(tokens, self.bos_id)
