"""A small torch.nn.Module with a tied weight (read twice), a frozen layer and a layer its forward never uses
(a None gradient), shared by tests/test_break_s6.py and its torchrun worker; plain torch."""
import torch
from torch import nn


class TiedFrozenUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused, self.frozen = (nn.Linear(3, 3) for _ in range(4))
        self.b.weight = self.a.weight
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.frozen(x)
