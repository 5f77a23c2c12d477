import faulthandler, sys; faulthandler.enable()
import torch, compcomm
from compcomm import _C
from compcomm._buffers import buffer_of
comm = _C.LocalCommunicator()
def step(name, f):
    print("->", name, flush=True); f(); torch.cuda.synchronize(); print("ok", name, flush=True)
a = torch.arange(64, dtype=torch.uint8); b = torch.zeros(64, dtype=torch.uint8)
step("cpu all_gather", lambda: comm.all_gather(buffer_of(a), buffer_of(b)))
t = torch.randn(4099); we, se = compcomm.error_buffers(t, comm)
ws = torch.zeros(1 << 16, dtype=torch.uint8)
print(_C.compressed_allreduce_layout(we.numel(), 1, False), flush=True)
step("cpu raw allreduce", lambda: _C.compressed_allreduce(comm, buffer_of(t), buffer_of(we), buffer_of(se), buffer_of(ws), 600.0, 0, True))
ag = a.cuda(); bg = b.cuda()
step("gpu all_gather", lambda: comm.all_gather(buffer_of(ag), buffer_of(bg)))
tg = torch.randn(4099, device="cuda"); weg, seg = compcomm.error_buffers(tg, comm)
wsg = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
step("gpu raw allreduce", lambda: _C.compressed_allreduce(comm, buffer_of(tg), buffer_of(weg), buffer_of(seg), buffer_of(wsg), 600.0, 0, True))
step("gpu api allreduce", lambda: compcomm.compressed_allreduce(tg, weg, seg, comm))
