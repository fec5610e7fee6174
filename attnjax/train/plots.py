"""PNG plots of one run directory (loss, max logit per layer, F-Attn, log Z)."""

from attnjax._src.train.plots import per_layer_series, plot_run, save_figure, subplots

__all__ = ["per_layer_series", "plot_run", "save_figure", "subplots"]
