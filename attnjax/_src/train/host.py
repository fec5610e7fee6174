"""The machine a sweep ran on and its load while it ran, for the design block of its report.

:class:`HostMonitor` samples the load average in a thread during a sweep and appends one
session (CPU, cores, devices, wall and CPU seconds, load samples) to ``<root>/host.json``;
:func:`load_note` says in words how loaded the host was and whether the load changed.
"""

from __future__ import annotations

import os
import platform
import resource
import threading
import time
from typing import Optional

from attnjax._src.train import rundir

HOST_FILE = "host.json"
# The load changed during a session when its 1-minute load average moved by more than this
# many runnable processes per core (and by half of its smallest value).
LOAD_CHANGE_PER_CORE = 0.5


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_seconds() -> float:
  """User + system CPU seconds of this process and its finished children."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def current_load() -> Optional[float]:
  """The 1-minute load average, or None where the platform has none."""
  try:
    return float(os.getloadavg()[0])
  except (OSError, AttributeError):
    return None


class HostMonitor:
  """Samples the 1-minute load average every ``every`` seconds while the ``with`` block runs.

  On exit one session is appended to ``<root>/host.json`` (``{"sessions": [...]}``): the CPU
  model, cores, jax devices and version, start and end time, wall and CPU seconds (user +
  system, this process and its children) and the load samples ``[[seconds from start, load],
  ...]``.

  Args:
    root: the sweep's folder.
    every: seconds between samples.
  """

  def __init__(self, root: str, every: float = 5.0):
    self.root = root
    self.every = every
    self.samples: list[list[float]] = []
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def _sample(self) -> None:
    load = current_load()
    if load is not None:
      self.samples.append([round(time.perf_counter() - self._t0, 1), load])

  def _run(self) -> None:
    while not self._stop.wait(self.every):
      self._sample()

  def __enter__(self) -> "HostMonitor":
    self._t0 = time.perf_counter()
    self._cpu0 = _cpu_seconds()
    self._started = time.strftime("%Y-%m-%d %H:%M:%S")
    self._sample()
    self._thread = threading.Thread(target=self._run, name="attnjax-host-monitor", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    self._sample()
    self.append(self.session())

  def session(self) -> dict:
    """This session's record (as appended to ``host.json``)."""
    import jax

    devices = jax.devices()
    return {
      "started": self._started,
      "ended": time.strftime("%Y-%m-%d %H:%M:%S"),
      "cpu_model": cpu_model(),
      "cores": os.cpu_count(),
      "devices": f"{len(devices)} x {devices[0].device_kind}" if devices else "none",
      "platform": devices[0].platform if devices else "none",
      "jax": jax.__version__,
      "wall_s": time.perf_counter() - self._t0,
      "cpu_s": _cpu_seconds() - self._cpu0,
      "load": self.samples,
    }

  def append(self, session: dict) -> None:
    path = os.path.join(self.root, HOST_FILE)
    record = rundir.read_json(path) or {}
    record.setdefault("sessions", []).append(session)
    rundir.write_json(path, record)


def read_host(root: str) -> list[dict]:
  """The sessions recorded in ``<root>/host.json`` (an empty list when there is none)."""
  return (rundir.read_json(os.path.join(root, HOST_FILE)) or {}).get("sessions", [])


def load_note(session: dict) -> tuple[str, bool]:
  """``(words, changed)``: the session's load average (start, range, end) and whether it
  changed by more than :data:`LOAD_CHANGE_PER_CORE` per core and half its smallest value."""
  loads = [s[1] for s in session.get("load") or []]
  if not loads:
    return "load not measured", False
  cores = session.get("cores") or 1
  lo, hi = min(loads), max(loads)
  changed = hi - lo > max(LOAD_CHANGE_PER_CORE * cores, 0.5 * lo)
  words = (
    f"1-minute load average {loads[0]:.1f} at the start, {lo:.1f}-{hi:.1f} over "
    f"{len(loads)} samples, {loads[-1]:.1f} at the end ({hi / cores:.1f} per core at most)"
  )
  return words, changed


def describe(sessions: list[dict]) -> list[tuple[str, str]]:
  """Design-block items ``(label, words)`` for the machine and each session's wall time,
  CPU time and load."""
  if not sessions:
    return [("machine", "not recorded (the runs were trained before host.json existed)")]
  s = sessions[-1]
  out = [("machine", f"{s['cpu_model']}, {s['cores']} cores; jax {s['jax']} on {s['devices']}")]
  for i, session in enumerate(sessions):
    words, changed = load_note(session)
    label = "this run" if len(sessions) == 1 else f"session {i + 1} of {len(sessions)}"
    cores = session.get("cores") or 1
    out.append(
      (
        label,
        f"{session['started']} to {session['ended']}, wall {session['wall_s']:.0f} s, "
        f"CPU {session['cpu_s']:.0f} s (user + system; / {cores} cores = "
        f"{session['cpu_s'] / cores:.0f} s); {words}"
        + (
          "; **the load changed during the run**: wall times and throughput are not "
          "comparable across arms"
          if changed
          else ""
        ),
      )
    )
  return out
