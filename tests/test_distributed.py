"""Guards under torch.distributed, two gloo processes on CPU: a re-run that names the op or the
module runs on one rank alone, so it must never start a collective the other rank never joins
(DDP's buffer broadcast, FSDP2's parameter all-gather): it stays off them, or says why it did
not run, instead of hanging until the process group's timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TIMEOUT_S = 20  # the process group's: a collective one rank alone waits on ends there


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # nan for the negative values rank 1 gets


def _model(batch_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    with torch.no_grad():  # positive for rank 0's positive inputs
        first.weight.fill_(0.1)
        first.bias.fill_(0.1)
    layers = [first, Log()] + ([nn.BatchNorm1d(4)] if batch_norm else []) + [nn.Linear(4, 1)]
    return nn.Sequential(*layers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, setup: str, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from numguard_nb import Guard, NonFiniteError

    try:
        if setup == "ddp-ops":
            model = nn.parallel.DistributedDataParallel(_model(batch_norm=True))
            options = {"ops": True}
        else:  # "fsdp2-sentinel"
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(_model(batch_norm=False))
            options = {"mode": "sentinel"}
        x = torch.ones(8, 4) * (1.0 if rank == 0 else -1e4)  # rank 1's log: of negative values
        try:
            with Guard(model, **options):
                model(x)
            outcome = ("clean", None, None, None)
        except NonFiniteError as error:
            frame = error.report.first_nonfinite
            outcome = ("detected", frame.module_name, frame.op, error.report.reason)
        results.put((rank, outcome))
    except BaseException:
        results.put((rank, ("crashed", traceback.format_exc(), None, None)))
    finally:
        dist.destroy_process_group()


def _run(setup: str) -> dict:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = [context.Process(target=_rank_main, args=(rank, 2, _free_port_once(), setup, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    got = {}
    while not results.empty():
        rank, outcome = results.get()
        got[rank] = outcome
    return got


_port = []


def _free_port_once() -> int:
    if not _port:
        _port.append(_free_port())
    return _port[0]


@pytest.fixture(autouse=True)
def _new_port():
    _port.clear()
    yield


def test_the_op_re_run_on_one_ddp_rank_starts_no_buffer_broadcast():
    got = _run("ddp-ops")
    assert got[0][0] == "clean", got
    state, module, op, _ = got[1]
    assert state == "detected", got
    # the op named: the re-run ran (a broadcast rank 0 never joins would have failed it)
    assert module == "module.1" and op == "aten.log.default"


def test_the_sentinel_does_not_re_run_an_fsdp2_rank_alone_and_says_why():
    got = _run("fsdp2-sentinel")
    assert got[0][0] == "clean", got
    state, _, _, reason = got[1]
    assert state == "detected", got
    assert "sharded with FSDP" in reason and "not run again" in reason
