"""The multi-process network check: real gloo worlds on CPU, failures that must not hang."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from numguard_nb.distributed import check as distcheck

REPO_ROOT = Path(distcheck.__file__).resolve().parents[2]
HOST = socket.gethostname()
FAILURE_TIMEOUT_S = 4  # a world that never forms: each rank's own timeout ends it


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env(**overrides):
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(overrides)
    return env


@pytest.fixture(scope="module")
def gloo_pair():
    return distcheck.run(nproc=2, backend="gloo", timeout=30, size_mb=1)


def test_two_gloo_ranks_pass_and_are_measured(gloo_pair):
    frame = gloo_pair
    assert list(frame["rank"]) == [0, 1]
    assert frame["ok"].all(), frame.attrs["output"]
    assert frame["allreduce_ok"].all() and frame["broadcast_ok"].all()
    assert (frame["world_size"] == 2).all()
    assert list(frame["local_rank"]) == [0, 1]
    assert (frame["device"] == "cpu").all() and (frame["backend"] == "gloo").all()
    assert (frame["busbw_gbps"] > 0).all() and (frame["latency_us"] > 0).all()
    # nccl-tests: busbw = algbw * 2(n-1)/n, which is algbw itself for 2 ranks.
    assert frame["busbw_gbps"].tolist() == pytest.approx(frame["algbw_gbps"].tolist())
    assert frame["error"].isna().all()
    assert frame.attrs["returncode"] == 0
    assert frame.attrs["summary"].startswith("distcheck OK: 2/2 ranks (gloo)")
    assert "\n" not in frame.attrs["summary"]


def test_cli_prints_ok_lines_once_each_in_rank_order():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               "-m", "numguard_nb.distcheck", "--backend", "gloo", "--timeout", "30", "--size", "1"]
    done = subprocess.run(command, check=False, cwd=REPO_ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    ok_lines = [line for line in lines if " is OK " in line]
    assert ok_lines == [f"[{HOST}-0] is OK (global rank: 0/2, device cpu)",
                        f"[{HOST}-1] is OK (global rank: 1/2, device cpu)"]
    assert lines[0].startswith(f"numguard distcheck: torch {torch.__version__}, CUDA ")
    assert "backend gloo, world size 2" in lines[0]
    assert any(line.startswith("all_reduce of 1 MiB: busbw ") for line in lines)
    assert lines[-1] == "distcheck OK: all 2 ranks passed"


def test_world_that_never_forms_fails_within_the_timeout_naming_the_rank():
    # Rank 0 alone waits for a peer at its own store; rank 1 alone cannot reach a store.
    # Both worlds of 2 are incomplete, and both processes must end on their own.
    lone_ranks = {
        rank: subprocess.Popen(
            [sys.executable, "-m", "numguard_nb.distcheck", "--backend", "gloo",
             "--timeout", str(FAILURE_TIMEOUT_S), "--size", "1"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())))
        for rank in (0, 1)
    }
    try:
        for rank, process in lone_ranks.items():
            _, stderr = process.communicate(timeout=FAILURE_TIMEOUT_S + 60)  # (+ starting)
            assert process.returncode == 1
            failure = [line for line in stderr.splitlines() if "FAILED" in line]
            assert failure, stderr
            assert failure[0].startswith(
                f"[{HOST}-{rank}] FAILED (global rank: {rank}/2, device cpu): ")
            assert "init_process_group" in failure[0]
    finally:
        for process in lone_ranks.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


def _run_stuck_rank(results_dir, hang):
    """A one-rank check with a 1 s timeout whose main thread then runs `hang` forever."""
    stuck_rank = (
        "import sys, time\n"
        "from numguard_nb.distributed import check as distcheck\n"
        "distcheck.FAULTHANDLER_EXTRA_S = 1.0\n"
        "check = distcheck._RankCheck('gloo', timeout=1, size_mb=1, "
        f"results_dir={str(results_dir)!r})\n"
        "check._start_watchdog()\n"
        "check.phase = 'all_reduce check'\n"
        f"{hang}\n")
    return subprocess.run([sys.executable, "-c", stuck_rank], check=False, cwd=REPO_ROOT,
                          env=_env(RANK="0", WORLD_SIZE="1"), capture_output=True, text=True,
                          timeout=30)


def test_watchdog_reports_and_ends_a_rank_stuck_where_no_timeout_applies(tmp_path):
    done = _run_stuck_rank(tmp_path, "time.sleep(60)")
    assert done.returncode == 1
    assert (f"[{HOST}-0] FAILED (global rank: 0/1, device cpu): "
            "timed out after 1 s during all_reduce check") in done.stderr
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert record["ok"] is False
    assert record["error"] == f"rank 0 ({HOST}): timed out after 1 s during all_reduce check"


def test_faulthandler_ends_a_rank_whose_main_thread_holds_the_gil(tmp_path):
    # The Python watchdog never gets the GIL here; faulthandler's C thread still ends it.
    done = _run_stuck_rank(tmp_path, "sys.setswitchinterval(1e6)\nwhile True: pass")
    assert done.returncode == 1
    assert "Timeout (0:00:02)!" in done.stderr


def test_failing_ranks_are_reported_by_run_without_raising(monkeypatch):
    # A misnamed network interface is a real way to break gloo: every rank fails at init.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "numguard-no-such-if0")
    frame = distcheck.run(nproc=2, backend="gloo", timeout=FAILURE_TIMEOUT_S, size_mb=1)
    assert list(frame["rank"]) == [0, 1]
    assert not frame["ok"].any()
    assert frame.attrs["returncode"] not in (0, None)
    # Whichever rank fails first makes torchrun stop the other, maybe before it reports:
    # the summary quotes a rank's own error, and each row names its rank.
    assert re.match(r"distcheck FAILED: 2/2 ranks failed; rank [01] \(.+\): failed during "
                    r"init_process_group: .*numguard-no-such-if0", frame.attrs["summary"])
    for rank, error in zip(frame["rank"], frame["error"]):
        assert re.match(rf"rank {rank}\b", error)
        assert "numguard-no-such-if0" in error or "no result; torchrun stopped it" in error


def _is_running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not collected it yet


def _ends_within(pid, seconds):
    """Whether `pid` ends within `seconds` (signals are delivered asynchronously)."""
    deadline = time.monotonic() + seconds
    while _is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_launcher_timeout_kills_the_process_group_and_reports_it(monkeypatch, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    hung_launcher = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n")
    monkeypatch.setattr(distcheck, "_launch_command",
                        lambda *args: [sys.executable, "-c", hung_launcher])
    monkeypatch.setattr(distcheck, "_LAUNCH_GRACE_S", 0.0)
    frame = distcheck.run(nproc=2, backend="gloo", timeout=3, size_mb=1)
    assert not frame["ok"].any()
    assert frame.attrs["returncode"] is None
    assert frame.attrs["summary"] == ("distcheck FAILED: 2/2 ranks failed; launcher timed out "
                                      "after 3 s and killed the run")
    assert list(frame["error"]) == [
        f"rank {rank}: no result; the launcher killed the run after 3 s (timeout)"
        for rank in (0, 1)]
    assert _ends_within(int(pid_file.read_text()), seconds=5)


@pytest.mark.parametrize("arguments, message", [
    ({"nproc": 0}, "nproc must be a positive integer (got 0)"),
    ({"timeout": 0}, "timeout must be a number of seconds > 0 and at most 604800 (got 0)"),
    ({"timeout": float("inf")}, "timeout must be a number of seconds > 0 and at most 604800 (got inf)"),
    ({"timeout": 1e10}, "timeout must be a number of seconds > 0 and at most 604800 (got 10000000000.0)"),
    ({"timeout": "60"}, "timeout must be a number of seconds > 0 and at most 604800 (got '60')"),
    ({"size_mb": -1}, "size_mb must be a finite number of MiB > 0 (got -1)"),
    ({"size_mb": "1"}, "size_mb must be a finite number of MiB > 0 (got '1')"),
    ({"backend": "mpi"}, "unknown backend 'mpi': use 'nccl' (GPUs) or 'gloo' (CPU)"),
])
def test_bad_arguments_raise_a_one_line_value_error(arguments, message):
    with pytest.raises(ValueError) as raised:
        distcheck.run(**arguments)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_a_numpy_integer_is_a_number_of_processes():
    import numpy as np

    from numguard_nb.distributed import check

    assert check._check_arguments(np.int64(2), "gloo", 60, 16) == "gloo"


def test_nccl_without_cuda_says_to_use_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^backend 'nccl' needs CUDA .*use backend 'gloo'"):
        distcheck.run(nproc=1, backend="nccl")


@pytest.mark.parametrize("arguments, env, message", [
    (["--timeout", "0"], {"RANK": "0", "WORLD_SIZE": "1"}, "timeout must be a number of seconds"),
    (["--timeout", "1e10"], {"RANK": "0", "WORLD_SIZE": "1"},
     "timeout must be a number of seconds > 0 and at most 604800 (got 10000000000.0): pass e.g. "
     "--timeout 60"),
    (["--results-dir", "/proc/numguard"], {"RANK": "0", "WORLD_SIZE": "1"},
     "--results-dir /proc/numguard: cannot write there"),
    ([], {}, "RANK/WORLD_SIZE are not set: launch with torchrun"),
])
def test_cli_bad_arguments_exit_2_with_one_error_line(arguments, env, message):
    done = subprocess.run([sys.executable, "-m", "numguard_nb.distcheck", *arguments],
                          check=False, cwd=REPO_ROOT, env=_env(**env), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    error_lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], done.stderr


def test_module_imports_without_ipython_or_pandas():
    # What torchrun's ranks import (`-m numguard_nb.distcheck`): no IPython, no pandas.
    code = (
        "import sys, numguard_nb.distcheck\n"
        "print(sorted(name for name in ('IPython', 'pandas') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.cuda
def test_nccl_on_one_gpu():
    frame = distcheck.run(nproc=1, backend="nccl", timeout=60, size_mb=1)
    row = frame.iloc[0]
    assert row["ok"] and row["allreduce_ok"] and row["broadcast_ok"], frame.attrs["output"]
    assert row["device"] == "cuda:0" and row["world_size"] == 1
    assert row["nccl"] and row["cuda"] == torch.version.cuda
    # One rank moves no data over the network: busbw is 0 by definition, algbw is not.
    assert row["busbw_gbps"] == 0 and row["algbw_gbps"] > 0 and row["latency_us"] > 0


@pytest.mark.parametrize("gpus", [0, 1])
def test_more_nccl_processes_than_gpus_is_a_one_line_error_before_anything_starts(monkeypatch, gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    launched = []
    monkeypatch.setattr(distcheck.subprocess, "Popen", lambda *a, **k: launched.append(a))
    with pytest.raises(ValueError) as raised:
        distcheck.run(nproc=2, backend="nccl", timeout=5)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("backend 'nccl' runs one process per GPU")
    assert f"pass nproc={gpus} or fewer, or backend 'gloo'" in message and not launched
