"""The TP head's logits leave the model as a plain tensor (runtime/parallelize._plain_output):
the cause of FSDP2's "returned a view tensor ... wrong gradients" warning in `copus profile`."""

from __future__ import annotations

import torch

from copus.runtime.engine.parallelize import _plain_output


def test_a_view_becomes_a_non_view_on_the_same_storage_with_the_same_gradient():
    w = torch.randn(4, 3, requires_grad=True)
    local = w * 2
    view = local.view_as(local)  # what DTensor.to_local() returns
    assert view._base is not None
    plain = _plain_output(None, (), view)
    assert plain._base is None and plain.data_ptr() == view.data_ptr()
    (plain * torch.arange(12.0).reshape(4, 3)).sum().backward()
    assert torch.equal(w.grad, 2 * torch.arange(12.0).reshape(4, 3))
    other = torch.ones(2)
    assert _plain_output(None, (), other) is other  # not a view: unchanged
