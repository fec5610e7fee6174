"""Renamed :mod:`attnjax.nn.statistics` (*probe* names the training loop's statistics only).

Each name read here warns once and gives the same object (``layer_stats`` is
``attnjax.nn.layer_stats``); the deprecated alias ``probe`` is gone: reading it raises an
error naming ``attnjax.nn.layer_stats(model, tokens, length=64)``.
"""

from attnjax._src.old_names import nn_probe as __getattr__  # noqa: F401 (PEP 562)

__all__ = []
