"""Tests for numguard_nb.doctor.check_pipeline.

The Hugging Face cases rebuild the three bugs of the course's "Debugging the
training pipeline" chapter on a tiny BERT made from a config and a WordLevel
tokenizer built here: nothing is downloaded.
"""

import copy
import functools
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from numguard_nb.doctor import STEP_NAMES, PipelineReport, PipelineStep, check_pipeline

# Subprocesses import numguard_nb from this checkout, wherever pytest runs from.
REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog sat on mat ran fast slow big small red blue green tree".split()
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


@pytest.fixture(scope="module")
def raw_pairs():
    """An MNLI-like dataset: sentence pairs of varied length, labels 0..2 (the first two are 0 and 1)."""
    rng = random.Random(0)
    return [
        {
            "sentence1": " ".join(rng.choices(WORDS, k=rng.randint(2, 7))),
            "sentence2": " ".join(rng.choices(WORDS, k=rng.randint(2, 7))),
            "label": index % 3,
            "idx": index,
        }
        for index in range(12)
    ]


@pytest.fixture(scope="module")
def tokenized_pairs(tokenizer, raw_pairs):
    """What dataset.map(tokenize) gives: the raw columns plus unpadded input_ids/attention_mask."""
    return [
        {**row, **tokenizer(row["sentence1"], row["sentence2"], truncation=True)} for row in raw_pairs
    ]


def tiny_bert(tokenizer, num_labels):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        num_labels=num_labels,
    )
    return transformers.BertForSequenceClassification(config)


def make_trainer(tmp_path, model, train_dataset, max_steps=-1, **trainer_kwargs):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_strategy="no",
        learning_rate=1e-3,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=train_dataset, **trainer_kwargs)


def statuses(report):
    return {step.name: step.ok for step in report.steps}


def assert_stopped_at(report, failed_name):
    """The named step failed, every earlier one passed and every later one did not run."""
    position = STEP_NAMES.index(failed_name)
    expected = {name: True for name in STEP_NAMES[:position]}
    expected[failed_name] = False
    expected.update({name: None for name in STEP_NAMES[position + 1 :]})
    assert statuses(report) == expected, report.to_text()
    assert not report.ok
    assert report.failed_step is report.step(failed_name)


# ------------------------------------------------------------------ the course's three bugs


def test_raw_text_dataset_given_to_trainer_fails_at_data(tmp_path, tokenizer, raw_pairs):
    trainer = make_trainer(tmp_path, tiny_bert(tokenizer, 3), raw_pairs, processing_class=tokenizer)

    report = check_pipeline(trainer)

    assert_stopped_at(report, "data")
    step = report.step("data")
    assert "raw text" in step.message and "sentence1, sentence2" in step.message
    assert "input_ids" in step.message
    assert "dataset.map(" in step.hint and "tokenizer(batch['sentence1'], batch['sentence2']" in step.hint


def test_unpadded_features_without_padding_collator_fail_at_collate(tmp_path, tokenizer, tokenized_pairs):
    # No tokenizer given to the Trainer: it falls back to default_data_collator, which cannot pad.
    trainer = make_trainer(tmp_path, tiny_bert(tokenizer, 3), tokenized_pairs)

    report = check_pipeline(trainer)

    assert_stopped_at(report, "collate")
    step = report.step("collate")
    assert "input_ids has lengths" in step.message
    assert "DataCollatorWithPadding(tokenizer)" in step.hint
    # The collator's own error is kept with the traceback of where it was raised.
    assert isinstance(step.exception, ValueError)
    assert "data_collator.py" in step.traceback


def test_model_with_too_few_labels_fails_before_forward(tokenizer, tokenized_pairs):
    collator = transformers.DataCollatorWithPadding(tokenizer)
    # The first batch holds labels 0 and 1 only; label 2 is further down the dataset.
    data = [{key: row[key] for key in ("input_ids", "attention_mask", "label")} for row in tokenized_pairs]

    report = check_pipeline(tiny_bert(tokenizer, 2), data, collate_fn=collator)

    assert_stopped_at(report, "forward")
    step = report.step("forward")
    assert step.message == "labels go up to 2 but the model outputs 2 logits"
    assert "num_labels=3" in step.hint
    assert step.exception is None  # caught before the forward could raise


def _tiny_gpt2(vocab_size: int = 100):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=vocab_size, n_positions=16))


@pytest.mark.parametrize("where", ["input_ids", "labels"])
def test_token_ids_past_the_vocabulary_fail_before_forward_with_the_resize(where):
    # a pad token added to the tokenizer (id 100) that the model's embedding never got
    ids = torch.tensor([5, 17, 42, 8, 99, 99])
    bad = torch.tensor([5, 17, 42, 8, 100, 100])
    samples = [{"input_ids": bad if where == "input_ids" else ids,
                "labels": bad if where == "labels" else ids} for _ in range(4)]
    report = check_pipeline(_tiny_gpt2(), samples)
    assert_stopped_at(report, "forward")
    step = report.step("forward")
    assert step.message == ("input_ids go up to 100 but the model's input embedding has 100 rows "
                            "(ids 0..99)" if where == "input_ids"
                            else "labels go up to 100 but the model outputs 100 logits")
    assert "model.resize_token_embeddings(len(tokenizer))" in step.hint
    assert step.exception is None  # caught before the forward could raise
    samples = [{"input_ids": ids, "labels": ids} for _ in range(4)]
    assert check_pipeline(_tiny_gpt2(), samples).step("forward").ok


def test_fixed_trainer_pipeline_passes_every_step_and_leaves_trainer_untouched(
    tmp_path, tokenizer, tokenized_pairs
):
    model = tiny_bert(tokenizer, 3)
    weights_before = copy.deepcopy(model.state_dict())
    trainer = make_trainer(tmp_path, model, tokenized_pairs, processing_class=tokenizer)

    report = check_pipeline(trainer)

    assert report.ok, report.to_text()
    assert [step.name for step in report.steps] == list(STEP_NAMES)
    assert "batch of 4" in report.step("collate").message  # the Trainer's per-device batch size
    assert "the Trainer drops sentence1, sentence2, idx" in report.step("data").message
    assert "AdamW(lr=0.001), built as the Trainer does" in report.step("optimizer").message
    assert trainer.optimizer is None
    assert all(torch.equal(weights_before[name], value) for name, value in model.state_dict().items())


def test_trainer_optimizer_after_training_is_rebuilt_at_its_initial_lr(tmp_path, tokenizer, tokenized_pairs):
    trainer = make_trainer(tmp_path, tiny_bert(tokenizer, 3), tokenized_pairs, max_steps=1, processing_class=tokenizer)
    trainer.train()  # the linear schedule ends at lr 0, and accelerate wraps the optimizer

    report = check_pipeline(trainer)

    assert report.ok, report.to_text()
    assert "AdamW(lr=0.001, the schedule's initial lr), rebuilt from the Trainer's" in report.step("optimizer").message


def test_trainer_compute_loss_func_is_the_loss_checked(tmp_path, tokenizer, tokenized_pairs):
    def per_sample_loss(outputs, labels, num_items_in_batch=None):
        return nn.functional.cross_entropy(outputs.logits, labels, reduction="none")

    model = tiny_bert(tokenizer, 3)
    trainer = make_trainer(
        tmp_path, model, tokenized_pairs, processing_class=tokenizer, compute_loss_func=per_sample_loss
    )

    report = check_pipeline(trainer)

    assert_stopped_at(report, "loss")
    assert "shape (4,)" in report.step("loss").message


# ------------------------------------------------------------------ plain PyTorch


class TwoLayers(nn.Module):
    def __init__(self, features=4, classes=3):
        super().__init__()
        self.body = nn.Linear(features, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, inputs):
        return self.head(torch.relu(self.body(inputs)))


class WithUnusedBranch(TwoLayers):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)


def classification_data(count=16, features=4, classes=3):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(count, features, generator=generator)
    return TensorDataset(inputs, torch.arange(count) % classes)


def test_plain_pipeline_passes_with_a_dataloader():
    loader = DataLoader(classification_data(), batch_size=4)

    report = check_pipeline(TwoLayers(), loader, loss_fn=nn.CrossEntropyLoss())

    assert report.ok, report.to_text()
    assert "batch of 4" in report.step("collate").message
    assert "SGD(lr=0.01), used as no optimizer was given" in report.step("optimizer").message


def test_frozen_parameters_are_mentioned_and_pass():
    model = TwoLayers()
    model.body.requires_grad_(False)

    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss())

    assert report.ok, report.to_text()
    message = report.step("backward").message
    assert "2 frozen parameters" in message and "body.weight, body.bias" in message


def test_unused_trainable_parameters_fail_at_backward_by_name():
    model = WithUnusedBranch()
    model.body.requires_grad_(False)

    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss())

    assert_stopped_at(report, "backward")
    step = report.step("backward")
    assert step.message == "2 trainable parameters got no gradient: unused.weight, unused.bias"
    assert "requires_grad_(False)" in step.hint


class SkipsItsBlockOnOddCalls(TwoLayers):
    """A layer skipped at random in training (LayerDrop, stochastic depth), here on odd calls."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, inputs):
        self.calls += 1
        hidden = torch.relu(self.body(inputs))
        if self.calls % 2 == 0:
            hidden = hidden + self.block(hidden)
        return self.head(hidden)


def test_a_layer_skipped_at_random_is_no_unused_parameter():
    report = check_pipeline(SkipsItsBlockOnOddCalls(), classification_data(), loss_fn=nn.CrossEntropyLoss())
    assert report.ok, report.to_text()


class Wrapper(torch.optim.Optimizer):
    """An optimizer whose constructor takes more than the hyperparameters (a Lookahead-style one)."""

    def __init__(self, params, inner_class, lr=0.1):
        super().__init__(params, dict(lr=lr))
        self.inner_class = inner_class

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("make", [lambda params: torch.optim.LBFGS(params, lr=0.1),  # step(closure)
                                  lambda params: Wrapper(params, torch.optim.SGD)])
def test_optimizers_stepped_or_built_otherwise_pass(make):
    torch.manual_seed(0)
    model = TwoLayers()
    optimizer = make(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0).step()  # decayed to 0 since
    assert optimizer.param_groups[0]["lr"] == 0.0
    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss(),
                            optimizer=optimizer)
    assert report.ok, report.to_text()


def test_loss_that_is_not_a_scalar_fails_at_loss():
    report = check_pipeline(TwoLayers(), classification_data(), loss_fn=nn.CrossEntropyLoss(reduction="none"))

    assert_stopped_at(report, "loss")
    step = report.step("loss")
    assert "shape (2,)" in step.message
    assert ".mean()" in step.hint and "reduction" in step.hint


def test_nan_in_the_data_fails_at_data():
    dataset = classification_data()
    dataset.tensors[0][5, 2] = float("nan")

    report = check_pipeline(TwoLayers(), dataset, loss_fn=nn.CrossEntropyLoss())

    assert_stopped_at(report, "data")
    assert report.step("data").message == "sample 5 has NaN/inf in inputs"


class KeywordClassifier(nn.Module):
    def __init__(self, features=20):
        super().__init__()
        self.linear = nn.Linear(features, 2)

    def forward(self, features, labels=None):
        logits = self.linear(features)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def test_nan_in_python_lists_of_samples_fails_at_data():
    samples = [{"features": [0.5] * 20, "labels": index % 2} for index in range(6)]
    samples[3]["features"][17] = float("nan")  # a long list of numbers, read as one tensor
    report = check_pipeline(KeywordClassifier(), samples)
    assert_stopped_at(report, "data")
    assert report.step("data").message == "sample 3 has NaN/inf in features"

    samples[3]["features"][17] = 0.5
    samples[4]["features"] = [[0.5, 0.5], ("text", float("inf"))]  # numbers nested beside text
    report = check_pipeline(KeywordClassifier(), samples, collate_fn=list)  # a collate_fn that reads text
    assert_stopped_at(report, "data")
    assert report.step("data").message == "sample 4 has NaN/inf in features"


def test_targets_beyond_the_output_size_fail_before_the_loss():
    report = check_pipeline(TwoLayers(classes=3), classification_data(classes=5), loss_fn=nn.CrossEntropyLoss())

    assert_stopped_at(report, "loss")
    step = report.step("loss")
    assert step.message == "labels go up to 4 but the model outputs 3 logits"
    assert "out_features=5" in step.hint


@pytest.mark.parametrize("ignored", [255, -1])  # segmentation's void pixels; a common -1
@pytest.mark.parametrize("as_partial", [False, True])
def test_the_label_the_loss_ignores_is_no_label_out_of_range(ignored, as_partial):
    dataset = classification_data()
    dataset.tensors[1][::4] = ignored
    loss_fn = (functools.partial(nn.functional.cross_entropy, ignore_index=ignored) if as_partial
               else nn.CrossEntropyLoss(ignore_index=ignored))
    assert check_pipeline(TwoLayers(), dataset, loss_fn=loss_fn).ok
    dataset.tensors[1][1] = 3  # but a class the model does not have still is
    report = check_pipeline(TwoLayers(), dataset, loss_fn=loss_fn)
    assert_stopped_at(report, "loss")
    assert report.step("loss").message == "labels go up to 3 but the model outputs 3 logits"


def test_optimizer_over_another_model_fails_at_optimizer():
    model = TwoLayers()
    # The notebook bug: the model cell was re-run, the optimizer still holds the old model.
    stale_optimizer = torch.optim.Adam(TwoLayers().parameters(), lr=1e-3)

    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss(), optimizer=stale_optimizer)

    assert_stopped_at(report, "optimizer")
    step = report.step("optimizer")
    assert step.message == "the optimizer holds none of this model's parameters (it holds 4 other tensors)"
    assert "model.parameters()" in step.hint


def test_optimizer_missing_some_parameters_names_them():
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.body.parameters(), lr=0.1)

    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)

    assert_stopped_at(report, "optimizer")
    assert report.step("optimizer").message == (
        "the optimizer does not hold 2 trainable parameters: head.weight, head.bias"
    )


def test_zero_learning_rate_changes_no_weight():
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)

    assert_stopped_at(report, "optimizer")
    assert "changed no weight" in report.step("optimizer").message


def test_diverging_learning_rate_fails_to_overfit():
    torch.manual_seed(0)  # (from some starts this step size fits the two samples at once)
    model = TwoLayers()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e3)

    report = check_pipeline(model, classification_data(), loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)

    assert_stopped_at(report, "overfit")
    assert "cannot fit a single batch" in report.step("overfit").message


def test_user_model_optimizer_and_random_state_are_untouched():
    model = TwoLayers()
    dataset = classification_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # Give the optimizer real state (step counts, moments) and the parameters gradients.
    nn.functional.cross_entropy(model(dataset.tensors[0]), dataset.tensors[1]).backward()
    optimizer.step()
    model.eval()
    weights = copy.deepcopy(model.state_dict())
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    random_state = torch.random.get_rng_state()

    report = check_pipeline(model, dataset, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)

    assert report.ok, report.to_text()
    assert "Adam(lr=0.01), rebuilt from yours" in report.step("optimizer").message
    assert not model.training
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    assert all(torch.equal(gradients[name], p.grad) for name, p in model.named_parameters())
    after = optimizer.state_dict()
    assert after["param_groups"] == optimizer_state["param_groups"]
    for index, state in optimizer_state["state"].items():
        assert all(torch.equal(value, after["state"][index][key]) for key, value in state.items())
    assert torch.equal(random_state, torch.random.get_rng_state())


def test_an_unexpected_error_is_kept_with_its_traceback():
    class Broken(TwoLayers):
        def forward(self, inputs):
            raise RuntimeError("shape mismatch deep inside")

    report = check_pipeline(Broken(), classification_data(), loss_fn=nn.CrossEntropyLoss())

    assert_stopped_at(report, "forward")
    step = report.step("forward")
    assert step.message == "RuntimeError: shape mismatch deep inside"
    assert isinstance(step.exception, RuntimeError)
    assert 'raise RuntimeError("shape mismatch deep inside")' in step.traceback


def test_lists_collated_by_default_collate_are_called_out():
    class ByKeyword(TwoLayers):
        def forward(self, features, labels):
            return {"loss": nn.functional.cross_entropy(super().forward(features), labels)}

    # Equal-length Python lists: torch's default_collate transposes them into lists of tensors.
    data = [{"features": [0.1 * i, 0.2, 0.3, 0.4], "labels": i % 3} for i in range(6)]

    report = check_pipeline(ByKeyword(), data)

    assert_stopped_at(report, "collate")
    assert report.step("collate").message == "the batch holds non-tensors: features is a list of 4"


@pytest.mark.parametrize(
    "arguments, error, text",
    [
        (("not a model", [1, 2]), TypeError, "torch.nn.Module"),
        ((TwoLayers(), []), ValueError, "empty"),
        ((TwoLayers(), {"train": [], "validation": []}), TypeError, "data['train']"),
        ((TwoLayers(), iter([(torch.zeros(4), 0)])), TypeError, "iterator"),
    ],
)
def test_bad_arguments_raise_one_line_errors(arguments, error, text):
    with pytest.raises(error) as raised:
        check_pipeline(*arguments)
    assert text in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("batch_size, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
def test_bad_batch_size_raises(batch_size, error):
    with pytest.raises(error, match="batch_size"):
        check_pipeline(TwoLayers(), classification_data(), loss_fn=nn.CrossEntropyLoss(), batch_size=batch_size)


# ------------------------------------------------------------------ rendering and imports


def test_renderers_show_the_steps_and_escape_text():
    report = PipelineReport(
        "Net<1>",
        [
            PipelineStep("data", True, "6 samples checked"),
            PipelineStep("collate", False, "cannot stack <tensors> & lists", "pad them: <pad>", traceback="Trace <x>"),
            PipelineStep("forward", None, "not run: 'collate' failed"),
        ],
    )

    text = str(report)
    assert repr(report) == text
    assert text.splitlines() == [
        "Pipeline check for Net<1>: failed at 'collate'",
        "  ✓ data     6 samples checked",
        "  ✗ collate  cannot stack <tensors> & lists",
        "             fix: pad them: <pad>",
        "             (traceback: report.step('collate').traceback)",
        "  · forward  not run: 'collate' failed",
    ]
    page = report._repr_html_()
    assert "Net&lt;1&gt;" in page and "cannot stack &lt;tensors&gt; &amp; lists" in page
    assert "pad them: &lt;pad&gt;" in page and "Trace &lt;x&gt;" in page
    assert "<script" not in page and "<link" not in page and "<tensors>" not in page


def test_doctor_imports_without_transformers_or_ipython():
    program = """
import sys
sys.modules["transformers"] = None  # None in sys.modules makes an import fail
sys.modules["IPython"] = None
import torch
from torch.utils.data import TensorDataset
from numguard_nb import doctor
data = TensorDataset(torch.randn(8, 3), torch.arange(8) % 2)
report = doctor.check_pipeline(torch.nn.Linear(3, 2), data, loss_fn=torch.nn.CrossEntropyLoss())
assert report.ok, report
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=REPOSITORY_ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_loss_class_given_for_its_instance_is_a_one_line_error():
    model = nn.Linear(4, 2)
    data = [(torch.randn(4), torch.tensor(1)) for _ in range(4)]
    with pytest.raises(TypeError, match=r"^loss_fn is the class CrossEntropyLoss: pass an instance, "
                                        r"loss_fn=CrossEntropyLoss\(\)$"):
        check_pipeline(model, data, loss_fn=nn.CrossEntropyLoss)
    with pytest.raises(TypeError, match="^collate_fn must be callable, got int$"):
        check_pipeline(model, data, collate_fn=3)
    with pytest.raises(TypeError, match=r"^loss_fn is the model itself: pass the loss function"):
        check_pipeline(model, data, loss_fn=model)  # (`%numguard_check model dl --loss model`)
