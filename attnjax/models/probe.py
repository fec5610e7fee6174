"""A long sequence's perplexity in O(T) memory: :func:`token_nll` from the final features.

The sink statistics of the same pass, nothing ``T x T`` (the fused
:class:`~attnjax.AttentionStats`, value-state drain and ``|hidden|`` per layer),
are ``attnjax.nn.layer_stats(model, tokens, view="streaming")``, which also
returns the features :func:`token_nll` reads; :func:`layer_statistics` is its
deprecated alias. ``experiments/pretrained.py`` and the ``pretrained`` suite of
``experiments/bench.py`` run both.
"""

from attnjax._src.models.probe import layer_statistics, token_nll

__all__ = ["layer_statistics", "token_nll"]
