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

from attnjax.data.corpus import TokenData

_SPLIT_CODE = {"train": 0, "val": 1, "probe": 2}


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
  if split not in _SPLIT_CODE:
    raise ValueError(f"split={split!r} is not one of: {', '.join(_SPLIT_CODE)}")
  if step < 0:
    raise ValueError(f"step must be >= 0, got {step}")
  return np.random.default_rng([int(seed), _SPLIT_CODE[split], int(step)])


@dataclasses.dataclass(frozen=True)
class Batch:
  """``inputs`` and ``targets`` ``[B, T]`` int32; ``inputs[:, 0]`` is BOS."""

  inputs: np.ndarray
  targets: np.ndarray


def with_bos(windows: np.ndarray, bos_id: int) -> Batch:
  """``windows`` ``[B, T]`` of corpus ids -> inputs ``[BOS, w_0..w_{T-2}]``, targets ``w``."""
  B = windows.shape[0]
  seq = np.concatenate([np.full((B, 1), bos_id, np.int64), windows.astype(np.int64)], axis=1)
  return Batch(inputs=seq[:, :-1].astype(np.int32), targets=seq[:, 1:].astype(np.int32))


@dataclasses.dataclass(frozen=True)
class CorpusBatches:
  """Random windows of a :class:`TokenData` split.

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

  def __post_init__(self):
    for split in ("train", "val"):
      n = len(self.data.split(split))
      if n < self.seq_len:
        raise ValueError(f"data.seq_len={self.seq_len} is longer than the {split} split "
                         f"({n} tokens)")

  @property
  def model_vocab_size(self) -> int:
    """Vocabulary of the model (BOS included)."""
    return self.data.vocab_size

  @property
  def bos_id(self) -> int:
    return self.data.bos_id

  @property
  def unit(self) -> str:
    return self.data.unit

  def batch(self, split: str, step: int, *, seq_len: Optional[int] = None,
            batch_size: Optional[int] = None) -> Batch:
    """The batch of ``split`` at ``step``; ``seq_len``/``batch_size`` override the defaults."""
    T = seq_len or self.seq_len
    B = batch_size or self.batch_size
    tokens = self.data.split("val" if split == "probe" else split)
    if len(tokens) < T:
      raise ValueError(f"seq_len={T} is longer than the {split} split ({len(tokens)} tokens)")
    starts = _rng(self.seed, split, step).integers(0, len(tokens) - T + 1, size=B)
    windows = np.stack([np.asarray(tokens[s:s + T]) for s in starts])
    return with_bos(windows, self.bos_id)


def bigram_backcopy_chain(vocab_size: int, num_triggers: int, *, seed: int = 0,
                          concentration: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
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
    raise ValueError(f"data.bb_vocab_size={vocab_size} and data.bb_num_triggers={num_triggers}"
                     " need 0 < num_triggers < vocab_size")
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
    """Vocabulary of the model: the V ordinary tokens and BOS."""
    return self.vocab_size + 1

  @property
  def unit(self) -> str:
    return "token"

  def chain(self) -> tuple[np.ndarray, np.ndarray]:
    return bigram_backcopy_chain(self.vocab_size, self.num_triggers, seed=self.task_seed,
                                 concentration=self.concentration)

  def batch(self, split: str, step: int, *, seq_len: Optional[int] = None,
            batch_size: Optional[int] = None) -> Batch:
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
      drawn = np.minimum((cumulative[cur] < uniforms[:, t:t + 1]).sum(axis=1), self.vocab_size - 1)
      prev = tokens[:, t - 2] if t >= 2 else cur
      tokens[:, t] = np.where(is_trigger[cur], prev, drawn)
    return with_bos(tokens, self.bos_id)
