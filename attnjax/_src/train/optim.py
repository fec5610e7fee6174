"""AdamW with warmup + cosine decay, global-norm clipping and independent weight decay.

Independent weight decay (Loshchilov & Hutter 2019; Wortsman et al. 2023,
sec. 3.2.2): the parameter shrinks by ``weight_decay * s_t * p`` per step,
where ``s_t = lr_t / lr_peak`` is the schedule's shape in [0, 1]. The decay
therefore does NOT scale with the peak learning rate, unlike optax.adamw,
whose decay is ``lr_t * weight_decay * p`` and so grows 1000x across an LR
sweep from 1e-3 to 1.0. It is built from optax pieces as
``add_decayed_weights(weight_decay / lr_peak)`` placed before
``scale_by_learning_rate(schedule)``, which multiplies it back by ``lr_t``.
Only matrices (rank >= 2: projections, embeddings) are decayed; gains,
biases, temperatures and sink logits are not.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def schedule(cfg: Any) -> optax.Schedule:
  """The learning-rate schedule of a run.

  Linear warmup from 0 over ``opt.warmup_frac * train.steps`` steps to ``opt.lr``, then
  cosine decay to ``opt.lr * opt.min_lr_frac`` at ``train.steps``.

  Args:
    cfg: a run config (``cfg.opt`` and ``cfg.train.steps`` are read).

  Returns:
    An ``optax`` schedule: step -> learning rate.
  """
  steps = int(cfg.train.steps)
  warmup = int(round(cfg.opt.warmup_frac * steps))
  lr = float(cfg.opt.lr)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=warmup,
    decay_steps=max(steps, warmup + 1),
    end_value=lr * float(cfg.opt.min_lr_frac),
  )


def decay_mask(params: Any) -> Any:
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(cfg: Any) -> optax.GradientTransformation:
  """The optimizer of ``cfg.opt``: clipping, Adam, independent weight decay, the schedule.

  Global-norm clipping at ``opt.clip`` (0: none), Adam (``b1``, ``b2``, ``eps``), weight
  decay on matrices only with coefficient ``opt.weight_decay / opt.lr`` before the
  learning rate, so that the decay per step is independent of the peak LR (the module
  docstring), and :func:`.schedule`.

  Args:
    cfg: a run config.

  Returns:
    An ``optax.GradientTransformation``.
  """
  o = cfg.opt
  parts = []
  if o.clip > 0:
    parts.append(optax.clip_by_global_norm(float(o.clip)))
  parts.append(optax.scale_by_adam(b1=float(o.b1), b2=float(o.b2), eps=float(o.eps)))
  if o.weight_decay > 0:
    parts.append(optax.add_decayed_weights(float(o.weight_decay) / float(o.lr), mask=decay_mask))
  parts.append(optax.scale_by_learning_rate(schedule(cfg)))
  return optax.chain(*parts)
