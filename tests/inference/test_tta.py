"""Test-time augmentation: the wrapper's output is the log of the mean probability of its views."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from visiontune.errors import UserError
from visiontune.inference import tta


def test_flip_and_crop_average_the_four_views_computed_independently():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5)).eval()
    x = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        model(x)  # materialise the lazy layer
        crop = v2.Compose([v2.CenterCrop(28), v2.Resize(32, antialias=True)])(x)  # 7/8 of 32 = 28
        views = [x, v2.functional.horizontal_flip(x), crop, v2.functional.horizontal_flip(crop)]
        want = torch.stack([model(v).softmax(1) for v in views]).mean(0)
        got = tta.wrap(model, "flip+crop")(x)
        flip = tta.wrap(model, "flip")(x)
    assert torch.allclose(got.softmax(1), want, atol=1e-6) and torch.allclose(got.exp(), want, atol=1e-6)
    assert torch.allclose(flip.exp(), torch.stack([model(v).softmax(1) for v in views[:2]]).mean(0), atol=1e-6)
    assert tta.wrap(model, "none") is model


def test_unknown_mode_is_a_user_error():
    with pytest.raises(UserError, match="--tta must be one of none, flip, flip\\+crop"):
        tta.wrap(torch.nn.Identity(), "rotate")
