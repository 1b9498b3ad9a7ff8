"""Multi-process serving under jax.distributed: joining the job, and the per-step channel from process 0 to all.

`ProcessGroup.exchange` is the one broadcast that the lockstep protocol (lockstep.py: why every process must make
the same engine calls, and what process 0 decides for all) runs at the start of every scheduler step.

Cost: one `multihost_utils.broadcast_one_to_all` of a fixed HEADER_BYTES buffer per step (a second one, sized to
a power of two, only when a step's news does not fit: long prompts); benchmarks/bench_multihost.py measures it.
CPU collectives are gloo (jax 0.10's default `jax_cpu_collectives_implementation`), so this runs on one machine
with processes on 127.0.0.1, as the tests do.

A dead process: a collective with it fails at once on the processes it was connected to (the socket closes),
which the scheduler sees as DistributedError (from `exchange`, or from a step: lockstep.py), failing every open
request. JAX's own distributed client then terminates a process whose coordinator (process 0) is gone at once,
and process 0 when a peer's heartbeat has been missing for `heartbeat_timeout_s`, so no process outlives a dead
peer by more than that.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..engine.plan import bucket
from ..errors import ConfigError, DistributedError

# The variables `initialize` reads when an argument is not given (JAX itself reads the first one too).
ENVIRONMENT = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}
HEADER_BYTES = 1024  # one step's news (a few short prompts, cancellations) fits: one broadcast per step
LENGTH_BYTES = 4  # the header's first bytes: the payload's length, little-endian


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, heartbeat_timeout_s: int = 100, environ: Mapping[str, str] | None = None) -> bool:
    """Join a multi-process job (jax.distributed.initialize) before anything else uses JAX; True when it did.

    Arguments not given come from JAX_COORDINATOR_ADDRESS (HOST:PORT of process 0), JAX_NUM_PROCESSES and
    JAX_PROCESS_ID. With none of them set (or num_processes 1) this is a single-process run and nothing happens.
    Afterwards jax.devices() lists every process's devices and jax.local_devices() this process's.
    """
    env = os.environ if environ is None else environ
    coordinator = coordinator or env.get(ENVIRONMENT["coordinator"]) or None
    num_processes = num_processes if num_processes is not None else _int_env(env, "num_processes")
    process_id = process_id if process_id is not None else _int_env(env, "process_id")
    if num_processes is None and process_id is None and coordinator is None:
        return False
    if num_processes == 1 and process_id in (None, 0):
        return False
    if coordinator is None or num_processes is None or process_id is None:
        raise ConfigError("a multi-process job needs the coordinator (HOST:PORT of process 0), the number of processes "
                          f"and this process's id, got coordinator={coordinator!r}, num_processes={num_processes!r}, "
                          f"process_id={process_id!r} (flags --coordinator/--num-processes/--process-id or "
                          f"{', '.join(ENVIRONMENT.values())})")
    if not isinstance(num_processes, int) or num_processes < 1 or not isinstance(process_id, int) \
            or not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id must be in [0, num_processes), got process_id={process_id!r}, "
                          f"num_processes={num_processes!r}")
    if ":" not in coordinator:
        raise ConfigError(f"coordinator must be HOST:PORT, got {coordinator!r}")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)
    except RuntimeError as error:  # e.g. JAX already ran a computation, or initialize was called twice
        raise ConfigError(f"cannot join the job at {coordinator}: {error}") from error
    return True


def _int_env(env: Mapping[str, str], key: str) -> int | None:
    name = ENVIRONMENT[key]
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def default_mesh(tp: int):
    """The mesh a multi-process LLM uses: ("dp", "tp") over every process's devices, tp devices per replica.

    make_mesh orders devices by process, so tp = jax.local_device_count() keeps each replica inside one host;
    a tp that spans processes (tp=2 over two 1-device processes) also works, with its all-reduces over the network.
    """
    from ..model.sharding import make_mesh

    devices = jax.device_count()
    if devices % tp:
        raise ConfigError(f"tp={tp} does not divide the job's {devices} devices ({jax.process_count()} processes)")
    return make_mesh(tp=tp, dp=devices // tp)


@dataclass
class ProcessGroup:
    """This process's place in a multi-process job, and the per-step channel from process 0 to every process.

    Counters (exchanges, bytes, seconds) let a benchmark report what the coordination costs per step.
    """

    process_id: int
    num_processes: int
    exchanges: int = 0
    bytes: int = 0  # payload bytes broadcast (each exchange also moves one HEADER_BYTES buffer)
    seconds: float = 0.0

    @classmethod
    def current(cls) -> ProcessGroup | None:
        """The group of this job, or None in a single-process run."""
        if jax.process_count() == 1:
            return None
        return cls(jax.process_index(), jax.process_count())

    @property
    def leader(self) -> bool:
        """True on process 0, which takes requests and whose decisions every process follows."""
        return self.process_id == 0

    def exchange(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """Process 0's `message` (a JSON-able dict; {} for a step with no news), on every process.

        Every process must call it at the same point of the same step; followers pass None. Raises
        DistributedError when another process is gone.
        """
        start = time.perf_counter()
        payload = json.dumps(message, separators=(",", ":")).encode() if self.leader and message else b""
        header = np.zeros(HEADER_BYTES, np.uint8)
        header[:LENGTH_BYTES] = np.frombuffer(np.uint32(len(payload)).tobytes(), np.uint8)
        inline = len(payload) <= HEADER_BYTES - LENGTH_BYTES
        if inline:
            header[LENGTH_BYTES:LENGTH_BYTES + len(payload)] = np.frombuffer(payload, np.uint8)
        header = self._broadcast(header)
        length = int(np.frombuffer(header[:LENGTH_BYTES].tobytes(), np.uint32)[0])
        if length == 0:
            body = b""
        elif length <= HEADER_BYTES - LENGTH_BYTES:
            body = header[LENGTH_BYTES:LENGTH_BYTES + length].tobytes()
        else:  # sized to a power of two: a few compiled broadcast shapes, however long the prompts
            buffer = np.zeros(bucket(length, HEADER_BYTES, 1 << 40), np.uint8)
            if self.leader:
                buffer[:length] = np.frombuffer(payload, np.uint8)
            body = self._broadcast(buffer)[:length].tobytes()
        self.exchanges += 1
        self.bytes += length
        self.seconds += time.perf_counter() - start
        return json.loads(body) if body else {}

    def _broadcast(self, array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        try:
            return np.asarray(multihost_utils.broadcast_one_to_all(array))
        except Exception as error:  # noqa: BLE001 - gloo reports a lost peer as a ValueError/XlaRuntimeError
            raise DistributedError(f"process {self.process_id} of {self.num_processes} lost contact with the other "
                                   f"processes (one died or was stopped): {error}") from error
