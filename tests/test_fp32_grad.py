"""compcomm.optim._grads.fp32_grad: always a contiguous fp32 tensor, copied only when needed."""

import torch

from compcomm.optim._grads import fp32_grad


def test_fp32_grad_of_a_transposed_fp32_gradient_is_contiguous():
    p = torch.nn.Parameter(torch.zeros(5, 3))
    p.grad = torch.arange(15.0).reshape(3, 5).t()  # fp32, strided
    for copy in (False, True):
        g = fp32_grad(p, copy=copy)
        assert g.is_contiguous() and g.dtype == torch.float32
        assert torch.equal(g, p.grad)


def test_fp32_grad_without_copy_returns_a_contiguous_fp32_gradient_itself():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    assert fp32_grad(p, copy=False) is p.grad
    assert fp32_grad(p, copy=True) is not p.grad
    q = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    q.grad = torch.ones(4, dtype=torch.bfloat16)
    assert fp32_grad(q, copy=False).dtype == torch.float32
