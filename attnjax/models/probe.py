"""Renamed: :func:`attnjax.models.token_nll` (*probe* names the training loop's statistics only).

``token_nll`` read here warns once and gives ``attnjax.models.token_nll``;
``layer_statistics`` is the deprecated alias of ``attnjax.nn.layer_stats(model, tokens,
view="streaming")`` it always was.
"""

from attnjax._src.old_names import models_probe as __getattr__  # noqa: F401 (PEP 562)

__all__ = []
