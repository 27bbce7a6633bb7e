"""A small GPT-shaped torch.nn.Module and its data and optimizers, shared by the from_torch tests and their
torchrun worker: plain torch, written for this project (token + position embeddings, causal self-attention
through scaled_dot_product_attention, a GELU MLP, a head tied to the token embedding). The model and the data
are scripts/tasks/torch_gpt.py's, which scripts/bench.py trains too, at a smaller size."""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from tasks import torch_gpt  # noqa: E402

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 64, 16, 32, 2, 2
GLOBAL_BATCH = 8


def TinyGPT():
    """The project's GPT-shaped module (scripts/tasks/torch_gpt.py, shared with bench.py) at this size."""
    return torch_gpt.GPT(VOCAB, CONTEXT, WIDTH, HEADS, LAYERS)


def batches(steps, seed=0):
    """`steps` global batches (inputs, targets) of a noisy counting sequence: learnable, so the loss falls."""
    return torch_gpt.counting_batches(steps, GLOBAL_BATCH, CONTEXT, VOCAB, seed)


def warmup_cosine(warmup, total, floor=0.1):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


adamw_groups = torch_gpt.adamw_groups  # nanoGPT's split: matrices (and embeddings) decay, vectors do not


def make_adamw(params, steps):
    opt = torch.optim.AdamW(adamw_groups(params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, steps))


def make_sgd(params, steps):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, steps // 2), gamma=0.1)


def torch_run(model, make_optimizer, data, clip):
    """Per-step losses (and the clip_grad_norm_ totals) of plain single-process torch."""
    params = list(model.parameters())
    opt, sched = make_optimizer(params, len(data))
    losses, norms = [], []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms, opt


def seeded_gpt(seed=0):
    torch.manual_seed(seed)
    return TinyGPT()
