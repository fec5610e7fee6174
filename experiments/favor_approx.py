"""Random-feature (FAVOR+ / trigonometric) approximation error of softmax attention vs features m.

    python experiments/favor_approx.py --config experiments/configs/favor_approx.py:preset=cpu

No training. Writes ``runs/favor_approx/results.json``, ``report.md`` (mean and
std of the error over draws, per map and m) and ``plots/favor_error.png``
(log-log, with a 1/sqrt(m) guide).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from attnjax import feature_maps, stats
from attnjax.train import cli, rundir
from attnjax.train.plots import save_figure, subplots
from attnjax.train.config import as_list

MAPS = {
  "favor_plus_orthogonal": lambda key, m, H: feature_maps.favor_plus(key, m, True, head_dim=H),
  "favor_plus_iid": lambda key, m, H: feature_maps.favor_plus(key, m, False, head_dim=H),
  "trig_iid": lambda key, m, H: feature_maps.trig_features(key, m, False, head_dim=H),
  "trig_orthogonal": lambda key, m, H: feature_maps.trig_features(key, m, True, head_dim=H),
}


def measure(cfg) -> dict:
  """``{map: {m: [error per draw]}}``: mean over heads of the relative Frobenius error."""
  for name in as_list(cfg.maps):
    if name not in MAPS:
      raise ValueError(f"maps: {name!r} is not one of: {', '.join(MAPS)}")
  ms = [int(m) for m in as_list(cfg.num_features)]
  if any(m < 1 for m in ms):
    raise ValueError(f"num_features must be positive ints, got {cfg.num_features!r}")
  kq, kk = jax.random.split(jax.random.key(cfg.seed))
  shape = (cfg.batch_size, cfg.seq_len, cfg.num_heads, cfg.head_dim)
  q = cfg.q_std * jax.random.normal(kq, shape)
  k = cfg.q_std * jax.random.normal(kk, shape)
  results: dict = {}
  for name in as_list(cfg.maps):
    results[name] = {}
    for m in ms:
      errors = []
      for draw in range(cfg.draws):
        fmap = MAPS[name](jax.random.key(1000 * draw + 1), m, cfg.head_dim)
        err = stats.feature_map_attention_error(q, k, feature_map=fmap, is_causal=True)
        errors.append(float(np.mean(np.asarray(err))))
      results[name][m] = errors
  return results


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__,
    "experiments/configs/favor_approx.py:preset=cpu",
    argv,
    default_out="runs/favor_approx",
    check=False,
    sweep=False,
  )
  t0 = time.perf_counter()
  results = measure(cfg)
  os.makedirs(args.out, exist_ok=True)
  rundir.write_json(os.path.join(args.out, "config.json"), cfg.to_dict())
  rundir.write_json(
    os.path.join(args.out, "results.json"),
    {n: {str(m): e for m, e in r.items()} for n, r in results.items()},
  )
  ms = sorted(next(iter(results.values())))
  fig, ax = subplots(figsize=(7, 4.5))
  for name, r in results.items():
    mean = [np.mean(r[m]) for m in ms]
    std = [np.std(r[m]) for m in ms]
    ax.errorbar(ms, mean, yerr=std, marker="o", capsize=3, label=name)
  ref = np.mean(results[next(iter(results))][ms[0]])
  ax.plot(ms, [ref * (ms[0] / m) ** 0.5 for m in ms], "k--", lw=0.8, label="1/sqrt(m)")
  ax.set(
    xscale="log",
    yscale="log",
    xlabel="random features m",
    ylabel="||A_hat - A||_F / ||A||_F",
    title=f"causal softmax, T={cfg.seq_len}, H={cfg.head_dim}",
  )
  ax.legend(fontsize=8)
  save_figure(fig, os.path.join(args.out, "plots", "favor_error.png"))
  lines = [
    f"# favor_approx ({cfg.preset})\n",
    f"Relative Frobenius error of random-feature attention vs exact causal softmax "
    f"(T={cfg.seq_len}, H={cfg.head_dim}, {cfg.num_heads} heads, q, k ~ N(0, "
    f"{cfg.q_std:g}^2)); mean +- std over {cfg.draws} draws of the features.\n",
    "| m | " + " | ".join(results) + " |",
    "|---:|" + "---:|" * len(results),
  ]
  for m in ms:
    lines.append(
      f"| {m} | "
      + " | ".join(f"{np.mean(r[m]):.4f} +- {np.std(r[m]):.4f}" for r in results.values())
      + " |"
    )
  slopes = {
    name: float(np.polyfit(np.log(ms), np.log([np.mean(r[m]) for m in ms]), 1)[0])
    for name, r in results.items()
  }
  lines.append(
    "\nLog-log slope of error vs m (1/sqrt(m) is -0.5): "
    + ", ".join(f"{n} {s:.2f}" for n, s in slopes.items())
    + "\n"
  )
  lines.append("![favor_error.png](plots/favor_error.png)\n")
  markdown = "\n".join(lines)
  path = os.path.join(args.out, "report.md")
  rundir.write_atomic(path, markdown)
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


if __name__ == "__main__":
  main()
