"""Check that a multi-process PyTorch world can form, communicate correctly, and how fast.

Contract: each rank checks an all_reduce and a broadcast against values it can compute itself
and times the all_reduce; rank 0 prints one OK/FAILED line per rank and the bus bandwidth and
latency of the slowest rank; the exit status is 0 only when every rank passed (:func:`main`).
:func:`run` launches it on this machine and returns one pandas DataFrame row per rank.

Limits: nothing hangs: a rank still running after ``--timeout`` prints its own ``FAILED`` line
(its rank and phase) and exits with 1; :func:`run` raises nothing for a failing world. Several
machines use torchrun's own rendezvous. Options (``--help``): ``--backend nccl|gloo``,
``--timeout S``, ``--size MB``, ``--nccl-debug``, ``--dist-debug``, ``--results-dir DIR``.
Launch it with torchrun (one process per GPU, or per CPU slot with gloo)::

    python -m torch.distributed.run --nproc_per_node 2 -m numguard_nb.distcheck
    torchrun --nproc_per_node 2 -m numguard_nb.distcheck --backend gloo --timeout 30 --size 16

How it works, and the columns of :func:`run`: docs/distcheck.md.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from .. import numerics
from .._util import first_line

BACKENDS = ("nccl", "gloo")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SIZE_MB = 64.0

BANDWIDTH_WARMUP_ITERS = 3
BANDWIDTH_ITERS = 10
LATENCY_WARMUP_ITERS = 5
LATENCY_ITERS = 50

# torch's own timeout errors (e.g. "1/2 clients joined") say more than the watchdog can,
# so collectives get a shorter deadline than the whole check.
COLLECTIVE_TIMEOUT_FRACTION = 0.75
# The Python watchdog needs the GIL; this C-level backstop does not, and fires this much later.
FAULTHANDLER_EXTRA_S = 10.0
# Time torchrun needs beyond the ranks' own timeout: interpreter and torch start-up.
_LAUNCH_GRACE_S = 30.0
# How long torchrun gets to stop its workers after SIGTERM before everything is killed.
_TERMINATE_WAIT_S = 10.0

RESULT_COLUMNS = (
    "rank", "local_rank", "host", "world_size", "device", "backend", "ok", "error",
    "allreduce_ok", "broadcast_ok", "busbw_gbps", "algbw_gbps", "latency_us",
    "size_mb", "torch", "cuda", "nccl", "seconds",
)


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: beyond it a process group's timeout overflows a time_t


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# How the command line spells run()'s arguments, for the advice of an error.
_FLAGS = {"nproc": "torchrun --nproc_per_node ", "timeout": "--timeout ", "size_mb": "--size "}


def _check_arguments(nproc: int, backend: str | None, timeout: float, size_mb: float,
                     cli: bool = False) -> str:
    """Validate the options shared by :func:`run` and the CLI (`cli`: advice in its flags);
    return the backend to use.

    Raises a one-line ValueError that says what to change.
    """
    def give(name: str, value) -> str:
        return f"{_FLAGS[name]}{value}" if cli else f"{name}={value}"

    if isinstance(nproc, bool) or not isinstance(nproc, numbers.Integral) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer (got {nproc!r}): pass "
                         f"{give('nproc', 1)} or more")
    if not _number(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g} "
                         f"(got {timeout!r}): pass e.g. {give('timeout', 60)}")
    if not _number(size_mb) or not 0 < size_mb < math.inf:
        raise ValueError(f"size_mb must be a finite number of MiB > 0 (got {size_mb!r}): pass e.g. "
                         f"{give('size_mb', 64)}")
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU), "
                         "or leave it unset to pick nccl when CUDA is available, else gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA but torch.cuda.is_available() is False: "
                         "use backend 'gloo' or run on a machine with a GPU")
    if backend == "nccl" and nproc > torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        raise ValueError(f"backend 'nccl' runs one process per GPU, and {nproc} processes were asked "
                         f"for with {gpus} GPU{'s' if gpus != 1 else ''} visible: pass {give('nproc', gpus)} "
                         "or fewer, or backend 'gloo'")
    return backend


# --------------------------------------------------------------------------- worker side


def _versions() -> dict:
    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}


def _rank_prefix(record: dict) -> str:
    """How every error names its rank, so a DataFrame row says who broke on its own."""
    return f"rank {record['rank']} ({record['host']}): "


def _rank_line(record: dict, status: str) -> str:
    """The familiar ``[host-local_rank] is OK (global rank: r/w)`` line, plus the device."""
    return (f"[{record['host']}-{record['local_rank']}] {status} (global rank: "
            f"{record['rank']}/{record['world_size']}, device {record['device']})")


class _RankCheck:
    """One rank's check: runs the phases, keeps the result record, reports failures."""

    def __init__(self, backend: str, timeout: float, size_mb: float, results_dir: str | None):
        self.backend = backend
        self.timeout = timeout
        self.size_mb = size_mb
        self.results_dir = results_dir
        self.started = time.perf_counter()
        self.phase = "start-up"
        self.problems: list[str] = []  # wrong collective results, in the order found
        self.all_ranks_ok = False
        self._done = threading.Event()  # tells the watchdog the process may exit
        # The watchdog thread and the main thread may both try to finish the record.
        self._finish_lock = threading.Lock()
        self._finished = False

        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        use_gpu = backend == "nccl"
        self.device = torch.device(f"cuda:{local_rank}" if use_gpu else "cpu")
        self.record = {
            "rank": rank, "local_rank": local_rank, "host": socket.gethostname(),
            "world_size": int(os.environ["WORLD_SIZE"]), "device": str(self.device),
            "backend": backend, "ok": False, "error": None,
            "allreduce_ok": None, "broadcast_ok": None,
            "busbw_gbps": None, "algbw_gbps": None, "latency_us": None,
            "size_mb": size_mb, **_versions(), "seconds": None,
        }

    def run(self) -> int:
        """Run every phase; return the process exit status."""
        self._start_watchdog()
        try:
            self._run_phases()
        except Exception as exc:  # noqa: BLE001 - any failure is reported with its rank and phase
            message = f"failed during {self.phase}: {type(exc).__name__}: {exc}"
            self._finish(error=message)
            print(_rank_line(self.record, "FAILED") + ": " + first_line(message),
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            # A broken process group can hang in its teardown at exit; leave without it.
            os._exit(1)
        self._done.set()
        faulthandler.cancel_dump_traceback_later()
        return 0 if self.all_ranks_ok else 1

    def _start_watchdog(self) -> None:
        # gloo collectives and some NCCL hangs ignore the process-group timeout; without
        # this a rank whose peer never arrives would keep torchrun waiting forever.
        threading.Thread(target=self._watch, name="distcheck-watchdog", daemon=True).start()
        faulthandler.dump_traceback_later(self.timeout + FAULTHANDLER_EXTRA_S, exit=True)

    def _watch(self) -> None:
        if self._done.wait(self.timeout):
            return
        try:
            hint = (" (the world never formed: check that all ranks started and can reach "
                    "MASTER_ADDR:MASTER_PORT)" if self.phase == "init_process_group" else "")
            message = f"timed out after {self.timeout:g} s during {self.phase}{hint}"
            self._finish(error=message)  # keeps the first outcome if one was recorded
            print(_rank_line(self.record, "FAILED") + ": " + message, file=sys.stderr, flush=True)
        finally:
            os._exit(1)  # even if reporting fails, this rank must not hang

    def _finish(self, error: str | None = None) -> None:
        """Record the outcome and write it, once: later calls keep the first outcome."""
        with self._finish_lock:
            if self._finished:
                return
            self._finished = True
            if error is not None:
                self.record["ok"] = False
                self.record["error"] = _rank_prefix(self.record) + error
            self.record["seconds"] = round(time.perf_counter() - self.started, 3)
            if self.results_dir is not None:
                self._write_record()

    def _write_record(self) -> None:
        Path(self.results_dir).mkdir(parents=True, exist_ok=True)
        path = Path(self.results_dir) / f"rank-{self.record['rank']}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self.record))
        os.replace(partial, path)  # the launcher never sees a half-written file

    def _run_phases(self) -> None:
        self.phase = "init_process_group"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        collective_timeout = datetime.timedelta(seconds=self.timeout * COLLECTIVE_TIMEOUT_FRACTION)
        dist.init_process_group(self.backend, timeout=collective_timeout)
        self.phase = "all_reduce check"
        payload_numel = max(1, int(self.size_mb * 2**20) // 4)
        self.record["allreduce_ok"], payload = self._check_all_reduce(payload_numel)
        self.phase = "broadcast check"
        self.record["broadcast_ok"] = self._check_broadcast(payload_numel)
        self.phase = "all_reduce bandwidth"
        self._measure_bandwidth(payload)
        self.phase = "all_reduce latency"
        self._measure_latency()
        self.record["ok"] = bool(self.record["allreduce_ok"] and self.record["broadcast_ok"])
        if self.problems:
            self.record["error"] = _rank_prefix(self.record) + "; ".join(self.problems)
        self.phase = "gathering results"
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.record)
        self.all_ranks_ok = all(record["ok"] for record in everyone)
        if self.record["rank"] == 0:
            _print_report(everyone)
        self._finish()
        self.phase = "destroy_process_group"
        dist.destroy_process_group()

    def _check_all_reduce(self, numel: int) -> tuple[bool, torch.Tensor]:
        # Small integers stay exact in float32 whatever order the backend sums in.
        pattern = torch.arange(numel, device=self.device, dtype=torch.float32) % 8
        world, rank = dist.get_world_size(), dist.get_rank()
        payload = pattern + rank
        dist.all_reduce(payload)
        expected = pattern * world + world * (world - 1) // 2
        wrong = int(numerics.read((payload != expected).sum()))
        if wrong:
            self.problems.append(f"all_reduce returned {wrong} wrong values of {numel}")
        return wrong == 0, payload

    def _check_broadcast(self, numel: int) -> bool:
        # Every rank draws the same random values, so each can verify what rank 0 sent.
        generator = torch.Generator().manual_seed(20240611)
        expected = torch.randn(numel, generator=generator).to(self.device)
        received = expected.clone() if dist.get_rank() == 0 else torch.zeros_like(expected)
        dist.broadcast(received, src=0)
        wrong = int(numerics.read((received != expected).sum()))
        if wrong:
            self.problems.append(f"broadcast from rank 0 delivered {wrong} wrong values of {numel}")
        return wrong == 0

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_all_reduce(self, tensor: torch.Tensor, warmup: int, iters: int) -> float:
        """Seconds per all_reduce of `tensor`, after warm-up."""
        for _ in range(warmup):
            dist.all_reduce(tensor)
        self._synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        self._synchronize()
        return (time.perf_counter() - start) / iters

    def _measure_bandwidth(self, payload: torch.Tensor) -> None:
        seconds = self._time_all_reduce(payload, BANDWIDTH_WARMUP_ITERS, BANDWIDTH_ITERS)
        world = dist.get_world_size()
        algbw = payload.numel() * payload.element_size() / seconds / 1e9
        self.record["algbw_gbps"] = algbw
        self.record["busbw_gbps"] = algbw * 2 * (world - 1) / world

    def _measure_latency(self) -> None:
        one_value = torch.ones(1, device=self.device)
        seconds = self._time_all_reduce(one_value, LATENCY_WARMUP_ITERS, LATENCY_ITERS)
        self.record["latency_us"] = seconds * 1e6


def _print_report(records: list[dict]) -> None:
    """Rank 0's report: versions, one line per rank in rank order, then the measurements."""
    first = records[0]
    lines = [(f"numguard distcheck: torch {first['torch']}, CUDA {first['cuda'] or '-'}, "
              f"NCCL {first['nccl'] or '-'}, backend {first['backend']}, "
              f"world size {first['world_size']}")]
    for record in sorted(records, key=lambda r: r["rank"]):
        lines.append(_rank_line(record, "is OK") if record["ok"]
                     else _rank_line(record, "FAILED") + ": "
                     + record["error"].removeprefix(_rank_prefix(record)))
    busbw = min(record["busbw_gbps"] for record in records)
    algbw = min(record["algbw_gbps"] for record in records)
    latency = max(record["latency_us"] for record in records)
    lines.append(f"all_reduce of {first['size_mb']:g} MiB: busbw {busbw:.3f} GB/s "
                 f"(algbw {algbw:.3f} GB/s), latency {latency:.1f} us (slowest rank)")
    failed = [record["rank"] for record in records if not record["ok"]]
    lines.append(f"distcheck FAILED on ranks {failed}" if failed
                 else f"distcheck OK: all {len(records)} ranks passed")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m numguard_nb.distcheck",
        description="Check a torch.distributed world: run me under torchrun "
                    "(e.g. torchrun --nproc_per_node 2 -m numguard_nb.distcheck).")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="default: nccl when CUDA is available, else gloo")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds the whole check may take on each rank (default %(default)g)")
    parser.add_argument("--size", type=float, default=DEFAULT_SIZE_MB, metavar="MB",
                        help="all_reduce/broadcast payload in MiB (default %(default)g)")
    parser.add_argument("--nccl-debug", action="store_true", help="set NCCL_DEBUG=INFO")
    parser.add_argument("--dist-debug", action="store_true",
                        help="set TORCH_DISTRIBUTED_DEBUG=DETAIL")
    parser.add_argument("--results-dir", metavar="DIR",
                        help="each rank writes its result to DIR/rank-<rank>.json")
    args = parser.parse_args(argv)
    try:
        # torchrun owns the process count: this node's, checked against its GPUs for nccl.
        args.backend = _check_arguments(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), args.backend,
                                        args.timeout, args.size, cli=True)
    except ValueError as exc:
        parser.error(str(exc))
    if args.results_dir is not None:  # refused now, not after the check said OK
        try:
            Path(args.results_dir).mkdir(parents=True, exist_ok=True)
            writable = os.access(args.results_dir, os.W_OK)
        except OSError:
            writable = False
        if not writable:
            parser.error(f"--results-dir {args.results_dir}: cannot write there: pass a folder "
                         "this user can write to")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("RANK/WORLD_SIZE are not set: launch with torchrun --nproc_per_node N "
                     "-m numguard_nb.distcheck, or call numguard_nb.distcheck.run()")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # Both are read when the process group starts, so they must be in place before that.
    if args.nccl_debug:
        os.environ["NCCL_DEBUG"] = "INFO"
    if args.dist_debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()  # torch.distributed read the variable at import
    return _RankCheck(args.backend, args.timeout, args.size, args.results_dir).run()


# --------------------------------------------------------------------------- launcher side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch_command(nproc: int, backend: str, timeout: float, size_mb: float,
                    results_dir: str, nccl_debug: bool, dist_debug: bool) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nproc_per_node", str(nproc), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               "-m", "numguard_nb.distcheck", "--backend", backend,
               "--timeout", f"{timeout:g}", "--size", f"{size_mb:g}", "--results-dir", results_dir]
    if nccl_debug:
        command.append("--nccl-debug")
    if dist_debug:
        command.append("--dist-debug")
    return command


def _stop_process_group(process: subprocess.Popen) -> str:
    """SIGTERM torchrun's process group (torchrun then stops its workers), then SIGKILL it."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=_TERMINATE_WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    return output or ""


def _missing_rank_error(rank: int, failed_ranks: list[int], launch_timed_out: bool,
                        launch_deadline: float, returncode: int | None) -> str:
    if launch_timed_out:
        return (f"rank {rank}: no result; the launcher killed the run after "
                f"{launch_deadline:g} s (timeout)")
    if failed_ranks:
        return (f"rank {rank}: no result; torchrun stopped it after rank(s) "
                f"{failed_ranks} failed")
    return (f"rank {rank}: no result; torchrun exited with status {returncode} "
            "(see df.attrs['output'])")


def _summary(frame, reported_ranks, launch_timed_out: bool, launch_deadline: float) -> str:
    failed = frame[~frame["ok"]]
    if failed.empty:
        return (f"distcheck OK: {len(frame)}/{len(frame)} ranks ({frame['backend'].iloc[0]}) "
                "passed all_reduce and broadcast checks; "
                f"busbw {frame['busbw_gbps'].min():.3f} GB/s, "
                f"latency {frame['latency_us'].max():.1f} us")
    if launch_timed_out:
        cause = f"launcher timed out after {launch_deadline:g} s and killed the run"
    else:
        # A rank's own error explains more than "no result" rows for ranks torchrun stopped.
        own_errors = failed[failed["rank"].isin(list(reported_ranks))]
        cause = (own_errors if not own_errors.empty else failed)["error"].iloc[0]
    return f"distcheck FAILED: {len(failed)}/{len(frame)} ranks failed; {cause}"


def run(nproc: int = 2, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
        size_mb: float = DEFAULT_SIZE_MB, *, nccl_debug: bool = False,
        dist_debug: bool = False):
    """Launch the check with torchrun on this machine and return one DataFrame row per rank.

    ``timeout`` bounds each rank's check; torchrun as a whole gets ``timeout`` plus
    30 s for start-up before its process group is stopped and the run reported as
    timed out.  Nothing is raised for a failing world: see the ``ok``/``error`` columns
    and ``df.attrs['summary']``.  Bad arguments raise a one-line ValueError.
    """
    import pandas as pd

    backend = _check_arguments(nproc, backend, timeout, size_mb)
    gpus = torch.cuda.device_count()
    if backend == "nccl" and nproc > gpus:
        raise ValueError(f"nproc={nproc} but only {gpus} GPU(s) are visible and each rank "
                         f"needs its own: use nproc <= {gpus}")
    launch_deadline = timeout + _LAUNCH_GRACE_S
    with tempfile.TemporaryDirectory(prefix="numguard-distcheck-") as results_dir:
        command = _launch_command(nproc, backend, timeout, size_mb, results_dir,
                                  nccl_debug, dist_debug)
        env = dict(os.environ)
        # Make this copy of numguard_nb importable by the workers, installed or not.
        package_parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=launch_deadline)
            launch_timed_out = False
        except subprocess.TimeoutExpired:
            output = _stop_process_group(process)
            launch_timed_out = True
        except KeyboardInterrupt:  # an interrupted notebook cell must not leave ranks behind
            _stop_process_group(process)
            raise
        records = {}
        for path in Path(results_dir).glob("rank-*.json"):
            record = json.loads(path.read_text())
            records[record["rank"]] = record

    failed_ranks = sorted(rank for rank, record in records.items() if not record["ok"])
    returncode = None if launch_timed_out else process.returncode
    rows = []
    for rank in range(nproc):
        rows.append(records.get(rank) or {
            "rank": rank, "local_rank": rank, "world_size": nproc, "backend": backend,
            "ok": False, "size_mb": size_mb,
            "error": _missing_rank_error(rank, failed_ranks, launch_timed_out,
                                         launch_deadline, returncode),
        })
    frame = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
    frame.attrs["summary"] = _summary(frame, records.keys(), launch_timed_out, launch_deadline)
    frame.attrs["returncode"] = returncode
    frame.attrs["output"] = output
    frame.attrs["command"] = command
    return frame


if __name__ == "__main__":
    sys.exit(main())
