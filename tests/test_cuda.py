"""CUDA kernels against their CPU twins, and compressed_allreduce on a GPU against the CPU path.

The CPU twins (compcomm._C.kernels on host Buffers) are the oracle: packed signs must be bit-identical,
errors and outputs equal (the fp32 arithmetic is done in the same order), scales equal to fp32 rounding
(only the order of the fp64 norm sum differs). Outputs are poisoned first so every element must be
written, and memory past the end of an output must stay untouched.
"""

from __future__ import annotations

import pytest
import torch

import compcomm
from compcomm import _C
from compcomm._buffers import buffer_of
from _backends import no_cuda_kernels, no_gpu, skipif

K = _C.kernels

pytestmark = [pytest.mark.gpu, skipif(no_gpu() or no_cuda_kernels())]

SIZES = [1, 7, 4099, 2**20 + 3, 2**26]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEV = "cuda"


def _dtype_id(d: torch.dtype) -> str:
    """Test id of a dtype parameter: "float32" for torch.float32."""
    return str(d).split(".")[-1]


def _rand(n: int, dtype: torch.dtype, gen: torch.Generator, special: bool = True) -> torch.Tensor:
    """Normal values on the GPU; with `special`, some exact +0, -0 and tiny values (sign edge cases)."""
    t = torch.randn(n, generator=gen, device=DEV).to(dtype)
    if special and n >= 8:
        idx = torch.randint(0, n, (max(1, n // 50),), generator=gen, device=DEV)
        t[idx[0::3]] = 0.0
        t[idx[1::3]] = -0.0
        t[idx[2::3]] *= 1e-30
    return t


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    return g


def _ws(count: int) -> torch.Tensor:
    return torch.zeros(max(1, K.scale_workspace_bytes(count, True)), dtype=torch.uint8, device=DEV)


_CPU_WS = torch.zeros(16, dtype=torch.uint8)  # the CPU twins need no scratch (0 bytes)


def _cpu_ws() -> torch.Tensor:
    assert K.scale_workspace_bytes(1, False) <= _CPU_WS.numel()
    return _CPU_WS


def _b(t: torch.Tensor) -> _C.Buffer:
    return buffer_of(t)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} of {a.numel()} differ, first at {bad[:5].flatten().tolist()}"


def _close_scale(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=2.5e-7, atol=0.0)


def _padded(n: int, world: int) -> int:
    return compcomm.padded_numel(n, world)


# ---- worker kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", SIZES)
def test_worker_kernels_match_cpu(n: int, dtype: torch.dtype) -> None:
    g = _gen(n * 7 + DTYPES.index(dtype))
    P = _padded(n, 4)
    m, e = _rand(n, dtype, g), _rand(P, torch.float32, g)
    mc, ec = m.cpu(), e.cpu()

    sc, sgc = torch.zeros(1), torch.zeros(P // 8, dtype=torch.uint8)
    K.worker_scale_pack(_b(mc), _b(ec), _b(sc), _b(sgc), _b(_cpu_ws()))

    ws = _ws(P)  # reused by every call below: the norm kernels must leave it ready for the next one
    for poison in (0x00, 0xFF):
        s = torch.full((1,), float("nan"), device=DEV)
        sg = torch.full((P // 8,), poison, dtype=torch.uint8, device=DEV)
        K.worker_scale_pack(_b(m), _b(e), _b(s), _b(sg), _b(ws))
        torch.cuda.synchronize()
        _close_scale(s, sc)
        _same_bits(sg, sgc)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", [5, 4099, 2**20 + 3])
def test_worker_kernels_unaligned(n: int, dtype: torch.dtype) -> None:
    """Pointers that are not 16-byte aligned take the scalar path; results must not change."""
    g = _gen(n + 11)
    P = _padded(n, 2)
    mbase, ebase = _rand(n + 1, dtype, g), _rand(P + 1, torch.float32, g)
    m, e = mbase[1:], ebase[1:]
    mc, ec = m.cpu(), e.cpu()
    sc, sgc = torch.zeros(1), torch.zeros(P // 8, dtype=torch.uint8)
    K.worker_scale_pack(_b(mc), _b(ec), _b(sc), _b(sgc), _b(_cpu_ws()))
    s = torch.full((1,), float("nan"), device=DEV)
    sg = torch.full((P // 8,), 0xA5, dtype=torch.uint8, device=DEV)
    K.worker_scale_pack(_b(m), _b(e), _b(s), _b(sg), _b(_ws(P)))
    _close_scale(s, sc)
    _same_bits(sg, sgc)


# ---- server kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_server_kernels_match_cpu(n: int, world: int) -> None:
    g = _gen(n * 13 + world)
    C = _padded(n, world) // world
    stride = 8  # scales strided as in the exchanged headers
    signs = torch.randint(0, 256, (world * C // 8,), dtype=torch.uint8, generator=g, device=DEV)
    scales = torch.rand(world * stride, generator=g, device=DEV) + 0.01
    serr = _rand(C, torch.float32, g) * 0.1
    sc_c, pk_c = torch.zeros(1), torch.zeros(C // 8, dtype=torch.uint8)
    signs_c, scales_c, serr_c = signs.cpu(), scales.cpu(), serr.cpu()
    K.server_scale_pack(_b(signs_c), _b(scales_c), stride, world, _b(serr_c), _b(sc_c), _b(pk_c), _b(_cpu_ws()))

    ws = _ws(C)
    for poison in (0x00, 0xFF):
        sc = torch.full((1,), float("nan"), device=DEV)
        pk = torch.full((C // 8,), poison, dtype=torch.uint8, device=DEV)
        K.server_scale_pack(_b(signs), _b(scales), stride, world, _b(serr), _b(sc), _b(pk), _b(ws))
        _close_scale(sc, sc_c)
        _same_bits(pk, pk_c)

    # server_update with the same tau on both sides: errors bit-identical.
    tau_c = sc_c.clone()
    tau = tau_c.to(DEV)
    K.server_update(_b(signs_c), _b(scales_c), stride, world, _b(serr_c), _b(tau_c))
    K.server_update(_b(signs), _b(scales), stride, world, _b(serr), _b(tau))
    _same_bits(serr, serr_c)


# ---- the commit kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("n", SIZES)
def test_update_decompress_matches_cpu(n: int, world: int, dtype: torch.dtype) -> None:
    g = _gen(n * 17 + world * 3 + DTYPES.index(dtype))
    P = _padded(n, world)
    C = P // world
    sentinel = 1024.0  # exact in every dtype
    # m lives in a bigger buffer: elements past n must stay untouched.
    mbase = torch.full((n + 16,), sentinel, dtype=dtype, device=DEV)
    mbase[:n] = _rand(n, dtype, g)
    m, e = mbase[:n], _rand(P, torch.float32, g)
    scale = torch.rand(1, generator=g, device=DEV) + 0.5
    oss, osb = 4, C // 8 + 16  # record-like strides
    out_scales = torch.rand(world * oss, generator=g, device=DEV) + 0.25
    out_signs = torch.randint(0, 256, (world * osb,), dtype=torch.uint8, generator=g, device=DEV)
    mc_base, ec = mbase.cpu(), e.cpu()
    host = [scale.cpu(), out_scales.cpu(), out_signs.cpu()]  # kept alive while the Buffers are used
    K.worker_update_decompress(_b(mc_base[:n]), _b(ec), _b(host[0]), _b(host[1]), oss, _b(host[2]), osb, world)
    K.worker_update_decompress(_b(m), _b(e), _b(scale), _b(out_scales), oss, _b(out_signs), osb, world)
    _same_bits(mbase, mc_base)  # includes the untouched tail
    _same_bits(e, ec)
    assert bool((mbase[n:].float() == sentinel).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_update_decompress_unaligned(dtype: torch.dtype) -> None:
    g = _gen(99 + DTYPES.index(dtype))
    n, world = 4099, 2
    P = _padded(n, world)
    mbase, ebase = _rand(n + 1, dtype, g), _rand(P + 1, torch.float32, g)
    m, e = mbase[1:], ebase[1:]
    mc, ec = m.cpu().clone(), e.cpu().clone()
    scale = torch.tensor([0.7], device=DEV)
    out_scales = torch.tensor([0.3, 0.9], device=DEV)
    out_signs = torch.randint(0, 256, (P // 8,), dtype=torch.uint8, generator=g, device=DEV)
    host = [scale.cpu(), out_scales.cpu(), out_signs.cpu()]  # kept alive while the Buffers are used
    K.worker_update_decompress(_b(mc), _b(ec), _b(host[0]), _b(host[1]), 1, _b(host[2]), P // 16, world)
    K.worker_update_decompress(_b(m), _b(e), _b(scale), _b(out_scales), 1, _b(out_signs), P // 16, world)
    _same_bits(m, mc)
    _same_bits(e, ec)


def test_guard_makes_commit_kernels_no_ops() -> None:
    g = _gen(5)
    n, world = 4099, 2
    P = _padded(n, world)
    m, e = _rand(n, torch.float32, g), _rand(P, torch.float32, g)
    serr = _rand(P // world, torch.float32, g)
    signs = torch.randint(0, 256, (P // 8,), dtype=torch.uint8, generator=g, device=DEV)
    scales = torch.tensor([0.5, 0.25], device=DEV)
    m0, e0, s0 = m.clone(), e.clone(), serr.clone()
    for bad in (float("nan"), float("inf")):
        guard = torch.tensor([1.0, bad], device=DEV)
        K.server_update(_b(signs), _b(scales), 1, world, _b(serr), _b(scales[:1]), guard=_b(guard))
        K.worker_update_decompress(
            _b(m), _b(e), _b(scales[:1]), _b(scales), 1, _b(signs), P // 16, world, guard=_b(guard)
        )
        _same_bits(m, m0)
        _same_bits(e, e0)
        _same_bits(serr, s0)
    guard = torch.tensor([1.0, 2.0], device=DEV)
    K.worker_update_decompress(
        _b(m), _b(e), _b(scales[:1]), _b(scales), 1, _b(signs), P // 16, world, guard=_b(guard)
    )
    assert not torch.equal(e, e0)


# ---- compressed_allreduce on the GPU -------------------------------------------------------------


def _rounds(n: int, dtype: torch.dtype, device: str, rounds: int, group=None, check: bool = True):
    """Outputs and errors after each of `rounds` calls with fresh inputs (errors carried)."""
    g = torch.Generator()
    g.manual_seed(n + rounds)
    we, se = compcomm.error_buffers(n, group, device=device)
    out = []
    for _ in range(rounds):
        t = torch.randn(n, generator=g).to(dtype).to(device)
        compcomm.compressed_allreduce(t, we, se, group, check=check)
        out.append((t.cpu().clone(), we.cpu().clone(), se.cpu().clone()))  # .cpu() aliases CPU tensors
    return out


def _assert_rounds_close(gpu, cpu) -> None:
    """Each round's tensors (tuples of the same length) equal to 1e-5 of max(1, max|cpu|)."""
    for rg, rc in zip(gpu, cpu):
        assert len(rg) == len(rc)
        for a, b in zip(rg, rc):
            a, b = a.float(), b.float()
            tol = 1e-5 * max(1.0, float(b.abs().max()))
            torch.testing.assert_close(a, b, rtol=0.0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", [1, 7, 4099, 2**20 + 3])
def test_compressed_allreduce_gpu_equals_cpu_local(n: int, dtype: torch.dtype) -> None:
    comm = _C.LocalCommunicator()
    cpu = _rounds(n, dtype, "cpu", 3, comm)
    gpu = _rounds(n, dtype, DEV, 3, comm)
    _assert_rounds_close(gpu, cpu)
    unchecked = _rounds(n, dtype, DEV, 3, comm, check=False)
    for a, b in zip(unchecked, gpu):
        for x, y in zip(a, b):
            _same_bits(x, y)


@pytest.mark.parametrize("count", [1, 7, 4099, 2**20 + 3])
def test_decompress_matches_cpu(count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    packed = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=gen)
    want = torch.empty(count)
    scale = torch.tensor([0.375])  # tensors behind Buffers are kept alive here: a Buffer does not own them
    K.decompress(_b(scale), _b(packed), _b(want))
    got = torch.full((count + 5,), 9.0, device=DEV)  # poisoned, 5 past the end must stay
    scale_d, packed_d, head = scale.to(DEV), packed.to(DEV), got[:count]
    K.decompress(_b(scale_d), _b(packed_d), _b(head))
    torch.cuda.synchronize()
    _same_bits(got[:count], want)
    assert torch.equal(got[count:].cpu(), torch.full((5,), 9.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", [7, 4099, 2**20 + 3])
def test_compressed_reduce_scatter_gpu_equals_cpu_local(n: int, dtype: torch.dtype) -> None:
    """ZeRO's compressed reduce-scatter on CUDA tensors: output, input rewrite and both errors as on
    the CPU, three rounds with the errors carried."""
    from compcomm.zero import compressed_reduce_scatter

    comm = _C.LocalCommunicator()
    res = {}
    for dev in ("cpu", DEV):
        g = torch.Generator().manual_seed(n)
        we, se = compcomm.error_buffers(n, comm, device=dev)
        rounds = []
        for _ in range(3):
            t = torch.randn(n, generator=g).to(dtype).to(dev)
            out = compressed_reduce_scatter(t, we, se, group=comm)
            rounds.append((out.cpu().clone(), t.cpu().clone(), we.cpu().clone(), se.cpu().clone()))
        res[dev] = rounds
    _assert_rounds_close(res[DEV], res["cpu"])


def test_workspace_reused_across_sizes() -> None:
    """A large call then a small one share the cached workspace: the small call's results must not
    depend on what the large one left there (the norm kernels' ticket must sit at a fixed offset)."""
    comm = _C.LocalCommunicator()
    for n in (2**20 + 3, 4099, 2**18 + 5, 7):
        cpu = _rounds(n, torch.float32, "cpu", 2, comm)
        gpu = _rounds(n, torch.float32, DEV, 2, comm)
        _assert_rounds_close(gpu, cpu)


def test_compressed_allreduce_gpu_nonfinite() -> None:
    comm = _C.LocalCommunicator()
    n = 4099
    t = torch.randn(n, device=DEV)
    we, se = compcomm.error_buffers(t, comm)
    compcomm.compressed_allreduce(t, we, se, comm)
    bad = torch.randn(n, device=DEV)
    bad[17] = float("nan")
    w0, s0, b0 = we.clone(), se.clone(), bad.clone()
    with pytest.raises(compcomm.errors.NonFiniteError):
        compcomm.compressed_allreduce(bad, we, se, comm)
    _same_bits(we, w0)
    _same_bits(se, s0)
    _same_bits(bad, b0)
    # check=False: no host check after the first call of this shape; the commit is skipped on device.
    compcomm.compressed_allreduce(bad, we, se, comm, check=False)
    torch.cuda.synchronize()
    _same_bits(we, w0)
    _same_bits(se, s0)
    _same_bits(bad, b0)


def test_first_unchecked_call_is_still_checked() -> None:
    """check=False skips the host check only for a (communicator, sizes, dtype) already validated."""
    comm = _C.LocalCommunicator()  # a fresh communicator: nothing seen yet
    t = torch.randn(4091, device=DEV)  # a size no other test uses (the key includes the size)
    t[3] = float("inf")
    we, se = compcomm.error_buffers(t, comm)
    with pytest.raises(compcomm.errors.NonFiniteError):
        compcomm.compressed_allreduce(t, we, se, comm, check=False)
    assert int(we.count_nonzero()) == 0 and int(se.count_nonzero()) == 0


def test_compressed_allreduce_nccl_one_rank() -> None:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        for dtype in DTYPES:
            gpu = _rounds(4099, dtype, DEV, 3, group)
            cpu = _rounds(4099, dtype, "cpu", 3, _C.LocalCommunicator())
            _assert_rounds_close(gpu, cpu)
    finally:
        dist.destroy_process_group()
        compcomm._comm.forget_process_groups()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_cuda_graph_capture_and_replay(dtype: torch.dtype) -> None:
    comm = _C.LocalCommunicator()
    n = 2**20 + 3
    g = torch.Generator()
    g.manual_seed(3)
    inputs = [torch.randn(n, generator=g).to(dtype).to(DEV) for _ in range(4)]

    # Eager reference.
    we_r, se_r = compcomm.error_buffers(n, comm, device=DEV)
    eager = []
    for x in inputs:
        t = x.clone()
        compcomm.compressed_allreduce(t, we_r, se_r, comm, check=False)
        eager.append((t.clone(), we_r.clone(), se_r.clone()))

    # Graph: warm up on a side stream (first call of the shape validates sizes), then capture one call.
    static = torch.empty(n, dtype=dtype, device=DEV)
    we, se = compcomm.error_buffers(n, comm, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tmp_we, tmp_se = we.clone(), se.clone()
        static.copy_(inputs[0])
        compcomm.compressed_allreduce(static, tmp_we, tmp_se, comm, check=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        compcomm.compressed_allreduce(static, we, se, comm, check=False)
    for x, (t_ref, we_ref, se_ref) in zip(inputs, eager):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        _same_bits(static, t_ref)
        _same_bits(we, we_ref)
        _same_bits(se, se_ref)


def test_build_info_reports_cuda() -> None:
    info = compcomm.build_info()
    assert info["cuda"] is True
    assert isinstance(info["cuda_version"], str) and info["cuda_version"][0].isdigit()
    assert "90" in info["cuda_architectures"]


# ---- the 1-bit optimizers on CUDA tensors ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_optimizers_on_cuda_match_cpu(name: str, dtype: torch.dtype) -> None:
    """Same parameters and gradients on the GPU and on the CPU, through warm-up and the compressed
    phase (0/1 Adam also through local and sync steps): the trajectories agree."""
    from compcomm import optim

    cls = getattr(optim, name)
    kw = {
        "OneBitAdam": dict(lr=1e-2, freeze_step=3, weight_decay=0.01),
        "ZeroOneAdam": dict(lr=1e-2, var_freeze_step=4, var_update_scaler=1, local_step_scaler=1,
                            local_step_clipper=2, weight_decay=0.01),
        "OneBitLamb": dict(lr=1e-2, freeze_step=3, weight_decay=0.01),
    }[name]
    g = torch.Generator().manual_seed(7)
    shapes = [(33, 17), (129,), (5,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(12)]
    finals = {}
    for device in ("cpu", DEV):
        ps = [torch.nn.Parameter(x.to(device=device, dtype=dtype, copy=True)) for x in init]
        opt = cls(ps, **kw)
        for step_grads in grads:
            for p, gr in zip(ps, step_grads):
                p.grad = gr.to(device=device, dtype=dtype)
            opt.step()
        finals[device] = [p.detach().float().cpu() for p in ps]
        assert all(p.device.type == torch.device(device).type for p in ps)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(finals["cpu"], finals[DEV]):
        torch.testing.assert_close(b, a, **tol)
    moved = max(float((f - i.float()).abs().max()) for f, i in zip(finals["cpu"], init))
    assert moved > 1e-2  # the steps did move the parameters
