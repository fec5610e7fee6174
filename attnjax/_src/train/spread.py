"""Mean and spread over seeds, and whether two arms differ beyond it.

Fewer than 5 seeds: the spread is the largest distance of a seed from the mean, so
``mean ± spread`` covers every seed. From 5 seeds: the 95% Student-t interval of the mean.
Two arms differ only where their ``mean ± spread`` intervals do not overlap; elsewhere the
difference is "within noise".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import numpy as np

# From this many seeds the spread is a 95% confidence interval of the mean.
CI_FROM = 5


@dataclasses.dataclass(frozen=True)
class Spread:
  """A metric over the seeds of one arm.

  Attributes:
    mean: the mean over the seeds with a value.
    half: the half-width: largest ``|seed - mean|`` for ``n < 5``, else the 95% t-interval's.
    n: seeds with a (finite) value.
    values: those values.
  """

  mean: float
  half: float
  n: int
  values: tuple

  @property
  def lo(self) -> float:
    return self.mean - self.half

  @property
  def hi(self) -> float:
    return self.mean + self.half

  @property
  def band(self) -> tuple[float, float]:
    """The band a plot draws, ``(low, high)``: the seeds' range below 5 seeds (inside
    ``mean ± half``), else the 95% interval of the mean."""
    if self.n < CI_FROM:
      return min(self.values), max(self.values)
    return self.lo, self.hi

  @property
  def kind(self) -> str:
    """``"one seed"``, ``"range"`` (covers every seed) or ``"95% CI"``."""
    return "one seed" if self.n == 1 else ("range" if self.n < CI_FROM else "95% CI")


def spread(values: Iterable[Optional[float]]) -> Optional[Spread]:
  """The :class:`.Spread` of the finite ``values`` (None and NaN left out); None if none.

  >>> s = spread([1.0, 2.0, 4.0])
  >>> round(s.mean, 3), round(s.half, 3), s.n
  (2.333, 1.667, 3)
  """
  xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
  if not xs:
    return None
  n = len(xs)
  mean = float(np.mean(xs))
  if n == 1:
    half = 0.0
  elif n < CI_FROM:
    half = float(max(abs(x - mean) for x in xs))
  else:
    from scipy import stats as scipy_stats  # a dependency of jax

    t = float(scipy_stats.t.ppf(0.975, n - 1))
    half = t * float(np.std(xs, ddof=1)) / math.sqrt(n)
  return Spread(mean, half, n, tuple(xs))


def number(x: Optional[float], digits: int = 3) -> str:
  """``x`` for a table: ``digits`` decimals; 3 significant digits when it is large (>= 1e4),
  2 when it is small (below ``10**-digits``); ``"-"`` for None.

  >>> number(0.12345), number(2.29e6), number(0.0017)
  ('0.123', '2.29e+06', '0.0017')
  """
  if x is None or not math.isfinite(x):
    return "-"
  if x != 0 and abs(x) >= 1e4:
    return f"{x:.3g}"
  if x != 0 and abs(x) < 10.0**-digits:
    return f"{x:.2g}"
  return f"{x:.{digits}f}"


def fmt_spread(s: Optional[Spread], digits: int = 3) -> str:
  """``"0.610 ± 0.050"``: the spread to two significant digits (at least ``digits``
  decimals) and the mean to the same decimals; one seed: the mean alone; none: ``"-"``.

  >>> fmt_spread(spread([3.3253, 3.3206]), 1), fmt_spread(spread([1.5e6, 1.2e6]))
  ('3.3230 ± 0.0024', '1.35e+06 ± 1.5e+05')
  """
  if s is None:
    return "-"
  if s.n == 1:
    return number(s.mean, digits)
  if s.half == 0:
    return f"{number(s.mean, digits)} ± 0"
  if max(abs(s.mean), s.half) >= 1e4 or max(abs(s.mean), s.half) < 10.0**-digits:
    return f"{s.mean:.3g} ± {s.half:.2g}".replace("e+0", "e+0")
  decimals = min(6, max(digits, 1 - math.floor(math.log10(s.half))))
  return f"{s.mean:.{decimals}f} ± {s.half:.{decimals}f}"


def differs(a: Optional[Spread], b: Optional[Spread]) -> Optional[int]:
  """``+1`` where ``a`` lies above ``b`` beyond both spreads, ``-1`` below, ``0`` within
  noise (the intervals overlap); None when either has fewer than 2 seeds (no spread)."""
  if a is None or b is None or a.n < 2 or b.n < 2:
    return None
  if a.lo > b.hi:
    return 1
  if a.hi < b.lo:
    return -1
  return 0


MARKS = {1: "▲", -1: "▼", 0: "~", None: ""}


def legend() -> str:
  """One sentence on what ``±`` means and how the marks read."""
  return (
    f"`±`: with fewer than {CI_FROM} seeds, the largest distance of a seed from the mean "
    f"(every seed lies within); from {CI_FROM} seeds, the 95% t-interval of the mean. "
    f"Against the reference arm at the same learning rate: ▲ higher and ▼ lower beyond "
    f"both spreads (the intervals do not overlap), ~ within noise."
  )
