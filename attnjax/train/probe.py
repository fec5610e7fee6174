"""Gone: the training loop runs its probes with ``attnjax.nn.layer_stats`` itself.

``run_probe`` read here raises an error naming what replaces it,
``attnjax.stats.to_jsonable(attnjax.nn.layer_stats(model, inputs))``.
"""

from attnjax._src.old_names import train_probe as __getattr__  # noqa: F401 (PEP 562)

__all__ = []
