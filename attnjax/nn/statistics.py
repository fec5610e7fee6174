"""Statistics per layer of an ``attnjax.nn.TransformerLM``: :func:`attnjax.nn.layer_stats`.

One forward pass on a fixed batch, seen as one of :data:`VIEWS`: ``"summary"`` (every
statistic of ``attnjax.stats`` over the layers), ``"sown"``, ``"streaming"``, ``"capture"``:

>>> import jax
>>> from flax import nnx
>>> from attnjax import nn
>>> model = nn.TransformerLM(nn.ModelConfig(vocab_size=64, num_layers=2), rngs=nnx.Rngs(0))
>>> out = nn.layer_stats(model, jax.random.randint(jax.random.key(2), (2, 16), 0, 64))
>>> len(out["f_attn/per_layer"])
2
"""

from attnjax._src.nn.statistics import VIEWS, layer_stats

__all__ = ["VIEWS", "layer_stats"]
