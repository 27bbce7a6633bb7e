"""A GPT-shaped plain torch.nn.Module (nanoGPT's shape), written for this project; no dtape here.

Not a scripts/train.py task: the model that scripts/bench.py and scripts/bench_multiworker.py train
through dtape.layers.TorchModule and under DistributedDataParallel, and that the tests of
dtape.optimizers.from_torch train against plain torch (tests/_gpt.py).

Token and position embeddings, `layers` pre-norm blocks (causal self-attention through
torch.nn.functional.scaled_dot_product_attention, a GELU MLP four times as wide), a final
LayerNorm and a head tied to the token embedding; GPT-2's initialisation (normal, std 0.02;
zero biases). Input: int64 token ids [batch, time] with time <= context; output: float logits
[batch, time, vocab].
"""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each added to its input."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT(vocab, context, width, heads, layers): see the module docstring."""

    def __init__(self, vocab, context, width, heads, layers):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's initialisation: small weights, so the loss starts near log(vocab)
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


def adamw_groups(params, weight_decay=0.1):
    """nanoGPT's parameter groups: matrices (and embeddings) decay, vectors (biases, norms) do not."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def counting_batches(steps, batch, context, vocab, seed=0):
    """`steps` (inputs, targets) int64 pairs [batch, context] of a noisy counting sequence (learnable)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        seq = (start + torch.arange(context + 1)) % vocab
        noise = torch.rand(seq.shape, generator=gen) < 0.1
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen), seq)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
