import torch, numpy as np
from torch import nn
import dtape
from dtape import distribute as ds
f64=torch.float64
x=torch.randn(4,3,dtype=f64,generator=torch.Generator().manual_seed(1))
def mk():
    torch.manual_seed(0); return nn.Sequential(nn.Linear(3,4), nn.Tanh(), nn.Linear(4,2)).double()
# bias None after wrapping
for kind in ["one","mirrored"]:
    ref=mk(); ref[2].bias=None; ro=torch.optim.SGD(ref.parameters(),lr=0.1)
    for _ in range(2): ro.zero_grad(); ref(x).square().sum().backward(); ro.step()
    s = ds.MirroredStrategy(["cpu:0","cpu:1"],timeout=20) if kind=="mirrored" else ds.OneDeviceStrategy("cpu")
    m=mk()
    with s.scope(): tm=dtape.layers.TorchModule(m); o=dtape.optimizers.SGD(0.1)
    m[2].bias=None
    def step(x):
        v=tm.trainable_variables
        with dtape.GradientTape() as tape: loss=dtape.reduce_sum(dtape.square(tm(x)))
        o.apply_gradients(zip(tape.gradient(loss,v),v))
    try:
        for _ in range(2):
            for xx in s.experimental_distribute_dataset([x.numpy()]): s.run(step,args=(xx,))
        print("bias None", kind, len(tm.trainable_variables), all(torch.allclose(a,b) for a,b in zip(m.parameters(), ref.parameters())))
    except Exception as e: print("bias None", kind, "ERR", str(e)[:300])
    if kind=="mirrored": s.close()
# freezing inside a compiled body
ref=mk(); ro=torch.optim.SGD(ref.parameters(),lr=0.1)
for i in range(3):
    if i==1: ref[0].weight.requires_grad_(False)
    ro.zero_grad(); ref(x).square().sum().backward(); ro.step()
m=mk(); tm=dtape.layers.TorchModule(m); o=dtape.optimizers.SGD(0.1)
@dtape.function(jit_compile=True)
def cstep(x, freeze):
    if freeze: m[0].weight.requires_grad_(False)
    v=tm.trainable_variables
    with dtape.GradientTape() as tape: loss=dtape.reduce_sum(dtape.square(tm(x)))
    o.apply_gradients(zip(tape.gradient(loss,v),v))
for i in range(3):
    cstep(dtape.constant(x.numpy()), i>=1)
print("compiled freeze", [(n, float((a-b).abs().max())) for (n,a),b in zip(m.named_parameters(), ref.parameters())])
