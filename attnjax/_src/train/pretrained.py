"""A trained model to evaluate: train (or resume, or reuse) one run, then load its last step.

The experiments that study a trained model after training (the decode caches of
``experiments/kv_cache.py``, the windowed decodes of ``experiments/streaming.py``)
start the same way::

    model, trainer = train_or_load(cfg, os.path.join(args.out, "train"))
    batch = trainer.batches.batch("heldout", 1, seq_len=..., batch_size=...)
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from attnjax._src.train.loop import Trainer, train


def train_or_load(cfg: Any, run_dir: str) -> tuple[nnx.Module, Trainer]:
  """Trains the run ``cfg`` describes in ``run_dir`` and returns its model at the last step.

  A run already finished there is reused and an interrupted one resumed
  (:func:`attnjax.train.train`). ``cfg`` is updated in place:
  ``cfg.run_dir = run_dir``, and ``train.checkpoint_every`` becomes
  ``train.steps`` unless it divides ``train.steps``, so the last step is saved.

  Args:
    cfg: a training config (``attnjax.train.load_config``).
    run_dir: the run directory to train in (or read).

  Returns:
    ``(model, trainer)``: the model with the parameters of step ``train.steps``,
    and the :class:`~attnjax.train.Trainer` that loaded it (its ``batches``
    give held-out data in the model's vocabulary).

  Raises:
    SystemExit: training ended ``diverged`` or ``stopped``: there is no trained
      model, and an entry point ends with this message.
    ValueError: ``run_dir`` holds no checkpoint of the last step.
  """
  cfg.run_dir = run_dir
  if cfg.train.checkpoint_every == 0 or cfg.train.steps % cfg.train.checkpoint_every:
    cfg.train.checkpoint_every = cfg.train.steps
  summary = train(cfg)
  if summary["status"] != "finished":
    raise SystemExit(f"training ended as {summary['status']}; nothing to evaluate")
  trainer = Trainer(cfg)
  if trainer.restore_latest() != cfg.train.steps:
    raise ValueError(
      f"{cfg.run_dir} has no checkpoint at the last step; set "
      f"train.checkpoint_every to a divisor of train.steps"
    )
  return trainer.model(), trainer
