"""Attention sinks of a pretrained checkpoint, per layer and head, from the fused attention pass.

    python experiments/pretrained.py --model path/to/checkpoint --text book.txt \\
        --config experiments/configs/pretrained.py:preset=cpu --out runs/pretrained

Loads the checkpoint with ``attnjax.models.from_pretrained`` (block-wise attention by
default, ``--config.implementation``; more options with ``--config.attention``), runs
each sequence of the text once through ``attnjax.nn.layer_stats(view="streaming")``, which
reads what the layers sow under ``nnx.capture``: the ``AttentionStats`` of the fused pass
(``sink_mass``, ``row_sum``, ``logsumexp``), every block's largest and median
``|hidden|``, and each layer's value-state drain. No ``T x T`` weights and no ``[T, V]``
logits are materialised: the perplexity takes the output logits of ``loss_chunk``
positions at a time from the final features.

Writes into ``--out``: ``config.json`` (the resolved config and the model's
``ModelConfig``), ``results.json`` (every number below), ``report.md`` and
``plots/`` (``sink_curve.png``, ``first_token.png``, ``value_drain.png``,
``activations.png``), all written atomically. Per layer and head: the first token's
importance alpha_1 and Sink_1^eps against eps (Gu et al. 2024; alpha_1 = (1 + (T - 1)
sink_mass) / T from the statistics), the first-token weight and F-Attn (Qiu et al.
2025), the null mass of sink logits (gpt-oss), the value-state drain ||v_1|| / mean
||v_j>1|| per key/value head (Guo et al. 2024); per layer the largest |hidden| and its
ratio to the median, M-Act (Sun et al. 2024); and the text's perplexity. A hybrid (Qwen3-Next,
Qwen3.5, Kimi Linear): the sink columns cover its softmax layers; each gated one adds its
gate's mean and the first token's mass before and after the gate, each recurrent layer its
mean decay and beta and the state norm after every token (``gate``, ``recurrence``).

An encoder (bert, roberta, modernbert) is read as ``[CLS] text [SEP]`` sequences instead:
per layer and head the attention mass on [CLS], [SEP] and the delimiters (``.``, ``,``),
and, with the tokenizer's mask token, the outliers of a 15%-masked batch per layer and its
masked-LM loss in float and under W8A8 fake quantisation (Bondarenko et al. 2023).
"""

from __future__ import annotations

import ast
import json
import math
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from attnjax import AttentionStats, data, models, nn, stats
from attnjax.train import cli, rundir
from attnjax.train.config import as_list, load_config, split_argv
from attnjax.train.plots import save_figure, subplots
from attnjax.train.report import significant

# Beside this script, so that it runs from any working directory.
DEFAULT_CONFIG = (
  os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "pretrained.py")
  + ":preset=cpu"
)


def parse(argv=None):
  """``(config, args)``: the shared ``--config`` / ``--out`` plus ``--model`` and ``--text``."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = cli.build_parser(__doc__, DEFAULT_CONFIG, "runs/pretrained", sweep=False)
  p.add_argument("--model", default=None, help="checkpoint directory (config.json + safetensors)")
  p.add_argument("--text", default=None, help="text file, or token ids (.npy / .bin)")
  try:
    spec, overrides, rest = split_argv(argv)
  except ValueError as e:
    p.error(str(e))
  args = p.parse_args(rest)
  try:
    cfg = load_config(spec or DEFAULT_CONFIG, overrides, check=False)
  except (ValueError, KeyError, FileNotFoundError) as e:
    p.error(str(e).strip("'\""))
  if args.model:
    cfg.model = args.model
  if args.text:
    cfg.text = args.text
  if not cfg.model:
    p.error("--model DIR (a checkpoint directory) is required")
  if not cfg.text:
    p.error("--text FILE (a text file or token ids, .npy / .bin) is required")
  return cfg, args


def attention_options(cfg, layer_types=None) -> dict:
  """``implementation`` and the ``key=value`` pairs of ``cfg.attention`` (values as literals).

  With ``layer_types`` (the checkpoint's, :meth:`attnjax.models.ARCHITECTURES` ``layer_types``)
  holding recurrent ``linear_attention`` layers (a hybrid), ``implementation`` names an
  engine of the softmax layers only: it goes to each other layer type
  (``attention={"full_attention": {"implementation": ...}}``); the recurrent layers keep
  their chunked default.
  """
  options = {} if not cfg.implementation else {"implementation": cfg.implementation}
  types = set(layer_types or ())
  if options and "linear_attention" in types:
    options = {t: dict(options) for t in sorted(types - {"linear_attention"})}
  for item in as_list(cfg.attention):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"attention: {item!r} is not key=value")
    try:
      options[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      options[key.strip()] = value.strip()
  return options


# ---------------------------------------------------------------------------
# Tokens.


def read_tokens(cfg, checkpoint: models.Checkpoint) -> np.ndarray:
  """The text's token ids (1-D int64): from ``.npy`` / ``.bin``, or through ``tokenizer.json``."""
  path = cfg.text
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--text {path!r} does not exist")
  if path.endswith(".npy"):
    ids = np.load(path)
  elif path.endswith(".bin"):
    ids = np.fromfile(path, dtype=np.dtype(cfg.bin_dtype))
  else:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    ids = np.asarray(models.tokenizer(checkpoint.path).encode(text).ids)
  ids = np.asarray(ids).reshape(-1)
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"--text {path!r}: token ids must be integers, got {ids.dtype}")
  vocab = checkpoint.config.get("vocab_size") or checkpoint.config.get("n_vocab")
  if vocab and ids.size and (ids.min() < 0 or ids.max() >= vocab):
    raise ValueError(
      f"--text {path!r}: token ids span [{ids.min()}, {ids.max()}], outside the "
      f"model's vocabulary of {vocab}"
    )
  return ids.astype(np.int64)


def sequences(ids: np.ndarray, cfg, bos) -> tuple[np.ndarray, np.ndarray]:
  """``(inputs, targets)`` ``[B, T]``: up to ``num_sequences`` consecutive chunks of the text.

  With BOS, chunk ``b`` of ``T`` text tokens is predicted from ``[BOS] + chunk[:-1]``
  (every text token once); without, ``inputs`` are ``T`` text tokens and ``targets``
  the ``T`` after them. A text shorter than one chunk gives one shorter sequence.
  """
  T = int(cfg.seq_len)
  if cfg.add_bos and bos is not None:
    n = min(int(cfg.num_sequences), len(ids) // T)
    if n == 0:
      n, T = 1, len(ids)
    if T < 1:
      raise ValueError("--text gives no tokens")
    chunks = np.asarray(ids[: n * T], np.int32).reshape(n, T)
    inputs = np.concatenate([np.full((n, 1), int(bos), np.int32), chunks[:, :-1]], axis=1)
    return inputs, chunks
  n = min(int(cfg.num_sequences), (len(ids) - 1) // T)
  if n == 0:
    n, T = 1, len(ids) - 1
  if T < 1:
    raise ValueError(f"--text gives {len(ids)} token(s): too few for one prediction")
  ids = np.asarray(ids, np.int32)
  return ids[: n * T].reshape(n, T), ids[1 : n * T + 1].reshape(n, T)


# The config keys that name a checkpoint's context length, in the order they are read.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


def warn_past_context(T: int, config: dict) -> bool:
  """Warns once (and returns True) when sequences of ``T`` tokens run past the checkpoint's
  context length (its config's :data:`CONTEXT_KEYS`): positions past it were never trained,
  so what is measured there is the model out of its range."""
  for key in CONTEXT_KEYS:
    length = config.get(key)
    if isinstance(length, int) and length > 0:
      if T <= length:
        return False
      warnings.warn(
        f"pretrained.py: sequences of T={T} tokens run past the checkpoint's context length "
        f"({key}={length}): positions past {length} were never trained, so the statistics "
        f"there describe the model out of its range; pass --config.seq_len={length} or less",
        stacklevel=2,
      )
      return True
  return False


# ---------------------------------------------------------------------------
# The measurement.


def measure(model: nn.TransformerLM, inputs: np.ndarray, targets: np.ndarray, cfg) -> dict:
  """Every statistic of the report over the sequences (one forward each), as lists/floats."""
  per_seq, nll = [], []
  for b in range(inputs.shape[0]):
    out = nn.layer_stats(model, jnp.asarray(inputs[b : b + 1]), view="streaming")
    features, layers = out["features"], out["layers"]
    nll.append(
      np.asarray(
        models.token_nll(
          model, features, jnp.asarray(targets[b : b + 1]), chunk=int(cfg.loss_chunk)
        )
      )
    )
    per_seq.append(jax.tree.map(np.asarray, layers))
  L = len(per_seq[0])
  # Every field of each layer over the sequences: per layer {field: [B, ...]} (each
  # sequence's fields have batch 1); a hybrid's layers sow different fields.
  per_layer = [
    {k: np.concatenate([seq[l][k] for seq in per_seq]) for k in per_seq[0][l]} for l in range(L)
  ]
  cat = {
    k: np.stack([per_layer[l][k] for l in range(L)])
    for k in per_layer[0]
    if all(k in layer for layer in per_layer)
  }
  # Sinks of the softmax layers: those that report a logsumexp (a hybrid's recurrent layers
  # have no softmax row; their sink_mass is of their implied weights). Per-layer sink
  # quantities are None for the others.
  sink_layers = [l for l in range(L) if "logsumexp" in per_layer[l]] or list(range(L))
  shared = [f for f in AttentionStats._fields if all(f in per_layer[l] for l in sink_layers)]
  layer_stats = [
    AttentionStats(**{f: jnp.asarray(per_layer[l][f]) for f in shared}) for l in sink_layers
  ]

  def every_layer(rows) -> list:
    """Rows of the sink layers as a list over all layers (None for the others)."""
    rows = dict(zip(sink_layers, np.asarray(rows).tolist()))
    return [rows.get(l) for l in range(L)]

  eps = [float(e) for e in as_list(cfg.sink_eps)]
  rates = [stats.sink_rate(layer_stats, eps=e) for e in eps]
  importance = np.asarray(stats.sink_rate(layer_stats, eps=0.3).importance)  # [L, B, N]
  f_attn = stats.first_token_attention(layer_stats)
  token_nll = np.concatenate(nll, axis=0)
  max_abs, median = cat["hidden_max_abs"], cat["hidden_median_abs"]  # [L, B]
  return {
    "tokens": int(inputs.shape[1]),
    "sequences": int(inputs.shape[0]),
    "perplexity": float(math.exp(float(token_nll.mean()))),
    "nll": float(token_nll.mean()),
    "sink_eps": eps,
    "sink_curve": [float(r.rate) for r in rates],
    "sink_layers": sink_layers,
    "sink_curve_per_layer": [every_layer(r.per_layer) for r in rates],  # [eps][L]
    "alpha_1": every_layer(importance.mean(axis=1)),  # [L, N]
    "first_token_weight": every_layer(f_attn.per_head),  # [L, N]
    "f_attn": float(f_attn.f_attn),
    "f_attn_per_layer": every_layer(f_attn.per_layer),
    "null_mass": every_layer([1.0 - per_layer[l]["row_sum"].mean(axis=0) for l in sink_layers]),
    "entropy": cat["entropy"].mean(axis=1).tolist(),  # [L, N]
    "max_logit": [  # [L, N]; None for a layer that defines none (a recurrent layer)
      layer["max_logit"].max(axis=0).tolist() if "max_logit" in layer else None
      for layer in per_layer
    ],
    "value_drain": cat["value_drain"].mean(axis=1).tolist(),  # [L, K]
    "hidden_max_abs": max_abs.max(axis=1).tolist(),  # [L]
    "hidden_max_over_median": (max_abs / np.maximum(median, 1e-30)).max(axis=1).tolist(),
    "m_act": float(max_abs.max(axis=1).mean()),
    "gate": [_gate_effect(layer) for layer in per_layer],
    "recurrence": [_recurrence(layer) for layer in per_layer],
  }


def _gate_effect(layer: dict):
  """A gated softmax layer's output gate, per head (means over the sequences): its mean, the
  first token's mass before it (``first_token_mass``: the weight on key 0, queries
  ``i >= 1``) and after it (``first_token_gated``: that weight times the query's mean
  gate), and their ratio; None for a layer without one."""
  if "first_token_gated" not in layer:
    return None
  before = layer["first_token_mass"].mean(axis=0)
  after = layer["first_token_gated"].mean(axis=0)
  return {
    "gate_mean": layer["gate_mean"].mean(axis=0).tolist(),
    "first_token_mass": before.tolist(),
    "first_token_gated": after.tolist(),
    "passed": (after / np.maximum(before, 1e-30)).tolist(),
  }


def _recurrence(layer: dict):
  """A recurrent layer's state statistics: per head the mean decay factor and write strength
  (None without one), and the state's Frobenius norm after each token (mean over heads and
  sequences, ``[T]``); None for a softmax layer."""
  if "state_norm" not in layer:
    return None
  mean = lambda k: layer[k].mean(axis=0).tolist() if k in layer else None
  return {
    "decay_mean": mean("decay_mean"),
    "beta_mean": mean("beta_mean"),
    "state_norm": layer["state_norm"].mean(axis=(0, 1)).tolist(),
  }


# ---------------------------------------------------------------------------
# Report.


def _row(xs, digits=2) -> str:
  return " ".join(f"{x:.{digits}f}" for x in xs)


def plots(results: dict, out_dir: str) -> list[str]:
  paths = []
  fig, ax = subplots(figsize=(6, 4))
  ax.plot(results["sink_eps"], results["sink_curve"], "o-", lw=1.2, label="all layers")
  for l in results["sink_layers"]:
    ax.plot(results["sink_eps"], [c[l] for c in results["sink_curve_per_layer"]], lw=0.6, alpha=0.6)
  ax.set(
    xlabel="eps",
    ylabel="Sink_1^eps (% of heads x sequences)",
    ylim=(-3, 103),
    title=f"Sink_1^eps (thin: each layer), T = {results['tokens']}",
  )
  ax.legend(fontsize=7)
  paths.append(os.path.join(out_dir, "sink_curve.png"))
  save_figure(fig, paths[-1])
  for name, key, label in (
    ("first_token", "first_token_weight", "first-token weight"),
    ("value_drain", "value_drain", "||v_1|| / mean ||v_j>1||"),
  ):
    a = np.asarray([row for row in results[key] if row is not None])
    fig, ax = subplots(figsize=(2 + 0.35 * a.shape[1], 1.5 + 0.3 * a.shape[0]))
    heatmap(fig, ax, a, label)
    ax.set(
      xlabel="head" if key == "first_token_weight" else "key/value head",
      ylabel="layer",
      title=label,
    )
    paths.append(os.path.join(out_dir, f"{name}.png"))
    save_figure(fig, paths[-1])
  fig, ax = subplots(figsize=(6, 3.5))
  ax.semilogy(results["hidden_max_abs"], "o-", label="max |hidden|")
  ax.semilogy(results["hidden_max_over_median"], "s-", label="max / median |hidden|")
  ax.set(xlabel="layer", title=f"massive activations (M-Act {results['m_act']:.1f})")
  ax.legend(fontsize=7)
  paths.append(os.path.join(out_dir, "activations.png"))
  save_figure(fig, paths[-1])
  return paths


def heatmap(fig, ax, a: np.ndarray, label: str):
  """``a`` [layers, heads] drawn from 0 to its own maximum, which the colour bar states.

  A fixed 0-1 range would leave a model without sinks (first-token weights near 1/T) black.
  """
  top = float(np.max(a)) if a.size and np.isfinite(a).all() else 1.0
  im = ax.imshow(a, aspect="auto", cmap="magma", vmin=0, vmax=top if top > 0 else 1.0)
  fig.colorbar(im, ax=ax, label=f"{label} (0 to max {significant(top, 3)})")
  return im


def report(results: dict, cfg, model_type: str, plot_paths: list, out: str) -> str:
  L = len(results["alpha_1"])
  lines = [
    f"# attention sinks of {os.path.basename(os.path.normpath(cfg.model))} ({model_type})\n",
    f"{results['sequences']} sequence(s) of T = {results['tokens']} tokens of "
    f"`{os.path.basename(cfg.text)}`; attention options {results['attention']}. "
    f"Statistics from the fused attention pass (no T x T weights).\n",
    f"- perplexity: **{results['perplexity']:.3f}** (mean NLL {results['nll']:.4f} nats)",
    f"- F-Attn (mean first-token weight, queries i >= 2): **{results['f_attn']:.3f}**",
    f"- Sink_1^0.3: **{_curve_at(results, 0.3)}** % of heads x sequences",
    f"- M-Act (mean over layers of max |hidden|): **{results['m_act']:.1f}**\n",
    "## Sink_1^eps against eps (% of heads x sequences)\n",
    "| eps | " + " | ".join(f"{e:g}" for e in results["sink_eps"]) + " |",
    "|---|" + "---:|" * len(results["sink_eps"]),
    "| all | " + " | ".join(f"{c:.0f}" for c in results["sink_curve"]) + " |",
  ]
  for l in results["sink_layers"]:
    lines.append(
      f"| layer {l} | " + " | ".join(f"{c[l]:.0f}" for c in results["sink_curve_per_layer"]) + " |"
    )
  lines += [
    "\n## Per layer and head\n",
    "alpha_1: the first token's importance (Gu et al.); first-token weight: mean over "
    "queries i >= 2 (F-Attn per head, rows renormalised); null mass: weight sent to "
    "sink logits (gpt-oss; 0 otherwise); value drain per key/value head (< 1: the "
    "first token's value is small); max / median |hidden| of the block's output. A "
    "hybrid's recurrent layers have no softmax rows: '-' for their sink columns.\n",
    "| layer | F-Attn | alpha_1 per head | first-token weight per head | null mass per "
    "head | value drain per kv head | max abs hidden | max / median |",
    "|---:|---:|---|---|---|---|---:|---:|",
  ]
  for l in range(L):
    sinks = results["alpha_1"][l] is not None
    f_attn = f"{results['f_attn_per_layer'][l]:.3f}" if sinks else "-"
    lines.append(
      f"| {l} | {f_attn} | "
      f"{_row(results['alpha_1'][l]) if sinks else '-'} | "
      f"{_row(results['first_token_weight'][l]) if sinks else '-'} | "
      f"{' '.join(significant(x) for x in results['null_mass'][l]) if sinks else '-'} | "
      f"{_row(results['value_drain'][l])} | {results['hidden_max_abs'][l]:.1f} | "
      f"{results['hidden_max_over_median'][l]:.0f} |"
    )
  lines += _hybrid_sections(results)
  lines.append(
    "\n"
    + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, out)})" for p in plot_paths)
    + "\n"
  )
  return "\n".join(lines)


def _hybrid_sections(results: dict) -> list[str]:
  """The output gates' effect and the recurrent layers' state (where the model has them)."""
  lines = []
  gated = [(l, g) for l, g in enumerate(results.get("gate", [])) if g is not None]
  if gated:
    lines += [
      "\n## Output gates\n",
      "Per head: the gate's mean; the first token's mass (weight on key 0, queries "
      "i >= 1) before the gate and after it (times the query's mean gate); after / before.\n",
      "| layer | gate mean | first-token mass | after the gate | passed |",
      "|---:|---|---|---|---|",
    ]
    for l, g in gated:
      lines.append(
        f"| {l} | {_row(g['gate_mean'])} | {_row(g['first_token_mass'], 3)} | "
        f"{_row(g['first_token_gated'], 3)} | {_row(g['passed'])} |"
      )
  rec = [(l, r) for l, r in enumerate(results.get("recurrence", [])) if r is not None]
  if rec:
    T = len(rec[0][1]["state_norm"])
    marks = sorted({max(1, T * q // 4) - 1 for q in (1, 2, 3, 4)})
    lines += [
      "\n## Recurrent layers\n",
      "Per head: the mean decay factor exp(g) and write strength beta; the state's "
      "Frobenius norm ||S_t|| (mean over heads) after tokens "
      + ", ".join(str(t + 1) for t in marks)
      + ".\n",
      "| layer | decay mean | beta mean | state norm |",
      "|---:|---|---|---|",
    ]
    for l, r in rec:
      beta = "-" if r["beta_mean"] is None else _row(r["beta_mean"])
      decay = "-" if r["decay_mean"] is None else _row(r["decay_mean"])
      norms = " ".join(significant(r["state_norm"][t], 3) for t in marks)
      lines.append(f"| {l} | {decay} | {beta} | {norms} |")
  return lines


def _curve_at(results: dict, eps: float) -> str:
  for e, c in zip(results["sink_eps"], results["sink_curve"]):
    if abs(e - eps) < 1e-9:
      return f"{c:.0f}"
  return "-"


# ---------------------------------------------------------------------------
# Encoders (bert, roberta, modernbert): where the heads put their mass.


def tokenizer_vocab(path: str) -> dict:
  """``{token: id}`` of a checkpoint's ``tokenizer.json`` (its vocabulary and added tokens),
  read as JSON (no ``tokenizers`` package needed); ``{}`` without one."""
  file = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(file):
    return {}
  with open(file, encoding="utf-8") as f:
    spec = json.load(f)
  model_vocab = (spec.get("model") or {}).get("vocab") or {}
  vocab = dict(model_vocab) if isinstance(model_vocab, dict) else {}
  for added in spec.get("added_tokens") or []:
    vocab[added["content"]] = int(added["id"])
  return vocab


def encoder_special_ids(checkpoint: models.Checkpoint) -> dict:
  """``{"cls", "sep", "mask": id or None, "delimiters": (ids of ".", ",")}`` of a checkpoint:
  from ``config.json`` (``cls_token_id`` / ``bos_token_id``, ``sep_token_id`` /
  ``eos_token_id``) and its ``tokenizer.json`` (``[CLS]``, ``<s>``, ``[MASK]``, ``.``, ...,
  when present)."""
  c = checkpoint.config
  vocab = tokenizer_vocab(checkpoint.path)

  def first(*candidates):
    for x in candidates:
      if isinstance(x, int) and not isinstance(x, bool):
        return x
    return None

  def named(*tokens):
    return first(*(vocab.get(t) for t in tokens))

  delimiters = tuple(vocab[t] for t in (".", ",") if t in vocab)
  return {
    "cls": first(c.get("cls_token_id"), named("[CLS]", "<s>", "<cls>"), c.get("bos_token_id")),
    "sep": first(c.get("sep_token_id"), named("[SEP]", "</s>", "<sep>"), c.get("eos_token_id")),
    "mask": named("[MASK]", "<mask>"),
    "delimiters": tuple(delimiters),
  }


def encoder_sequences(ids: np.ndarray, cfg, special: dict, limit: int) -> np.ndarray:
  """``[n, T]`` sequences ``[CLS] chunk [SEP]`` of consecutive chunks of the text."""
  T = min(int(cfg.seq_len), limit)
  body = T - (special["cls"] is not None) - (special["sep"] is not None)
  n = max(1, min(int(cfg.num_sequences), len(ids) // max(body, 1)))
  body = min(body, len(ids))
  rows = []
  for b in range(n):
    row = [int(i) for i in ids[b * body : (b + 1) * body]]
    if special["cls"] is not None:
      row = [special["cls"]] + row
    if special["sep"] is not None:
      row = row + [special["sep"]]
    rows.append(row)
  return np.asarray(rows, np.int32)


def measure_encoder(model, tokens: np.ndarray, special: dict, cfg) -> dict:
  """Per layer and head the mass on [CLS], [SEP] and delimiters (``stats.token_mass`` of the
  sown weights, every query); per layer the outliers; the masked-LM loss, float and W8A8."""
  masses = {"cls": [], "sep": [], "delimiters": []}
  for b in range(tokens.shape[0]):
    row = jnp.asarray(tokens[b : b + 1])
    sown = nn.layer_stats(model, row, view="sown", weights=True)
    weights = jnp.stack([layer["weights"] for layer in sown["layers"]])  # [L, 1, N, T, S]
    for name in masses:
      ids = special[name] if name == "delimiters" else (special[name],)
      ids = tuple(i for i in ids if i is not None)
      mass = stats.token_mass(weights, row, ids) if ids else jnp.full(weights.shape[:3], jnp.nan)
      masses[name].append(np.asarray(mass)[:, 0])  # [L, N]
  results = {
    "tokens": int(tokens.shape[1]),
    "sequences": int(tokens.shape[0]),
    "special_ids": {k: (list(v) if isinstance(v, tuple) else v) for k, v in special.items()},
  }
  for name, values in masses.items():
    results[f"{name}_mass"] = np.mean(values, axis=0).tolist()  # [L, N]
  if special["mask"] is not None:
    inputs, weights = data.mask_tokens(
      tokens,
      np.random.default_rng(0),
      rate=0.15,
      mask_id=special["mask"],
      vocab_size=model.config.vocab_size,
    )
    if special["sep"] is not None:  # [SEP] stays itself
      keep = tokens == special["sep"]
      inputs, weights = np.where(keep, tokens, inputs), np.where(keep, 0.0, weights)
    targets = np.where(weights > 0, tokens, -1)
    out = nn.outlier_stats(model, inputs, targets=targets, delimiter_ids=special["delimiters"])
    results["mlm_loss"] = float(out["loss"])
    results["mlm_loss_w8a8"] = float(out["loss_w8a8"])
    for position in ("attn_out", "mlp_out", "hidden"):
      if position in out:
        results[f"outliers_{position}"] = {
          k: np.asarray(v).tolist() for k, v in out[position]._asdict().items()
        }
  return results


def encoder_report(results: dict, cfg, model_type: str, out: str) -> str:
  L = len(results["cls_mass"])
  lines = [
    f"# attention sinks of {os.path.basename(os.path.normpath(cfg.model))} ({model_type}, "
    f"an encoder)\n",
    f"{results['sequences']} sequence(s) of T = {results['tokens']} tokens "
    f"(`[CLS] text [SEP]`) of `{os.path.basename(cfg.text)}`; special ids "
    f"{results['special_ids']}. The mass of a head on a set of tokens: the mean over "
    f"every query of the attention weight on those keys (Clark et al. 2019).\n",
  ]
  if "mlm_loss" in results:
    lines += [
      f"- masked-LM loss (15% masked, seed 0): **{results['mlm_loss']:.4f}** in float, "
      f"**{results['mlm_loss_w8a8']:.4f}** with W8A8 fake quantisation\n"
    ]
  lines += [
    "## Mass per layer and head\n",
    "| layer | on [CLS] per head | on [SEP] per head | on delimiters per head |",
    "|---:|---|---|---|",
  ]
  for l in range(L):
    lines.append(
      f"| {l} | {_row(results['cls_mass'][l])} | {_row(results['sep_mass'][l])} | "
      f"{_row(results['delimiters_mass'][l])} |"
    )
  if "outliers_hidden" in results:
    lines += [
      "\n## Outliers per layer (Bondarenko et al. 2023)\n",
      "Of the masked batch: max |x| (token, dim) of the attention output, MLP output and "
      "residual stream; token kurtosis and the share of the 100 largest residual entries at "
      "delimiters and at the first token.\n",
      "| layer | attn out max | MLP out max | residual max (token, dim) | kurtosis | at "
      "delimiters | at [CLS] |",
      "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    h = results["outliers_hidden"]
    a = results.get("outliers_attn_out", {})
    m = results.get("outliers_mlp_out", {})
    for l in range(L):
      lines.append(
        f"| {l} | {a['max_inf_norm'][l]:.2f} | "
        f"{m['max_inf_norm'][l] if m else float('nan'):.2f} | {h['max_inf_norm'][l]:.2f} "
        f"({h['max_token'][l]}, {h['max_dim'][l]}) | {h['kurtosis'][l]:.2f} | "
        f"{h['delimiter_share'][l]:.2f} | {h['first_token_share'][l]:.2f} |"
      )
  return "\n".join(lines) + "\n"


def main(argv=None) -> str:
  cfg, args = parse(argv)
  t0 = time.perf_counter()
  # The user's inputs are read before the weights: a missing file or package ends in one line
  # saying what to do, not a traceback.
  try:
    checkpoint = models.Checkpoint(cfg.model)
    ids = read_tokens(cfg, checkpoint)
  except (models.CheckpointError, FileNotFoundError, ImportError, ValueError) as e:
    raise SystemExit(f"pretrained.py: error: {e}") from None
  model_type = checkpoint.config.get("model_type")
  arch = models.ARCHITECTURES.get(model_type)
  layer_types = None if arch is None else arch.layer_types(checkpoint.config)
  model = models.from_pretrained(
    cfg.model, dtype=cfg.dtype or None, attention=attention_options(cfg, layer_types)
  )
  if isinstance(model, nn.EncoderLM):
    special = encoder_special_ids(checkpoint)
    limit = checkpoint.config.get("max_position_embeddings") or int(cfg.seq_len)
    if model.config.position_offset is not None:
      limit -= model.config.position_offset
    results = measure_encoder(model, encoder_sequences(ids, cfg, special, limit), special, cfg)
    rundir.write_json(os.path.join(args.out, "results.json"), results)
    markdown = encoder_report(results, cfg, checkpoint.config.get("model_type"), args.out)
    return _finish(args.out, markdown, t0)
  bos = checkpoint.config.get("bos_token_id")
  inputs, targets = sequences(ids, cfg, bos if isinstance(bos, int) else None)
  warn_past_context(inputs.shape[1], checkpoint.config)
  results = measure(model, inputs, targets, cfg)
  results["attention"] = attention_options(cfg, layer_types)
  out = args.out
  rundir.write_json(
    os.path.join(out, "config.json"),
    {
      "experiment": cfg.to_dict(),
      "model_config": model.config.to_dict(),
      "model_type": checkpoint.config.get("model_type"),
    },
  )
  rundir.write_json(os.path.join(out, "results.json"), results)
  paths = plots(results, os.path.join(out, "plots"))
  markdown = report(results, cfg, checkpoint.config.get("model_type"), paths, out)
  return _finish(out, markdown, t0)


def _finish(out: str, markdown: str, t0: float) -> str:
  """Writes ``out/report.md``, prints it and the wall time; returns the markdown."""
  path = os.path.join(out, "report.md")
  rundir.write_atomic(path, markdown)
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


if __name__ == "__main__":
  main()
