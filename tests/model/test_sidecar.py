"""The reverse sidecar: direction (invariant 5), zero-gate identity, gradients, freezing."""

import torch

from r2lm import Layout
from tests.helpers.models import MASK_ID, tiny_r2lm


def test_sidecar_scan_sees_only_the_right():
    """Perturbing the window input at j changes the sidecar mixer's output only at positions <= j."""
    sidecar = tiny_r2lm(sidecar_layers=[1]).model.layers[1].sidecar
    u = torch.randn(2, 13, 64)
    with torch.no_grad():
        base = sidecar.scan(u)
        for j in (0, 5, 12):
            v = u.clone()
            v[:, j] += 1.0
            moved = (sidecar.scan(v) - base).abs().amax(dim=(0, 2))
            assert torch.all(moved[j + 1 :] == 0), j
            assert torch.all(moved[: j + 1] > 0), j


def test_padding_on_the_left_of_a_window_is_invisible():
    """Windows are right-aligned with padding on the left: a shorter window gives the same scan."""
    sidecar = tiny_r2lm(open_gates=True, sidecar_layers=[1]).model.layers[1].sidecar
    h = torch.randn(1, 10, 64)
    with torch.no_grad():
        short = sidecar(h, torch.tensor([[-1, -1, 4, 5, 6, 7]]))
        alone = sidecar(h[:, 4:8], torch.arange(4)[None])
    torch.testing.assert_close(short[:, 4:8], alone)
    assert torch.equal(short[:, :4], h[:, :4]) and torch.equal(short[:, 8:], h[:, 8:])


def test_zero_gates_leave_logits_bit_identical():
    with_sidecars = tiny_r2lm(sidecar_layers=[0, 2])
    plain = tiny_r2lm(sidecar_layers=[])
    plain.load_state_dict(with_sidecars.state_dict(), strict=False)
    ids = torch.randint(0, MASK_ID, (2, 9))
    layout = Layout.cat(Layout.span(torch.ones(2, 5)), Layout.span(torch.ones(2, 4), start=5, noisy=True, chunk=1))
    with torch.no_grad():
        assert torch.equal(with_sidecars(ids, layout=layout).logits, plain(ids, layout=layout).logits)


def _window_loss(model):
    ids = torch.randint(0, MASK_ID, (2, 9))
    layout = Layout.cat(Layout.span(torch.ones(2, 5)), Layout.span(torch.ones(2, 4), start=5, noisy=True, chunk=1))
    return model(ids, layout=layout).logits[:, 5:].logsumexp(-1).mean()


def test_gradients_reach_the_sidecar_once_its_gate_opens():
    model = tiny_r2lm(sidecar_layers=[1]).train()
    _window_loss(model).backward()
    sidecar = model.model.layers[1].sidecar
    assert sidecar.gate.grad.abs().item() > 0  # the closed gate itself learns
    assert sidecar.mixer.in_proj.weight.grad.abs().sum() == 0  # nothing flows through a closed gate
    model.zero_grad()
    with torch.no_grad():
        sidecar.gate.fill_(0.3)
    _window_loss(model).backward()
    for name, p in sidecar.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_freeze_backbone_trains_only_sidecars():
    model = tiny_r2lm(sidecar_layers=[1, 3])
    names = model.freeze_backbone()
    assert names and all(".sidecar." in n for n in names)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)
    assert "model.layers.1.sidecar.gate" in names and "model.layers.3.sidecar.mixer.A_log" in names
    with torch.no_grad():
        model.model.layers[1].sidecar.gate.fill_(0.3)
    _window_loss(model).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".sidecar." not in n)
