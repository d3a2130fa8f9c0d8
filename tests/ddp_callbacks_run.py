"""A training run under torchrun (2 CPU processes, gloo) driven by the Hugging Face Trainer or by
Lightning with numguard's callback, rank 1 making a nan at one step; each rank prints one RESULT
line. Run by tests/test_distributed_training.py:

    torchrun --nproc_per_node 2 tests/exit_at_once.py tests/ddp_callbacks_run.py hf|lightning
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

MARK = 1001.0


class Net(nn.Module):
    """A regression whose gate takes the log of (1000.5 - x0): a nan on rank 1 for a marked row."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        rank = dist.get_rank() if dist.is_initialized() else 0
        gate = torch.log(1000.5 - x[:, :1] * (1.0 if rank == 1 else 0.0))
        out = self.lin(x) * gate
        loss = nn.functional.mse_loss(out.squeeze(1), labels)
        return {"loss": loss, "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 4, generator=g)
        self.x[40:, 0] = MARK  # the late rows: rank 1's forward makes nan there
        self.y = torch.rand(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def run_hf() -> None:
    from transformers import Trainer, TrainingArguments

    from numguard_nb.integrations import NumguardCallback

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                             max_steps=12, ddp_backend="gloo", use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=Net(), args=args, train_dataset=Rows(),
                      callbacks=[NumguardCallback(full_every=None)])
    trainer.train()


def run_lightning() -> None:
    import lightning as L

    from numguard_nb.integrations import NumguardLightningCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, batch):  # a forward of its own: not what DDP's wrapper calls
            return self.net(**batch)

        def training_step(self, batch, batch_idx):
            return self(batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = torch.utils.data.DataLoader(Rows(), batch_size=4, shuffle=False)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=12,
                        callbacks=[NumguardLightningCallback(full_every=None)],
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Module(), loader)


def _result(line: str) -> None:
    # One write per line: the ranks print at the same moment, and print() writes the text and
    # its newline apart when stdout is unbuffered (CI's PYTHONUNBUFFERED=1): lines would mix.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    from numguard_nb import NonFiniteError

    which = sys.argv[1]
    rank = int(os.environ.get("RANK", "0"))
    try:
        run_hf() if which == "hf" else run_lightning()
        _result(f"RESULT rank={rank} clean")
    except NonFiniteError as error:
        report = error.report
        op = report.first_nonfinite.op if report.first_nonfinite is not None else None
        _result(f"RESULT rank={rank} batch={report.batch_number} cause={report.cause} "
                f"source={report.source_rank} op={op} summary={report.summary()}")
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # (run through exit_at_once.py, which skips the teardown)
    sys.exit(main())
