"""``AttentionStats``: what one attention call reports about itself.

Every family returns the same pytree with ``return_stats=True``. Fields a family
cannot define are ``None``. All fields are float32 and finite, including for
rows with no allowed key (those rows are left out of the means).

Shapes: per (batch, query head) ``[B, N]``, except ``logsumexp`` which is per
query row ``[B, N, T]`` because that is the quantity with a use of its own
(merging partial attentions, a z-loss on attention logits); it carries a real
gradient, unlike the stop-gradient residual of ``jax.nn.dot_product_attention``.
"""

from attnjax._src.attention_stats import AttentionStats, stats_from_weights

__all__ = ["AttentionStats", "stats_from_weights"]
