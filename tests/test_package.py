"""The package's face: what `import numguard_nb` offers, and what it needs."""

import subprocess
import sys

import numguard_nb


def test_every_documented_name_is_importable_from_the_package():
    for name in numguard_nb.__all__:
        assert getattr(numguard_nb, name) is not None, name
    assert numguard_nb.check_pipeline is numguard_nb.doctor.check_pipeline
    assert numguard_nb.NumguardCallback.__name__ == "NumguardCallback"
    assert set(numguard_nb.__all__) <= set(dir(numguard_nb))


def test_an_unknown_name_is_an_attribute_error():
    try:
        numguard_nb.check_pipelines
    except AttributeError as error:
        assert "check_pipelines" in str(error)
    else:
        raise AssertionError("an unknown attribute was found")


def test_the_engine_runs_without_ipython_ipywidgets_or_pandas():
    # A GPU box or a training script has torch only: the guard, its report's text, the replay
    # and the doctor must import and run there.
    code = (
        "import sys\n"
        "for name in ('IPython', 'ipywidgets', 'pandas'):\n"
        "    sys.modules[name] = None\n"
        "import torch, numguard_nb as ng\n"
        "from numguard_nb import replay, doctor, session\n"
        "model = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "try:\n"
        "    with ng.Guard(model):\n"
        "        model(torch.tensor([[float('nan'), 1.0]]))\n"
        "except ng.NonFiniteError as error:\n"
        "    print(error.report.cause, error.report.to_text().splitlines()[0][:20])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("data ")


def test_the_demo_without_transformers_says_what_to_install():
    code = ("import sys\nsys.modules['transformers'] = None\n"
            "from numguard_nb.demo import main\nmain()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == ('the demo builds a Hugging Face T5: pip install "numguard_nb[hf]" '
                           '(from a checkout: pip install -e ".[hf]")\n')
