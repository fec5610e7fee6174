"""Pallas kernels of selected-block attention (NSA's selected branch): TPU and Hopper GPU."""

from attnjax._src.kernels.selected.attention import mosaic_gpu, pallas_tpu, plan_call, unsupported
from attnjax._src.kernels.selected.plan import QUERY_MAJOR_MIN_GROUP, loop_order

__all__ = ["QUERY_MAJOR_MIN_GROUP", "loop_order", "mosaic_gpu", "pallas_tpu", "plan_call", "unsupported"]
