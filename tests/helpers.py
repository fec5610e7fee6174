"""Helpers shared by the test files: random attention inputs and tree-wise closeness (chex)."""

from __future__ import annotations

from typing import Any, Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np


def rand_qkv(B: int = 2, T: int = 12, S: int | None = None, N: int = 8, K: int = 2,
             H: int = 16, Hv: int | None = None, *, seed: int = 0, dtype: Any = jnp.float32,
             scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
             source: Literal["jax", "numpy"] = "jax"):
  """Standard-normal ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]``.

  Args:
    B, T, S, N, K, H, Hv: the shape letters of ARCHITECTURE.md; ``S`` defaults
      to ``T`` and ``Hv`` to ``H``.
    seed: the draw.
    dtype: the arrays' dtype.
    scales: factors multiplying ``q``, ``k`` and ``v`` after the draw.
    source: ``"jax"`` draws ``jax.random.normal`` in ``dtype`` from the three
      keys of ``jax.random.split(jax.random.key(seed), 3)``; ``"numpy"`` draws
      q, k, v in that order from ``np.random.default_rng(seed)`` in float32,
      which compiles no XLA program per shape (many small shapes stay fast).

  Returns:
    ``(q, k, v)``.
  """
  S = T if S is None else S
  Hv = H if Hv is None else Hv
  shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
  if source == "jax":
    keys = jax.random.split(jax.random.key(seed), 3)
    arrays = [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes)]
  elif source == "numpy":
    rng = np.random.default_rng(seed)
    arrays = [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes]
  else:
    raise ValueError(f"source={source!r} is not one of: 'jax', 'numpy'")
  return tuple(x if c == 1.0 else x * c for x, c in zip(arrays, scales))


def assert_close(actual: Any, expected: Any, what: str = "", *, rtol: float = 2e-5,
                 atol: float = 2e-5) -> None:
  """``chex.assert_trees_all_close`` on two pytrees with the same leaves.

  One call compares outputs, states and every gradient: each leaf pair must
  satisfy ``|actual - expected| <= atol + rtol * |expected|`` (numpy's
  ``assert_allclose``). Leaves pair up in flattening order, so the containers
  may differ (a tuple against a list, a NamedTuple against a tuple) as long as
  the leaves do. The failure message names the leaf's path in ``actual`` and
  ends with ``[what]``.
  """
  named = jax.tree_util.tree_leaves_with_path(actual)
  leaves = jax.tree.leaves(expected)
  if len(named) != len(leaves):
    raise AssertionError(
        f"{what}: {len(named)} leaves in actual, {len(leaves)} in expected: "
        f"{[jax.tree_util.keystr(path) for path, _ in named]}")
  treedef = jax.tree.structure(actual)
  if jax.tree.structure(expected) != treedef:
    expected = jax.tree.unflatten(treedef, leaves)
  chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol, custom_message=what or None)


def preset_train_step(preset: str, variant: str, *, d_model: int, num_heads: int, seq_len: int,
                      batch_size: int, stats: bool | None = None):
  """``(step, state, rest)``: ``preset``'s real training step (optimizer included) for a
  one-layer model of the given size, keeping the preset's other options (dtype, dispatch,
  per-step statistics unless ``stats`` overrides them). Not jitted."""
  from flax import nnx

  from attnjax.train import optim
  from attnjax.train.config import apply_preset, base_config
  from attnjax.train.model import build_model
  from attnjax.train.step import make_train_step
  cfg = apply_preset(base_config(), preset)
  cfg.variant = variant
  cfg.model.update(d_model=d_model, num_layers=1, num_heads=num_heads, mlp_ratio=1)
  cfg.data.update(seq_len=seq_len, batch_size=batch_size)
  cfg.train.microbatches = 1
  model = build_model(cfg, 64, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optim.make_optimizer(cfg)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
           "initial_loss": jnp.zeros((), jnp.float32)}
  step = make_train_step(graphdef, opt, stats=cfg.train.step_stats if stats is None else stats)
  return step, state, rest
