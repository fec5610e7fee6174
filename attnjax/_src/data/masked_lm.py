"""The masked-LM objective (Devlin et al. 2019): 15% of tokens predicted, split 80/10/10.

Implementation behind the public module :mod:`attnjax.data`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attnjax._src.data.batches import Batch, _rng


def check_mask_rate(rate: Any) -> float:
  """``rate`` as a float in (0, 1), or a ValueError naming it."""
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1:
    raise ValueError(f"mask_rate must be a number in (0, 1), got {rate!r}")
  return float(rate)


def mask_tokens(
  tokens: np.ndarray,
  rng: np.random.Generator,
  *,
  rate: float = 0.15,
  mask_id: int,
  vocab_size: int,
  keep: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
  """BERT's masking: ``(inputs, weights)`` of ``tokens`` ``[B, T]``.

  Each position from ``keep`` on is chosen with probability ``rate``; of the chosen, 80%
  become ``mask_id``, 10% a uniformly random token id below ``vocab_size`` and 10% stay as
  they are. ``weights`` is 1 at the chosen positions (the loss's), else 0. The first
  ``keep`` positions (the leading BOS / ``[CLS]``) are never chosen.

  Raises:
    ValueError: ``rate`` outside (0, 1), or a negative ``mask_id``.
  """
  rate = check_mask_rate(rate)
  if isinstance(mask_id, bool) or not isinstance(mask_id, (int, np.integer)) or mask_id < 0:
    raise ValueError(f"mask_id must be a token id (an int >= 0), got {mask_id!r}")
  tokens = np.asarray(tokens)
  chosen = rng.random(tokens.shape) < rate
  chosen[:, :keep] = False
  kind = rng.random(tokens.shape)
  random_ids = rng.integers(0, vocab_size, size=tokens.shape)
  inputs = np.where(chosen & (kind < 0.8), mask_id, tokens)
  inputs = np.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, inputs)
  return inputs.astype(np.int32), chosen.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class MaskedLMBatches:
  """Masked-LM batches of another source's windows (a leading BOS as ``[CLS]``).

  The model's vocabulary adds one token, ``[MASK]`` (id ``mask_id``, the source's model
  vocabulary size). A batch's ``targets`` are the unmasked tokens, ``weights`` marks the
  chosen positions, ``segment_ids`` are one sequence each and ``positions`` ``0..T-1``: the
  training step's weighted loss then counts the chosen positions only.

  Attributes:
    source: the windows' batches (:class:`.CorpusBatches` or another).
    rate: the share of positions chosen (0.15).
    seed: the masking seed; batch ``(split, step)`` depends on nothing else.
  """

  source: Any
  rate: float = 0.15
  seed: int = 0

  def __post_init__(self):
    check_mask_rate(self.rate)

  @property
  def mask_id(self) -> int:
    return self.source.model_vocab_size

  @property
  def model_vocab_size(self) -> int:
    return self.source.model_vocab_size + 1

  @property
  def bos_id(self) -> int:
    return self.source.bos_id

  @property
  def unit(self) -> str:
    return self.source.unit

  @property
  def batch_size(self) -> int:
    return self.source.batch_size

  @property
  def data(self):
    return getattr(self.source, "data", None)

  def batch(self, split: str, step: int, **kwargs) -> Batch:
    """The masked batch of ``split`` at ``step`` (``seq_len``, ``batch_size`` as the source's)."""
    tokens = self.source.batch(split, step, **kwargs).inputs
    rng = _rng(self.seed + 7919, split, step)  # its own stream beside the windows'
    inputs, weights = mask_tokens(
      tokens, rng, rate=self.rate, mask_id=self.mask_id, vocab_size=self.source.model_vocab_size
    )
    B, T = tokens.shape
    return Batch(
      inputs=inputs,
      targets=np.asarray(tokens, np.int32),
      segment_ids=np.ones((B, T), np.int32),
      positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
      weights=weights,
    )
