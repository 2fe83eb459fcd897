"""The language-model loss straight from the head's features, without the [tokens, vocabulary] logits.

The head's last product, features [n, width] x word embeddings [vocabulary, width]^T, and the cross
entropy over its rows are computed a block of rows at a time: the block's logits, their log-sum-exp,
the loss, and at once the block's gradient (softmax - one-hot), which two products turn into the
features' and the embeddings' gradients. On a CPU a block's logits stay in the cache, where the
unfused loss makes a pass through memory over the whole logits tensor (4096 x 8192 fp32 values,
128 MiB, at the GPT prototype's shape) for each of its steps: maximum, subtraction, exponential,
sum, division, and again for the gradient. On one CPU core those passes took about a third of the
small level's step (175 of 543 ms); the products are the same, so the FLOPs are too.

The gradients are computed in the forward pass (the backward only scales them), so no logits are
kept for it either. They are those of the summed loss, in the features' dtype, and are scaled to the
mean loss in fp32 in the backward pass: under fp16 the unscaled gradients of a mean over thousands
of tokens would underflow, while the summed loss's are about the size that the unfused loss's
gradients have under a loss scale of the same order.

Only for a vocabulary that is not split over tensor-parallel ranks, outside pipelines (whose last
stage hands its logits to DeepSpeed's loss function): megatron's vocab-parallel cross entropy
(msds.model.transformer.token_loss) is the loss there.
"""
from __future__ import annotations

from typing import Optional

import torch

from msds.data.samples import IGNORE_INDEX

# Logits per block. On a CPU 2**21 fp32 values (8 MiB; 256 rows of an 8192-token vocabulary): on one
# core at that vocabulary and widths 128 and 256, 256 rows ran as fast as any of 64 to 1024. On an
# accelerator, where no cache holds a block, the blocks are there to bound memory, not to be cached:
# 2**26 values (256 MiB), some 1,300 rows of a 50,257-token vocabulary, so that each product still
# fills the device (not measured).
BLOCK_ELEMENTS = 2**21
ACCELERATOR_BLOCK_ELEMENTS = 2**26


def block_rows(device: torch.device, vocab_size: int) -> int:
    """Rows of features per block: BLOCK_ELEMENTS logits on a CPU, ACCELERATOR_BLOCK_ELEMENTS elsewhere."""
    elements = BLOCK_ELEMENTS if device.type == "cpu" else ACCELERATOR_BLOCK_ELEMENTS
    return max(1, elements // vocab_size)


def linear_cross_entropy(features: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross entropy of `features` [..., width] x `weight` [rows, width]^T (+ `bias` [rows])
    against `labels` [...], over the labels that are not IGNORE_INDEX; rows of `weight` from
    `vocab_size` on are padding and take no part (no probability, no gradient). The same loss and
    gradients as `token_loss(F.linear(features, weight) + bias, labels)` with those rows at -inf."""
    features, labels = features.reshape(-1, features.shape[-1]), labels.reshape(-1)
    keep = labels != IGNORE_INDEX
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (features, weight, bias)):
        return _LinearCrossEntropy.apply(features, weight, bias, labels, keep, vocab_size)
    with torch.no_grad():
        total, _ = _blocks(features, weight, bias, labels, keep, vocab_size, gradients=False)
    return total / keep.sum().clamp(min=1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, bias, labels, keep, vocab_size):
        total, grads = _blocks(features, weight, bias, labels, keep, vocab_size, gradients=True)
        count = keep.sum().clamp(min=1)
        ctx.save_for_backward(count, *grads)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        count, grad_features, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss.float() / count

        def scaled(grad):
            return (grad.float() * scale).to(grad.dtype)

        return (scaled(grad_features), scaled(grad_weight), None if grad_bias is None else scaled(grad_bias),
                None, None, None)


def _blocks(features, weight, bias, labels, keep, vocab_size: int, gradients: bool):
    """The summed loss (fp32) and, with `gradients`, its gradients with respect to the features, the
    weight and the bias (None without one), block by block."""
    real_weight = weight[:vocab_size]
    real_bias = None if bias is None else bias[:vocab_size].float()   # cast once, added to fp32 logits
    total = torch.zeros((), dtype=torch.float32, device=features.device)
    if gradients:
        grad_features = torch.empty_like(features)
        # Accumulated over blocks in fp32 whatever the parameters' dtype, then cast once.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        # The real rows' views, updated in place: the padding rows keep a zero gradient.
        weight_update = grad_weight[:vocab_size]
        bias_update = None if bias is None else grad_bias[:vocab_size]
    rows = block_rows(features.device, vocab_size)
    for start in range(0, features.shape[0], rows):
        block = features[start:start + rows]
        block_keep = keep[start:start + rows]
        targets = labels[start:start + rows].masked_fill(~block_keep, 0)
        logits = (block @ real_weight.t()).float()
        if real_bias is not None:
            logits += real_bias
        index = torch.arange(len(targets), device=logits.device)
        target_logits = logits[index, targets]
        top = logits.amax(dim=-1, keepdim=True)
        exp = logits.sub_(top).exp_()                  # in the logits' memory: one pass each
        sums = exp.sum(dim=-1)
        total += ((sums.log() + top.squeeze(-1) - target_logits) * block_keep).sum()
        if not gradients:
            continue
        probs = exp.mul_((block_keep / sums).unsqueeze(-1))   # the softmax; zero in ignored rows
        probs[index, targets] -= block_keep.float()
        grad_logits = probs.to(features.dtype)
        torch.mm(grad_logits, real_weight, out=grad_features[start:start + rows])
        if features.dtype == torch.float32:
            weight_update.addmm_(grad_logits.t(), block)
        else:
            weight_update += (grad_logits.t() @ block).float()
        if bias_update is not None:
            bias_update += probs.sum(dim=0)
    if not gradients:
        return total, None
    return total, (grad_features, grad_weight.to(weight.dtype), None if bias is None else grad_bias.to(bias.dtype))
