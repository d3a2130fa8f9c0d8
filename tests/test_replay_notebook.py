"""notebooks/03_cpu_replay.ipynb runs on CPU (simulated device error) and shows the replay."""

import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_cpu_replay.ipynb"


@pytest.fixture(scope="module")
def python3_kernel():
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"],
                       check=True, capture_output=True)
    return "python3"



def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("execute_result", "display_data"):
        return output.data.get("text/plain", "")
    if output.output_type == "error":
        return "\n".join(output.traceback)
    return ""


def test_cpu_replay_notebook_runs_and_shows_the_real_line(python3_kernel, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name=python3_kernel, timeout=60,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in code), "every cell ran"

    for cell in code:
        assert not any(o.output_type == "error" for o in cell.outputs), cell.source
    texts = ["".join(_text(o) for o in cell.outputs) for cell in code]

    failing = next(t for t in texts if "CUDA error: device-side assert triggered" in t)
    assert "a device error: True" in failing

    outcome_cell = next(cell for cell in code if cell.source.strip().endswith("outcome"))
    shown = outcome_cell.outputs[0]
    plain, html = shown.data["text/plain"], shown.data["text/html"]
    assert plain.index("IndexError: Target 2 is out of bounds") < plain.index("RuntimeError: CUDA error")
    assert "loss = F.cross_entropy(logits, labels)" in plain
    assert "raised in torch.nn.functional.cross_entropy, run outside the guarded modules" in plain
    assert "restart the kernel" in plain and "%numguard_replay" in plain
    assert "IndexError" in html and "<script" not in html

    bundles = list(tmp_path.glob("numguard_replay_*.pt"))
    assert len(bundles) == 1 and str(bundles[0]) in plain  # saved next to the notebook run

    assert "-> loss = F.cross_entropy(logits, labels)" in texts[-2]
    assert "IndexError: Target 2 is out of bounds" in texts[-1]  # replayed from the bundle
    assert "loss = F.cross_entropy(logits, labels)" in texts[-1]  # the loss code, from the bundle
