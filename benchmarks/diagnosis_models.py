"""The tiny models of the diagnosis suite, written after the code in the bug reports.

One group per case of diagnosis_cases (which cites the reports): the module names and the
order of operations follow the reported code, at a size that trains in milliseconds on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# ---- t5_ff_fp16_overflow: T5's layer norm and feed-forward, before the fp16 clamp -----------

class T5LayerNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(self.weight.dtype)


class T5DenseReluDense(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states):
        h = self.wi(hidden_states)
        h = F.relu(h)
        h = self.dropout(h)
        h = self.wo(h)
        return h


# t5_gated_ff_fp16_minus_inf: T5 v1.1's gated-GELU feed-forward (wi_0, wi_1, wo)
class T5DenseGatedActDense(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.wi_0 = nn.Linear(d_model, d_ff, bias=False)
        self.wi_1 = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states):
        hidden_gelu = F.gelu(self.wi_0(hidden_states), approximate="tanh")  # "gelu_new"
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = self.dropout(hidden_gelu * hidden_linear)
        return self.wo(hidden_states)


class T5LayerFF(nn.Module):
    def __init__(self, d_model: int, d_ff: int, gated: bool = False):
        super().__init__()
        # T5 v1.1's gated feed-forward keeps the attribute name DenseReluDense, as transformers does
        self.DenseReluDense = (T5DenseGatedActDense if gated else T5DenseReluDense)(d_model, d_ff)
        self.layer_norm = T5LayerNorm(d_model)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states):
        forwarded = self.DenseReluDense(self.layer_norm(hidden_states))
        return hidden_states + self.dropout(forwarded)


class T5Block(nn.Module):
    def __init__(self, d_model: int, d_ff: int, gated: bool = False):
        super().__init__()
        self.layer = nn.ModuleList([T5LayerFF(d_model, d_ff, gated)])

    def forward(self, hidden_states):
        return self.layer[0](hidden_states)


class TinyT5(nn.Module):
    def __init__(self, vocab: int = 32, d_model: int = 16, d_ff: int = 32, layers: int = 2,
                 gated: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.block = nn.ModuleList([T5Block(d_model, d_ff, gated) for _ in range(layers)])
        self.final_layer_norm = T5LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, input_ids, labels):
        hidden_states = self.embed_tokens(input_ids)
        for block in self.block:
            hidden_states = block(hidden_states)
        logits = self.lm_head(self.final_layer_norm(hidden_states))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


# ---- vit_attention_fp16_overflow: timm's ViT block with the explicit (non-fused) attention ----

class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 2):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim * 2)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, patch_dim: int = 48, dim: int = 16, classes: int = 4):
        super().__init__()
        self.patch_embed = nn.Linear(patch_dim, dim)
        self.blocks = nn.ModuleList([ViTBlock(dim)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, patches):
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


# ---- fully_masked_softmax: DistilBERT's attention masked with -inf (before transformers#15326) -

class MaskedSelfAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, x, attention_mask):
        q, k, v = self.q_lin(x), self.k_lin(x), self.v_lin(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])
        mask = (attention_mask == 0).unsqueeze(1)  # (bs, 1, k_length)
        scores = scores.masked_fill(mask, -float("inf"))
        weights = nn.functional.softmax(scores, dim=-1)
        return self.out_lin(weights @ v)


class TinyMaskedEncoder(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, classes: int = 3):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.attention = MaskedSelfAttention(dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, input_ids, attention_mask):
        h = self.attention(self.embeddings(input_ids), attention_mask)
        return self.classifier(h[:, 0])


# ---- masked_mean_empty ----------------------------------------------------------------------

class MaskedMeanPool(nn.Module):
    def forward(self, hidden, mask):
        mask = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


class TinyPooledRegressor(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.pool = MaskedMeanPool()
        self.head = nn.Linear(dim, 1)

    def forward(self, ids, mask):
        return self.head(self.pool(self.encoder(self.embed(ids)), mask)).squeeze(-1)


# ---- distance_at_zero: a Siamese network ------------------------------------------------------

class EuclideanDistance(nn.Module):
    def forward(self, a, b):
        return torch.sqrt(((a - b) ** 2).sum(-1))


class SiameseNet(nn.Module):
    def __init__(self, features: int = 8, dim: int = 8):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.distance = EuclideanDistance()

    def forward(self, left, right):
        return self.distance(self.encoder(left), self.encoder(right))


# ---- handwritten_bce_log0 -------------------------------------------------------------------

class TinyClassifier(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


# ---- all_labels_ignored: the loss computed in forward, as transformers' causal LMs do -----------

class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        logits = self.lm_head(self.mlp(self.embed(input_ids)))
        shift_logits = logits[:, :-1, :].contiguous()
        shift_labels = labels[:, 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                               ignore_index=-100)


# ---- layernorm_fp16_variance: a LayerNorm with the variance as E[x^2] - E[x]^2 -----------------

class HandLayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class NormedMLP(nn.Module):
    def __init__(self, features: int = 8, dim: int = 16):
        super().__init__()
        self.proj = nn.Linear(features, dim)
        self.act = nn.ReLU()
        self.norm = HandLayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        return self.head(self.norm(self.act(self.proj(x)))).squeeze(-1)


# ---- nan_in_data ----------------------------------------------------------------------------

class TinyConvNet(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        return self.fc(self.pool(self.act(self.conv(x))).flatten(1))


# ---- adam_eps_fp16 ---------------------------------------------------------------------------

class TinyBagOfWords(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 8, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


# ---- vae_conv_fp16_overflow: diffusers' decoder layout (conv_in, mid resnet, norm, conv_out) ----

class ResnetBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class TinyDecoder(nn.Module):
    def __init__(self, latent: int = 4, channels: int = 8):
        super().__init__()
        self.conv_in = nn.Conv2d(latent, channels, 3, padding=1)
        self.mid = ResnetBlock(channels)
        self.conv_norm_out = nn.GroupNorm(2, channels)
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        return self.conv_out(F.silu(self.conv_norm_out(h)))


class TinyVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = TinyDecoder()

    def forward(self, z):
        return self.decoder(z)


# ---- trap_padding_mask: the -inf mask is made in the model and passed to every layer ----------

class AdditiveMaskAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, additive_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1]) + additive_mask
        return x + self.out(scores.softmax(-1) @ v)


class PaddedEncoder(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([AdditiveMaskAttention(dim) for _ in range(2)])
        self.classifier = nn.Linear(dim, classes)

    def forward(self, ids, attention_mask):
        additive = torch.zeros(attention_mask.shape, dtype=torch.float32)
        additive = additive.masked_fill(attention_mask == 0, float("-inf")).unsqueeze(1)
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, additive)
        return self.classifier(h[:, 0])


# ---- trap_causal_mask ------------------------------------------------------------------------

class CausalEncoder(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, ids):
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.lm_head(self.layer(self.embed(ids), causal))


# ---- attention_pool_nan_to_num: attention pooling, additive -inf mask, then nan_to_num ------

class MaskedAttentionPool(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, hidden, mask):
        additive = torch.zeros_like(mask, dtype=hidden.dtype).masked_fill(mask == 0, float("-inf"))
        weights = torch.softmax(self.score(hidden).squeeze(-1) + additive, dim=-1)
        weights = torch.nan_to_num(weights)  # "an empty sequence pools to zeros"
        return (weights.unsqueeze(-1) * hidden).sum(1)


class TinyPooledClassifier(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.pool = MaskedAttentionPool(dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, ids, mask):
        return self.classifier(self.pool(self.encoder(self.embed(ids)), mask))


# ---- lstm_bptt_explosion: the word-language-model layout (embedding, LSTM, decoder) ---------

class TinyLSTMLM(nn.Module):
    def __init__(self, vocab: int = 32, emb: int = 16, hidden: int = 256):
        super().__init__()
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, ids):
        output, _ = self.rnn(self.encoder(ids))
        return self.decoder(output)


# ---- constant_feature_std0: a tabular MLP on standardised continuous columns ----------------

class TabularMLP(nn.Module):
    def __init__(self, features: int = 10, hidden: int = 16):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.layers(x).squeeze(-1)


# ---- where_sqrt_beside_skip: a gate computed in the block's own code, beside a skip path -------

class GatedSkipBlock(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, dim)
        self.skip = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.proj(x)
        energy = (h * h).sum(-1, keepdim=True)
        # "safe" sqrt: the where keeps sqrt(0) out of the output, not out of the backward
        gate = torch.where(energy > 0, energy.sqrt(), torch.zeros_like(energy))
        return self.head(h * gate) + self.skip(h)


class GatedSkipNet(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.block = GatedSkipBlock(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        return self.out(self.block(x)).squeeze(-1)


# ---- arcface_acos_at_one: ArcFace's additive angular margin, the angle taken by acos ---------

class ArcMarginProduct(nn.Module):
    """ArcFace's head: cos(theta + m) for the label's class, cos(theta) for the others."""

    def __init__(self, in_features: int, out_features: int, s: float = 16.0, m: float = 0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.s, self.m = s, m

    def forward(self, embedding, label):
        cosine = F.linear(F.normalize(embedding), F.normalize(self.weight)).clamp(-1, 1)
        theta = torch.acos(cosine)
        target = torch.cos(theta + self.m)
        one_hot = F.one_hot(label, cosine.shape[1]).bool()
        return self.s * torch.where(one_hot, target, cosine)


class TinyFaceNet(nn.Module):
    def __init__(self, features: int = 4, classes: int = 3):
        super().__init__()
        self.backbone = nn.Linear(features, features, bias=False)
        self.head = ArcMarginProduct(features, classes)

    def forward(self, x, label):
        return self.head(self.backbone(x), label)


# ---- beta_policy_action_at_bound: an actor giving a Beta policy's concentrations -------------

class BetaActor(nn.Module):
    def __init__(self, observations: int = 3, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(observations, hidden), nn.Tanh())
        self.alpha_head = nn.Linear(hidden, 1)
        self.beta_head = nn.Linear(hidden, 1)

    def forward(self, obs):
        h = self.body(obs)
        # concentrations above 1: a unimodal Beta
        return (F.softplus(self.alpha_head(h)).squeeze(-1) + 1.0,
                F.softplus(self.beta_head(h)).squeeze(-1) + 1.0)


# ---- ctc_target_longer_than_input, trap_ctc_zero_infinity: wenet's layout (subsampling, CTC) ---

class Conv1dSubsampling4(nn.Module):
    """wenet's Conv2dSubsampling4 in one dimension: two stride-2 convolutions, 4x fewer frames."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(idim, odim, 2, stride=2), nn.ReLU(),
                                  nn.Conv1d(odim, odim, 2, stride=2), nn.ReLU())

    def forward(self, x, x_lens):
        return self.conv(x.transpose(1, 2)).transpose(1, 2), x_lens // 4


class CTC(nn.Module):
    """wenet's CTC module: projection, log-softmax, CTCLoss summed and divided by the batch."""

    def __init__(self, odim: int, encoder_output_size: int, zero_infinity: bool = False):
        super().__init__()
        self.ctc_lo = nn.Linear(encoder_output_size, odim)
        self.ctc_loss = nn.CTCLoss(reduction="sum", zero_infinity=zero_infinity)

    def forward(self, hs_pad, hlens, ys_pad, ys_lens):
        ys_hat = self.ctc_lo(hs_pad).transpose(0, 1).log_softmax(2)
        return self.ctc_loss(ys_hat, ys_pad, hlens, ys_lens) / ys_hat.size(1)


class TinyCTCModel(nn.Module):
    def __init__(self, idim: int = 5, dim: int = 16, vocab: int = 6, zero_infinity: bool = False):
        super().__init__()
        self.embed = Conv1dSubsampling4(idim, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.ReLU())
        self.ctc = CTC(vocab, dim, zero_infinity)

    def forward(self, feats, feats_lens, text, text_lens):
        h, h_lens = self.embed(feats, feats_lens)
        return self.ctc(self.encoder(h), h_lens, text, text_lens)


# ---- log_of_softmax_underflow: a classifier returning torch.log(softmax(logits)) ---------------

class LogProbClassifier(nn.Module):
    def __init__(self, features: int = 10, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        probs = F.softmax(self.fc2(self.act(self.fc1(x))), dim=-1)
        return torch.log(probs)  # not F.log_softmax


# ---- adain_blank_style_variance: AdaIN with the variance as E[x^2] - E[x]^2 -------------------

class AdaIN(nn.Module):
    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def stats(self, feat):
        mean = feat.mean((2, 3), keepdim=True)
        var = (feat * feat).mean((2, 3), keepdim=True) - mean * mean
        return mean, torch.sqrt(var) + self.eps

    def forward(self, content, style):
        content_mean, content_std = self.stats(content)
        style_mean, style_std = self.stats(style)
        return (content - content_mean) / content_std * style_std + style_mean


class TinyStyleNet(nn.Module):
    """AdaIN style transfer: a frozen encoder (VGG's first layers in the paper), trained decoder."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.encoder = nn.Conv2d(3, channels, 1)
        self.encoder.requires_grad_(False)
        self.adain = AdaIN()
        self.decoder = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(channels, 3, 3, padding=1))

    def forward(self, content, style):
        return self.decoder(self.adain(self.encoder(content), self.encoder(style)))


# ---- gumbel_tau_annealed_to_zero: a searched cell mixing candidate ops by gumbel-softmax ------

class GumbelMixedOp(nn.Module):
    def __init__(self, dim: int = 8, candidates: int = 3):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(candidates))  # architecture weights
        self.ops = nn.ModuleList([nn.Linear(dim, dim) for _ in range(candidates)])

    def forward(self, x, tau):
        weights = F.gumbel_softmax(self.alpha.expand(x.shape[0], -1), tau=tau, hard=False)
        return sum(weights[:, i:i + 1] * op(x) for i, op in enumerate(self.ops))


class TinySearchNet(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.cell = GumbelMixedOp(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x, tau):
        return self.head(F.relu(self.cell(x, tau))).squeeze(-1)
