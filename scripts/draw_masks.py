"""Draw who sees whom, from the Layout code itself (so the picture cannot drift from what the model computes).

    python scripts/draw_masks.py [--out docs/masks.png] [--length 12] [--block-size 4]

One row per model kind (R2LM: causal attention + sidecar; block_causal; block-hybrid on a causal model), three
panels each:

1. training: the dual-stream layout of the block objective (r2lm.layout.dual_stream, `shift` prediction):
   noisy windows first, then the clean stream;
2. decoding: one window read against the KV cache (the prompt and committed blocks);
3. fused commit: a finished block's clean columns appended while the next window reads them, in one forward.

A cell is dark where the query (row) attends to the key (column) with softmax, orange where a block-hybrid layer
reads it through its linear state instead, white where it is hidden. Query rows the reverse sidecar runs over (the
windows) are marked green on the left; columns left of the blue line are in the KV cache.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from r2lm.kind import SHIFT
from r2lm.layout import Layout, dual_stream

REPO = Path(__file__).resolve().parents[1]

KINDS = [("R2LM (causal + sidecar)", "causal", False), ("block_causal", "block_causal", False),
         ("block-hybrid (causal)", "causal", True)]


def panels(kind: str, length: int, block: int):
    """[(title, layout, cached columns)]: the three layouts, as the model builds them."""
    x0 = torch.arange(length)[None]
    _, training, _ = dual_stream(x0, x0, block, SHIFT)
    cached = 2 * block - 1  # under shift the cache holds every committed token but the last
    window = Layout.span(torch.ones(1, block), start=cached, noisy=True, chunk=1)
    fused = Layout.cat(Layout.span(torch.ones(1, block), start=cached, chunk=1),
                       Layout.span(torch.ones(1, block), start=cached + block, noisy=True, chunk=2))
    return [("training: dual stream [windows ; clean]", training, 0),
            (f"decoding: a window against {cached} cached tokens", window, cached),
            ("fused commit: finished block + next window", fused, cached)]


def picture(layout: Layout, kind: str, hybrid: bool, cached: int) -> torch.Tensor:
    """[T, cached + T] codes: 0 hidden, 1 softmax, 2 linear (block-hybrid's earlier part)."""
    own, earlier = (m[0].long() for m in layout.mask_parts(kind))
    codes = own + (2 if hybrid else 1) * earlier * (1 - own)
    past = torch.full((layout.length, cached), 2 if hybrid else 1)  # cached keys: earlier chunks for every query
    return torch.cat([past, codes], 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "masks.png")
    parser.add_argument("--length", type=int, default=12, help="training sequence length (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["white", "#333333", "#e8902a"])
    fig, axes = plt.subplots(len(KINDS), 3, figsize=(13, 4.2 * len(KINDS)),
                             gridspec_kw={"width_ratios": [1.4, 1, 1]})
    for row, (name, kind, hybrid) in enumerate(KINDS):
        for col, (title, layout, cached) in enumerate(panels(kind, args.length, args.block_size)):
            ax = axes[row][col]
            codes = picture(layout, kind, hybrid, cached)
            ax.imshow(codes, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
            noisy = layout.noisy.tolist()
            for q, is_window in enumerate(noisy):  # the sidecar's scope
                if is_window:
                    ax.add_patch(plt.Rectangle((-1.6, q - 0.5), 0.8, 1, color="#3a9a4a", clip_on=False))
            if cached:
                ax.axvline(cached - 0.5, color="#3a7ac8", lw=1.5)
            positions = layout.positions[0].tolist()
            ax.set_yticks(range(layout.length), [f"{p}{'*' if n else ''}" for p, n in zip(positions, noisy, strict=True)],
                          fontsize=7)
            keys = list(range(cached)) + positions
            ax.set_xticks(range(len(keys)), [str(k) for k in keys], fontsize=6, rotation=90)
            ax.set_title(f"{name}\n{title}" if col == 0 else title, fontsize=9)
            ax.set_xlabel("key (position)" + ("; left of the blue line: in the KV cache" if cached else ""), fontsize=8)
            if col == 0:
                ax.set_ylabel("query (position, * = window)", fontsize=8)
    fig.suptitle("who sees whom (dark: softmax, orange: linear state of a block-hybrid layer; green: windows, the sidecar's scope; "
                 "blue line: end of the cache)", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
