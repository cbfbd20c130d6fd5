"""scripts/draw_masks.py draws the Layout's own masks: the decoding panels are exactly what the decoder attends."""

import importlib.util

import torch

from r2lm.generation.window import _Shape, window_layout
from tests.helpers import REPO
from tests.helpers.models import tiny_r2lm

SCRIPT = REPO / "scripts" / "draw_masks.py"
spec = importlib.util.spec_from_file_location("draw_masks", SCRIPT)
draw_masks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draw_masks)


def test_the_decoding_panels_are_the_decoders_masks():
    block = 4
    for kind in ("causal", "block_causal"):
        model = tiny_r2lm(attention=kind, sidecar_layers=[1], block_size=block)
        _, window, fused = draw_masks.panels(kind, 12, block)
        cache = model.new_cache(1, 32)
        with torch.no_grad():
            model.prefill(torch.randint(0, 90, (1, window[2])), cache)
        for (_, layout, cached), commit in ((window, 0), (fused, block)):
            drawn = draw_masks.picture(layout, kind, False, cached) > 0
            # the mask a WindowReader keeps for this forward
            shape = _Shape(model, cache, window_layout(layout.length, commit), commit)
            shape.sync(cache)
            used = shape.mask[0, 0, :, : cached + layout.length] == 0
            assert torch.equal(drawn, used), (kind, commit)


def test_the_picture_is_written(tmp_path):
    draw_masks.main(["--out", str(tmp_path / "masks.png")])
    assert (tmp_path / "masks.png").stat().st_size > 10_000
