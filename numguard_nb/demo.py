"""`python -m numguard_nb.demo`: catch the fp16 overflow from Hugging Face's documentation.

A tiny T5 (random weights, built from a config: nothing is downloaded) runs in float16. One
encoder layer's gated-GELU feed-forward has weights large enough that its `wo` projection
overflows float16's 65504, the case Hugging Face's debugging guide shows with t5-large. The
demo leads with the verdict: the module that produced the inf, why (the numbers, float16's
65504) and what to try, and (ops=True) the ATen op and the line of model code that produced it;
then the frames that led to it, in Hugging Face's format.
"""

from __future__ import annotations

import torch

from .errors import NonFiniteError
from .explain import hint_for
from .guard import Guard
from .render.text import dump_lines, verdict_lines


def build_overflowing_t5(seed: int = 0):
    """A 2-layer T5 in float16 whose encoder.block.1 feed-forward overflows, and one batch."""
    try:
        from transformers import T5Config, T5ForConditionalGeneration
    except ImportError:
        raise SystemExit('the demo builds a Hugging Face T5: pip install "numguard_nb[hf]" '
                         '(from a checkout: pip install -e ".[hf]")') from None

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config).half()
    feed_forward = model.encoder.block[1].layer[1].DenseReluDense
    with torch.no_grad():  # weights as they might drift in a long fp16 run
        for linear in (feed_forward.wi_0, feed_forward.wi_1, feed_forward.wo):
            linear.weight.mul_(30)
    batch = {
        "input_ids": torch.randint(1, 128, (2, 16)),
        "attention_mask": torch.ones(2, 16, dtype=torch.long),
        "labels": torch.randint(1, 128, (2, 8)),
    }
    return model, batch


def main() -> int:
    model, batch = build_overflowing_t5()
    print("Training step of a float16 T5 under numguard_nb.Guard ...\n")
    try:
        with Guard(model, ops=True):  # ops: name the ATen op and the source line too
            loss = model(**batch).loss
            loss.backward()
    except NonFiniteError as error:
        report = error.report
        report.hint = report.hint or hint_for(report)
        print(f"Caught {type(error).__name__} in batch {report.batch_number}:")
        print("\n".join(verdict_lines(report)))
        print()
        print("\n".join(dump_lines(report)))
        return 0
    print(f"No inf/nan detected (loss={loss.item():.4f}): the demo expected an overflow.")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
