"""Context parallelism: attention over a sequence sharded across devices.

Implementation behind the public module :mod:`attnjax.parallel`.
"""

from __future__ import annotations

from attnjax._src.kernels.blockwise.ring import plan as ring_plan, shard_positions
from attnjax._src.options import CONTEXT_LAYOUTS, CONTEXT_STRATEGIES
from attnjax._src.parallel.recurrent import state_passing
from attnjax._src.parallel.strategies import attention, choose_strategy
from attnjax._src.parallel.tokens import unzigzag, zigzag

__all__ = [
  "CONTEXT_LAYOUTS",
  "CONTEXT_STRATEGIES",
  "attention",
  "choose_strategy",
  "ring_plan",
  "shard_positions",
  "state_passing",
  "unzigzag",
  "zigzag",
]
