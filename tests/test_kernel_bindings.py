"""The _C.kernels bindings' argument checks, and NaN/inf handling of the CPU conversions.

- worker_scale_pack, server_scale_pack, server_update, worker_update_decompress, commit and
  decompress reject a buffer of the wrong dtype (TypeError) or too small for the counts, world and
  strides given, a stride < 1, world < 1 and a buffer on another device (ValueError), naming the
  argument. Every too-small buffer here is a view at the start of a larger tensor, so a binding
  that lets the kernel run past it touches only memory the test owns.
- Buffers of exactly the size a call needs (strided records, a sign view inside them, the last
  row ending at the buffer's end) are accepted and give the results of generous buffers.
- pack_momentum's chunk scales propagate NaN and give +inf for +-inf, as pack_torch (torch amax).
- fp32 -> fp16 of a NaN keeps its sign and top mantissa bits on the generic path as on the
  AVX2 / AVX-512 paths (F16C), so results do not depend on the vector width.
"""

from __future__ import annotations

import compcomm
import pytest
import torch
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.zero.packed_momentum import pack, pack_torch

K = _C.kernels
D = _C.DType
_WS = torch.zeros(16, dtype=torch.uint8)  # the CPU kernels need no scratch


def view(
    t: torch.Tensor, count: int | None = None, dtype=None, device: int = -1, offset: int = 0
) -> _C.Buffer:
    """A Buffer over t's memory from element `offset`, with another count, dtype or device label
    (the Buffer holds t, so it stays alive)."""
    b = buffer_of(t)
    v = _C.Buffer(
        t.data_ptr() + offset * t.element_size(),
        b.count - offset if count is None else count,
        b.dtype if dtype is None else dtype,
        device,
    )
    v.owner = t
    return v


# ---- one valid call of each binding, as keyword arguments that a case then spoils --------------

W, C = 2, 64  # world, chunk
P = W * C


def _worker_pack():
    return {
        "m": view(torch.randn(P - 5)),
        "error": view(torch.randn(P)),
        "scale": view(torch.zeros(1)),
        "signs": view(torch.zeros(P // 8, dtype=torch.uint8)),
        "workspace": view(_WS),
    }


def _server(update: bool):
    g = torch.Generator().manual_seed(1)
    a = {
        "signs": view(torch.randint(0, 256, (W * C // 8,), dtype=torch.uint8, generator=g)),
        "scales": view(torch.rand(W * 4) + 0.5),
        "scale_stride": 4,
        "world": W,
        "server_error": view(torch.randn(C)),
        "scale": view(torch.ones(1)),
    }
    if not update:
        a.update(packed=view(torch.zeros(C // 8, dtype=torch.uint8)), workspace=view(_WS))
    return a


def _worker_commit():
    g = torch.Generator().manual_seed(2)
    return {
        "m": view(torch.randn(P - 5)),
        "error": view(torch.randn(P)),
        "scale": view(torch.ones(1)),
        "out_scales": view(torch.rand(W * 4) + 0.5),
        "out_scale_stride": 4,
        "out_signs": view(torch.randint(0, 256, (W * 16,), dtype=torch.uint8, generator=g)),
        "out_sign_stride": 16,
        "world": W,
    }


def _commit():
    a = _worker_commit()
    s = _server(True)
    a.update(
        signs=s["signs"],
        scales=s["scales"],
        scale_stride=4,
        server_error=s["server_error"],
        server_scale=s["scale"],
    )
    return a


def _decompress():
    return {
        "scale": view(torch.ones(1)),
        "packed": view(torch.zeros(2, dtype=torch.uint8)),
        "out": view(torch.zeros(13)),
    }


CALLS = {
    "worker_scale_pack": (K.worker_scale_pack, _worker_pack),
    "server_scale_pack": (K.server_scale_pack, lambda: _server(False)),
    "server_update": (K.server_update, lambda: _server(True)),
    "worker_update_decompress": (K.worker_update_decompress, _worker_commit),
    "commit": (K.commit, _commit),
    "decompress": (K.decompress, _decompress),
}


def _big(dtype=torch.float32, n=4096):
    """A larger tensor to take views of (a binding that ran past a view stays inside it)."""
    return torch.zeros(n, dtype=dtype)


# (binding, argument, spoiled value or a function of the valid arguments, error, message pattern)
_F16_ERR = lambda a: view(_big(), count=P, dtype=D.float16)  # P fp16 = half of the P floats read
BAD = [
    # worker_scale_pack
    ("worker_scale_pack", "error", _F16_ERR, TypeError, "error must be float32, got float16"),
    (
        "worker_scale_pack",
        "m",
        lambda a: view(torch.zeros(8, dtype=torch.int32)),
        TypeError,
        "m must be float32, float16 or bfloat16",
    ),
    (
        "worker_scale_pack",
        "scale",
        lambda a: view(_big(), count=0),
        ValueError,
        "scale has 0 elements",
    ),
    (
        "worker_scale_pack",
        "scale",
        lambda a: view(_big(torch.float16)),
        TypeError,
        "scale must be float32",
    ),
    (
        "worker_scale_pack",
        "signs",
        lambda a: view(_big(torch.uint8), count=P // 8 - 1),
        ValueError,
        "signs has 15 elements, needs 16",
    ),
    (
        "worker_scale_pack",
        "signs",
        lambda a: view(_big(torch.float32), count=P // 8),
        TypeError,
        "signs must be uint8",
    ),
    (
        "worker_scale_pack",
        "error",
        lambda a: view(_big(), count=P - 4),
        ValueError,
        "error has 124 elements .* multiple of 8",
    ),
    (
        "worker_scale_pack",
        "m",
        lambda a: view(_big(), count=P + 8),
        ValueError,
        r"error has 128 elements .* >= m.numel\(\) \(136\)",
    ),
    (
        "worker_scale_pack",
        "signs",
        lambda a: view(_big(torch.uint8), count=P // 8, device=0),
        ValueError,
        r"signs must be on the device of m \(host\), got cuda:0",
    ),
    # server_scale_pack
    (
        "server_scale_pack",
        "packed",
        lambda a: view(_big(torch.uint8), count=1),
        ValueError,
        "packed has 1 elements, needs 8",
    ),
    (
        "server_scale_pack",
        "signs",
        lambda a: view(_big(torch.uint8), count=1),
        ValueError,
        r"signs has 1 bytes, needs world \(2\)",
    ),
    (
        "server_scale_pack",
        "scales",
        lambda a: view(_big(), count=1),
        ValueError,
        "scales has 1 elements",
    ),
    (
        "server_scale_pack",
        "scales",
        lambda a: view(_big(), count=4),
        ValueError,
        "scales has 4 elements",
    ),  # needs 5 at stride 4
    ("server_scale_pack", "scale_stride", -4, ValueError, "scale_stride must be >= 1, got -4"),
    ("server_scale_pack", "scale_stride", 0, ValueError, "scale_stride must be >= 1, got 0"),
    ("server_scale_pack", "world", 0, ValueError, "world must be >= 1, got 0"),
    ("server_scale_pack", "world", -1, ValueError, "world must be >= 1, got -1"),
    (
        "server_scale_pack",
        "server_error",
        lambda a: view(_big(), count=C, dtype=D.float16),
        TypeError,
        "server_error must be float32",
    ),
    (
        "server_scale_pack",
        "server_error",
        lambda a: view(_big(), count=C - 4),
        ValueError,
        "server_error has 60 elements .* not a multiple of 8",
    ),
    (
        "server_scale_pack",
        "scale",
        lambda a: view(_big(), count=0),
        ValueError,
        "scale has 0 elements",
    ),
    (
        "server_scale_pack",
        "scales",
        lambda a: view(_big(torch.float16)),
        TypeError,
        "scales must be float32",
    ),
    (
        "server_scale_pack",
        "packed",
        lambda a: view(_big(torch.uint8), count=8, device=0),
        ValueError,
        "packed must be on the device of signs",
    ),
    # server_update
    (
        "server_update",
        "signs",
        lambda a: view(_big(torch.uint8), count=15),
        ValueError,
        "signs has 15 bytes",
    ),
    (
        "server_update",
        "scales",
        lambda a: view(_big(), count=1),
        ValueError,
        "scales has 1 elements",
    ),
    ("server_update", "scale_stride", -4, ValueError, "scale_stride must be >= 1"),
    ("server_update", "world", 0, ValueError, "world must be >= 1"),
    (
        "server_update",
        "server_error",
        lambda a: view(_big(torch.float16), count=C),
        TypeError,
        "server_error must be float32",
    ),
    ("server_update", "scale", lambda a: view(_big(), count=0), ValueError, "scale has 0 elements"),
    ("server_update", "guard", lambda a: view(_big(), count=1), ValueError, "guard has 1 elements"),
    (
        "server_update",
        "guard",
        lambda a: view(_big(torch.float16)),
        TypeError,
        "guard must be float32",
    ),
    # worker_update_decompress
    (
        "worker_update_decompress",
        "out_signs",
        lambda a: view(_big(torch.uint8), count=1),
        ValueError,
        "out_signs has 1 elements",
    ),
    (
        "worker_update_decompress",
        "out_signs",
        lambda a: view(_big(torch.uint8), count=16 + 7),
        ValueError,
        "out_signs has 23 elements",
    ),
    (
        "worker_update_decompress",
        "out_scales",
        lambda a: view(_big(), count=4),
        ValueError,
        "out_scales has 4 elements",
    ),
    (
        "worker_update_decompress",
        "out_scales",
        lambda a: view(_big(torch.float16)),
        TypeError,
        "out_scales must be float32",
    ),
    (
        "worker_update_decompress",
        "out_scale_stride",
        0,
        ValueError,
        "out_scale_stride must be >= 1, got 0",
    ),
    (
        "worker_update_decompress",
        "out_sign_stride",
        -16,
        ValueError,
        "out_sign_stride must be >= 1, got -16",
    ),
    ("worker_update_decompress", "world", 0, ValueError, "world must be >= 1, got 0"),
    (
        "worker_update_decompress",
        "world",
        3,
        ValueError,
        r"error has 128 elements .* multiple of 8 \* world",
    ),
    (
        "worker_update_decompress",
        "error",
        _F16_ERR,
        TypeError,
        "error must be float32, got float16",
    ),
    (
        "worker_update_decompress",
        "scale",
        lambda a: view(_big(), count=0),
        ValueError,
        "scale has 0 elements",
    ),
    (
        "worker_update_decompress",
        "m",
        lambda a: view(_big(torch.float64), count=8),
        TypeError,
        "m must be float32, float16 or bfloat16, got float64",
    ),
    (
        "worker_update_decompress",
        "out_signs",
        lambda a: view(_big(torch.uint8), device=1),
        ValueError,
        "out_signs must be on the device of m",
    ),
    (
        "worker_update_decompress",
        "guard_stride",
        0,
        ValueError,
        "guard_stride must be >= 1",
    ),  # with a guard (below)
    # commit
    (
        "commit",
        "server_error",
        lambda a: view(_big(), count=C + 8),
        ValueError,
        r"server_error has 72 elements, needs error.numel\(\) / world \(64\)",
    ),
    (
        "commit",
        "server_error",
        lambda a: view(_big(torch.float16), count=C),
        TypeError,
        "server_error must be float32",
    ),
    (
        "commit",
        "signs",
        lambda a: view(_big(torch.uint8), count=8),
        ValueError,
        "signs has 8 bytes",
    ),
    ("commit", "scales", lambda a: view(_big(), count=2), ValueError, "scales has 2 elements"),
    ("commit", "scale_stride", 0, ValueError, "scale_stride must be >= 1"),
    (
        "commit",
        "server_scale",
        lambda a: view(_big(), count=0),
        ValueError,
        "server_scale has 0 elements",
    ),
    (
        "commit",
        "out_signs",
        lambda a: view(_big(torch.uint8), count=1),
        ValueError,
        "out_signs has 1 elements",
    ),
    (
        "commit",
        "out_scales",
        lambda a: view(_big(), count=1),
        ValueError,
        "out_scales has 1 elements",
    ),
    ("commit", "world", 0, ValueError, "world must be >= 1, got 0"),
    ("commit", "error", _F16_ERR, TypeError, "error must be float32"),
    (
        "commit",
        "signs",
        lambda a: view(_big(torch.uint8), device=0),
        ValueError,
        "signs must be on the device of m",
    ),
    (
        "commit",
        "guard",
        lambda a: view(_big(), count=4),
        ValueError,
        "guard has 4 elements",
    ),  # needs 5 at stride 4
    # decompress
    ("decompress", "scale", lambda a: view(_big(), count=0), ValueError, "scale has 0 elements"),
    (
        "decompress",
        "scale",
        lambda a: view(_big(torch.float16)),
        TypeError,
        "scale must be float32",
    ),
    (
        "decompress",
        "out",
        lambda a: view(_big(torch.float16), count=13),
        TypeError,
        "out must be float32",
    ),
    (
        "decompress",
        "packed",
        lambda a: view(_big(torch.uint8), count=1),
        ValueError,
        "packed has 1 elements, needs 2",
    ),
    (
        "decompress",
        "packed",
        lambda a: view(_big(torch.uint8), device=0),
        ValueError,
        "packed must be on the device of out",
    ),
]


def _case_id(c) -> str:
    return f"{c[0]}-{c[1]}-{c[4][:24]}"


@pytest.mark.parametrize("case", BAD, ids=[_case_id(c) for c in BAD])
def test_bad_arguments_raise_naming_them(case) -> None:
    name, arg, value, exc, pattern = case
    fn, make = CALLS[name]
    a = make()
    a[arg] = value(a) if callable(value) else value
    if arg.startswith("guard"):  # the guard's checks apply when a guard is given
        a.setdefault("guard", view(torch.ones(W * 4)))
        a.setdefault("guard_stride", 4)
    with pytest.raises(exc, match=pattern):
        fn(**a)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_valid_calls_pass(name: str) -> None:
    fn, make = CALLS[name]
    fn(**make())


def test_kernel_error_text_does_not_blame_P() -> None:
    """world = 0 is named as such (it used to read 'P must be a multiple of 8, >= n')."""
    a = _server(False)
    a["world"] = 0
    with pytest.raises(ValueError) as info:
        K.server_scale_pack(**a)
    assert "world" in str(info.value) and "P must be" not in str(info.value)


# ---- exact sizes are accepted (no legitimate call rejected) --------------------------------------


def _tight(t: torch.Tensor, n: int) -> torch.Tensor:
    """t's first n elements copied to the start of a poisoned larger tensor: the view ends where
    the call's last read ends, and the memory after it must stay untouched."""
    big = torch.full((n + 8,), 77, dtype=t.dtype)
    big[:n] = t[:n]
    return big


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_exactly_sized_strided_buffers_are_accepted(world: int, dtype: torch.dtype) -> None:
    """Scales and signs inside records (strides as compressed_allreduce's exchange uses), views
    ending exactly at the last element read; results equal those of generous buffers."""
    g = torch.Generator().manual_seed(world)
    n = 1001
    Pw = compcomm.padded_numel(n, world)
    Cw = Pw // world
    ss, oss, osb = 8, 4, Cw // 8 + 16
    signs = torch.randint(0, 256, (world * Cw // 8,), dtype=torch.uint8, generator=g)
    scales = torch.rand(world * ss, generator=g) + 0.5
    out_scales = torch.rand(world * oss, generator=g) + 0.5
    out_signs = torch.randint(0, 256, (world * osb,), dtype=torch.uint8, generator=g)
    m0 = torch.randn(n, generator=g).to(dtype)
    e0, s0 = torch.randn(Pw, generator=g), 0.1 * torch.randn(Cw, generator=g)
    sigma, tau = torch.tensor([0.75]), torch.tensor([0.5])

    def run(tight: bool):
        # tight: every strided buffer holds exactly (world - 1) * stride + len elements
        sc = _tight(scales, (world - 1) * ss + 1) if tight else scales
        osc = _tight(out_scales, (world - 1) * oss + 1) if tight else out_scales
        osg = _tight(out_signs, (world - 1) * osb + Cw // 8) if tight else out_signs
        ns = (world - 1) * ss + 1 if tight else sc.numel()
        nosc = (world - 1) * oss + 1 if tight else osc.numel()
        nosg = (world - 1) * osb + Cw // 8 if tight else osg.numel()
        m, e, s = m0.clone(), e0.clone(), s0.clone()
        tau_out, packed = torch.zeros(1), torch.zeros(Cw // 8, dtype=torch.uint8)
        K.server_scale_pack(
            buffer_of(signs),
            view(sc, ns),
            ss,
            world,
            buffer_of(s),
            buffer_of(tau_out),
            buffer_of(packed),
            buffer_of(_WS),
        )
        K.commit(
            buffer_of(signs),
            view(sc, ns),
            ss,
            buffer_of(s),
            buffer_of(tau),
            buffer_of(m),
            buffer_of(e),
            buffer_of(sigma),
            view(osc, nosc),
            oss,
            view(osg, nosg),
            osb,
            world,
            guard=view(osc, nosc),
            guard_stride=oss,
        )
        out = torch.zeros(Cw)
        K.decompress(buffer_of(tau_out), buffer_of(packed), buffer_of(out))
        if tight:  # nothing past the views was written
            for t, k in ((sc, ns), (osc, nosc), (osg, nosg)):
                assert bool((t[k:] == 77).all())
        return [x.float() for x in (m, e, s, tau_out, out)] + [packed]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
    assert not torch.equal(run(True)[1], e0)  # the commit did write


def test_sign_view_inside_records_is_accepted() -> None:
    """test_kernels' record layout: the scales as a float32 view of the records and the signs as a
    uint8 Buffer 16 bytes in, shorter than the records by those 16 bytes."""
    world, chunk = 3, 64
    record = 16 + 16
    records = torch.zeros(world * record, dtype=torch.uint8)
    m, e, sigma = torch.randn(world * chunk - 3), torch.randn(world * chunk), torch.tensor([0.5])
    signs = _C.Buffer(records.data_ptr() + 16, records.numel() - 16, D.uint8, -1)
    K.worker_update_decompress(
        buffer_of(m),
        buffer_of(e),
        buffer_of(sigma),
        buffer_of(records.view(torch.float32)),
        record // 4,
        signs,
        record,
        world,
    )


def test_empty_inputs_are_accepted() -> None:
    """n = P = 0 (an empty bucket) and decompress of 0 elements."""
    scale = torch.full((1,), 5.0)
    K.worker_scale_pack(
        buffer_of(torch.zeros(0)),
        buffer_of(torch.zeros(0)),
        buffer_of(scale),
        buffer_of(torch.zeros(0, dtype=torch.uint8)),
        buffer_of(_WS),
    )
    assert scale.item() == 0.0
    K.decompress(
        buffer_of(torch.ones(1)),
        buffer_of(torch.zeros(0, dtype=torch.uint8)),
        buffer_of(torch.zeros(0)),
    )


# ---- pack_momentum: NaN and inf in the chunk scales as torch's amax ------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_momentum_scales_propagate_nan_as_torch(dtype: torch.dtype) -> None:
    chunk = 16
    x = torch.linspace(-2, 2, 8 * chunk).to(dtype)
    x[3] = float("nan")  # chunk 0: NaN among numbers
    x[chunk + 5] = float("inf")  # chunk 1: +inf
    x[2 * chunk + 1] = -float("inf")  # chunk 2: -inf -> +inf
    x[3 * chunk] = float("nan")  # chunk 3: NaN first, then inf
    x[3 * chunk + 9] = float("inf")
    x[4 * chunk + 2] = float("inf")  # chunk 4: inf first, then NaN (std::max dropped it)
    x[4 * chunk + 15] = -float("nan")
    x[5 * chunk + 15] = float("nan")  # chunk 5: NaN last
    s_k, t_k = pack(x, chunk)
    s_t, t_t = pack_torch(x, chunk)
    assert torch.equal(s_k, s_t)
    torch.testing.assert_close(t_k, t_t, rtol=0, atol=0, equal_nan=True)
    assert t_k.isnan().tolist() == [True, False, False, True, True, True, False, False]
    assert t_k[1].item() == t_k[2].item() == float("inf")


# ---- fp32 -> fp16 of a NaN: the same bits on every vector width --------------


def test_fp16_nan_keeps_payload_on_every_isa() -> None:
    """param_out (fp16) of NaN weights through the 1-bit Adam step on each ISA: the generic path
    (half.h) keeps the sign and top 10 mantissa bits with the quiet bit set, as F16C does."""
    words = [0x7FC12345, 0xFFC9E9CE, 0x7F800001, 0x7FFFFFFF, 0xFF800000, 0x7F800000, 0x3F800000]
    w_bits = torch.tensor(words, dtype=torch.int64).to(torch.int32)
    outs = {}
    for isa in ("generic", "avx2", "avx512"):
        if not _C.optim.isa_supported(isa):
            continue
        for n in (len(words), 40000):  # the scalar tail and the vector body
            w = w_bits.view(torch.float32).repeat(n // len(words) + 1)[:n].clone()
            m, v, acc = torch.zeros(n), torch.ones(n), torch.zeros(n)
            out = torch.empty(n, dtype=torch.float16)
            _C.optim.onebit_compressed_step(
                buffer_of(w),
                buffer_of(m),
                buffer_of(v),
                buffer_of(acc),
                None,
                0.0,
                0.9,
                0.999,
                1e-8,
                0.0,
                False,
                0,
                0,
                param_out=buffer_of(out),
                isa=isa,
            )
            got = [x & 0xFFFF for x in out[: len(words)].view(torch.int16).tolist()]
            wb = [x & 0xFFFFFFFF for x in w[: len(words)].view(torch.int32).tolist()]
            want = []
            for u in wb:
                sign = (u >> 16) & 0x8000
                if (u & 0x7FFFFFFF) > 0x7F800000:
                    want.append(sign | 0x7E00 | ((u & 0x7FFFFF) >> 13))
                else:
                    want.append(
                        int(
                            torch.tensor([u], dtype=torch.int64)
                            .to(torch.int32)
                            .view(torch.float32)
                            .to(torch.float16)
                            .view(torch.int16)
                            .item()
                        )
                        & 0xFFFF
                    )
            assert got == want, (isa, n, [hex(x) for x in got], [hex(x) for x in want])
            outs[(isa, n)] = got
    assert len({tuple(v) for v in outs.values()}) == 1
