"""Start several local processes of one command under ``jax.distributed`` (multi-process on a host).

Implementation behind the public module :mod:`attnjax.train.launch`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence


def free_port() -> int:
  """A TCP port of 127.0.0.1 that is free now (for the coordinator).

  Returns:
    The port number.
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def environments(processes: int, devices: int, port: int, platform: str) -> list[dict]:
  """The environment of each process: this one's, plus jax.distributed's coordinates.

  Args:
    processes: ``P``.
    devices: devices per process (``JAX_NUM_CPU_DEVICES`` on the CPU).
    port: the coordinator's port on 127.0.0.1.
    platform: ``"cpu"`` sets the CPU device count (and drops XLA's host-device flag);
      other platforms keep the environment's devices.

  Returns:
    ``P`` dicts, process ``i``'s with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID=i``.
  """
  envs = []
  for i in range(processes):
    env = dict(
      os.environ,
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES=str(processes),
      JAX_PROCESS_ID=str(i),
    )
    if platform == "cpu":
      env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
      # XLA's own host device count would override JAX_NUM_CPU_DEVICES.
      flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
      ]
      env["XLA_FLAGS"] = " ".join(flags)
    envs.append(env)
  return envs


def _pump(i: int, stream, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(f"[p{i}] {line}")
    out.flush()


def launch(
  command: Sequence[str],
  processes: int,
  devices: int,
  *,
  port: Optional[int] = None,
  platform: str = "cpu",
) -> int:
  """Runs ``command`` in ``processes`` local processes under ``jax.distributed``.

  Their output is interleaved on stdout, each line prefixed ``[p<i>]``. When one process
  fails the others are terminated, so a killed or crashed process stops the run.

  Args:
    command: the program and its arguments, e.g. ``["python", "experiments/train.py", ...]``.
    processes: ``P``.
    devices: devices per process.
    port: the coordinator's port (default: a free one).
    platform: ``"cpu"`` (forced host devices) or the platform of the processes' devices.

  Returns:
    The first failing exit status, or 0.

  Raises:
    ValueError: ``processes`` or ``devices`` below 1, or an empty command.
  """
  if processes < 1 or devices < 1:
    raise ValueError(f"--processes={processes} and --devices-per-process={devices} must be >= 1")
  if not command:
    raise ValueError("no command to launch (put it after --)")
  port = port or free_port()
  procs, pumps = [], []
  for i, env in enumerate(environments(processes, devices, port, platform)):
    p = subprocess.Popen(
      list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    t = threading.Thread(target=_pump, args=(i, p.stdout, sys.stdout), daemon=True)
    t.start()
    procs.append(p)
    pumps.append(t)
  status = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed:
        status = failed[0]
        for p in procs:
          if p.poll() is None:
            p.terminate()
        break
      time.sleep(0.2)
    for p in procs:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for t in pumps:
    t.join(timeout=5)
  return status or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m attnjax.train.launch --processes P --devices-per-process D -- <command>``.

  Args:
    argv: the arguments (default ``sys.argv[1:]``).

  Returns:
    The exit status (2 for a usage error).
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" not in argv:
    print(
      "usage: python -m attnjax.train.launch --processes P --devices-per-process D -- <command>",
      file=sys.stderr,
    )
    return 2
  cut = argv.index("--")
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--processes", type=int, required=True)
  p.add_argument("--devices-per-process", type=int, default=1)
  p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  p.add_argument(
    "--platform",
    default="cpu",
    help="cpu (local test runs: JAX_NUM_CPU_DEVICES, gloo) or anything else to "
    "leave the processes' platform alone",
  )
  args = p.parse_args(argv[:cut])
  return launch(
    argv[cut + 1 :],
    args.processes,
    args.devices_per_process,
    port=args.port,
    platform=args.platform,
  )
