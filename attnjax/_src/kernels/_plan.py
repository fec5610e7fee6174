"""What every dense kernel's plan shares: the normaliser and the row counts it needs."""

from __future__ import annotations

from typing import Any

from attnjax._src import normalizers


class KernelPlan:
  """Mixin for a kernel's plan: the static description of one invocation (shapes, block sizes,
  and the dense options as ``self.opts``).

  The block-wise, Pallas GPU, Pallas TPU and Mosaic GPU plans read the normaliser and its
  needs from here.
  """

  opts: Any

  @property
  def nz(self) -> normalizers.Normalizer:
    """The normaliser: every normaliser-specific step of a kernel is one of its methods."""
    return normalizers.get(self.opts.normalizer)

  @property
  def with_stats(self) -> bool:
    """Whether the call returns :class:`~attnjax.AttentionStats` (``opts.return_stats``)."""
    return self.opts.return_stats

  @property
  def needs_counts(self) -> bool:
    """Whether the kernel counts each row's allowed keys (the normaliser or the statistics
    need them)."""
    return self.nz.needs_counts or self.with_stats
