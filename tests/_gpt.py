"""A small GPT-shaped torch.nn.Module and its data and optimizers, shared by the from_torch tests and their
torchrun worker: plain torch, written for this project (token + position embeddings, causal self-attention
through scaled_dot_product_attention, a GELU MLP, a head tied to the token embedding)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 64, 16, 32, 2, 2
GLOBAL_BATCH = 8


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (scaled_dot_product_attention) and a GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc_out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """Token + position embeddings, LAYERS blocks, final LayerNorm, head tied to the token embedding."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's initialisation: small weights, so the loss starts near log(VOCAB)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def batches(steps, seed=0):
    """`steps` global batches (inputs, targets) of a noisy counting sequence: learnable, so the loss falls."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=gen)
        seq = (start + torch.arange(CONTEXT + 1)) % VOCAB
        noise = torch.rand(seq.shape, generator=gen) < 0.1
        seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def warmup_cosine(warmup, total, floor=0.1):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def adamw_groups(params):
    """nanoGPT's split: matrices (and embeddings) decay, vectors (biases, norms) do not."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


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
