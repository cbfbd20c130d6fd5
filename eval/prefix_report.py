"""The prefix-cache benchmark's report: its tables, targets and PNG, rendered from the results that
`python -m eval.prefix_bench` measures (eval/prefix_runs.py, eval/prefix_placement.py) and writes."""

from __future__ import annotations

from pathlib import Path

from eval.prefix_runs import POLICIES


def print_tables(results: dict) -> None:
    print(f"\ncapacity: {results['capacity_tokens']} tokens ({results['capacity_tokens'] // results['settings']['block_tokens']}"
          f" blocks) = {results['settings']['capacity_factor']} x working set of {results['working_set_tokens']} tokens")
    for label, runs in results["generate"].items():
        print(f"\n== {label} model: generate(), batch 1 (TTFT = lookup + prefill + first denoise)")
        print(f"{'workload':>10} {'policy':>6} {'tok hit%':>8} {'req hit%':>8} {'prefill tok':>11} {'TTFT ms':>8} "
              f"{'median':>7} {'speedup':>7} {'evict':>6} {'|dlogit|':>9} {'ckpts':>6} {'reused/matched':>14}")
        for wname, by_policy in runs.items():
            base = by_policy["none"]["ttft_mean_ms"]
            for p, r in by_policy.items():
                bm = r["block_matched_tokens"]
                matched = f"{100 * r['hit_tokens'] / bm:.1f}%" if bm else "-"
                print(f"{wname:>10} {p:>6} {100 * r['token_hit_rate']:>8.1f} {100 * r['request_hit_rate']:>8.1f} "
                      f"{r['prefill_tokens']:>11} {r['ttft_mean_ms']:>8.2f} {r['ttft_median_ms']:>7.2f} "
                      f"{base / r['ttft_mean_ms']:>7.2f} {r.get('evictions', '-'):>6} {r['max_logit_diff_vs_none']:>9.1e} "
                      f"{r.get('checkpoints_held', '-'):>6} {matched:>14}")
        if "mixed" in runs:
            m = runs["mixed"]
            print(f"   mixed, working-set (qa) requests only: token hit LRU {100 * m['lru']['token_hit_rate_qa']:.1f}% "
                  f"ARC {100 * m['arc']['token_hit_rate_qa']:.1f}%; TTFT none {m['none']['ttft_mean_ms_qa']:.2f} "
                  f"LRU {m['lru']['ttft_mean_ms_qa']:.2f} ARC {m['arc']['ttft_mean_ms_qa']:.2f} ms")
    print("\n== capacity sweep (PrefixCache replay, token hit rate %, LRU / ARC)")
    sweep = results["sweep"]
    caps = sorted({row["capacity_tokens"] for rows in sweep.values() for row in rows})
    print(f"{'workload':>10} " + " ".join(f"{c:>11}" for c in caps))
    for wname, rows in sweep.items():
        cells = {row["capacity_tokens"]: f"{100 * row['lru']:.1f}/{100 * row['arc']:.1f}" for row in rows}
        print(f"{wname:>10} " + " ".join(f"{cells.get(c, '-'):>11}" for c in caps))
    for study in results["placement"]:
        print(f"\n== checkpoint placement: {study['name']} (N={study['N']}, {study['candidates']} candidates every "
              f"{study['chunk']}; E[d] = {study['expected_depth']:.1f} tokens, best possible saving "
              f"{study['saturated_saving']:.1f})")
        dp = {d["M"]: d["saved"] for d in study["dp"]}
        uni = {u["M"]: u["saved"] for u in study["uniform"]}
        ms = [m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if m in dp]
        print("   saved (tokens/request) by M: " + "  ".join(f"M={m}: DP {dp[m]:.1f} / unif {uni.get(m, 0):.1f}" for m in ms))
        print(f"   last-only: {study['last_only']['saved']:.1f}")
        print(f"   {'block every':>11} {'M_block':>7} {'saved':>8} {'DP M to match':>13} {'ratio':>6} {'DP M within 1%':>14}")
        for b in study["block"]:
            ratio = f"{b['ratio']:.2f}" if b["ratio"] is not None else "-"
            print(f"   {b['every']:>11} {b['M']:>7} {b['saved']:>8.1f} {str(b['dp_M_to_match']):>13} {ratio:>6} "
                  f"{b['dp_M_within_1pct']:>14}")
    print("\n== targets")
    for t in results["targets"]:
        print(f"   [{'PASS' if t['holds'] else 'FAIL'}] {t['target']}: {t['evidence']}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = results["placement"]
    fig, axes = plt.subplots(2, max(3, len(studies)), figsize=(6 * max(3, len(studies)), 9.5))
    colors = {"none": "0.6", "lru": "tab:orange", "arc": "tab:blue"}
    runs = results["generate"]
    labels = list(runs)
    wnames = list(next(iter(runs.values())))
    # hit-rate bars: workload groups, policy x model bars
    ax = axes[0, 0]
    width = 0.8 / (2 * len(labels))
    for li, label in enumerate(labels):
        for pi, p in enumerate(("lru", "arc")):
            xs = [w + (li * 2 + pi - len(labels) + 0.5) * width for w in range(len(wnames))]
            vals = [100 * runs[label][w][p]["token_hit_rate"] for w in wnames]
            bars = ax.bar(xs, vals, width, color=colors[p], alpha=1.0 if li == 0 else 0.5,
                          hatch=None if li == 0 else "//", label=f"{p.upper()} ({label})")
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(wnames)), wnames)
    ax.set(title=f"token hit rate at {results['capacity_tokens']} tokens (no cache: 0)", ylabel="%")
    ax.legend(fontsize=8)
    # TTFT bars (causal model)
    ax = axes[0, 1]
    width = 0.8 / 3
    for pi, p in enumerate(POLICIES):
        for li, label in enumerate(labels):
            xs = [w + (pi - 1) * width + (li - 0.5 * (len(labels) - 1)) * width / len(labels) for w in range(len(wnames))]
            vals = [runs[label][w][p]["ttft_mean_ms"] for w in wnames]
            ax.bar(xs, vals, width / len(labels), color=colors[p], alpha=1.0 if li == 0 else 0.5,
                   hatch=None if li == 0 else "//", label=f"{p} ({label})")
    ax.set_xticks(range(len(wnames)), wnames)
    ax.set(title="mean time to first token", ylabel="ms")
    ax.legend(fontsize=7, ncol=2)
    # capacity sweep
    ax = axes[0, 2]
    for wname, rows in results["sweep"].items():
        xs = [r["capacity_tokens"] for r in rows]
        style = "-" if wname == "mixed" else ":"
        ax.plot(xs, [100 * r["lru"] for r in rows], style, marker="o", color=colors["lru"], label=f"LRU {wname}",
                alpha=1 if wname == "mixed" else 0.6)
        ax.plot(xs, [100 * r["arc"] for r in rows], style, marker="s", color=colors["arc"], label=f"ARC {wname}",
                alpha=1 if wname == "mixed" else 0.6)
    ax.axvline(results["working_set_tokens"], color="k", lw=0.8, ls="--", label="working set")
    ax.axvline(results["capacity_tokens"], color="r", lw=0.8, ls="--", label="capacity used")
    ax.set(title="capacity sweep (replay)", xlabel="capacity (tokens)", ylabel="token hit rate %", xscale="log")
    ax.legend(fontsize=7)
    for ax in axes[0, 3:]:
        ax.axis("off")
    for ax, study in zip(axes[1], studies, strict=False):
        dp = [d for d in study["dp"] if d["M"] >= 1]
        ms = [d["M"] for d in dp]
        ax.plot(ms, [d["saved"] for d in dp], "-", color="tab:blue", label="DP (place_checkpoints)")
        ax.plot([u["M"] for u in study["uniform"]], [u["saved"] for u in study["uniform"]], "--", color="tab:green",
                label="uniform-M")
        bl = [b for b in study["block"] if b["M"] <= max(ms) * 1.5]
        ax.plot([b["M"] for b in bl], [b["saved"] for b in bl], "o:", color="tab:orange", label="block every k")
        for b in bl:
            ax.annotate(str(b["every"]), (b["M"], b["saved"]), fontsize=6, xytext=(2, -8), textcoords="offset points")
        ax.plot([study["last_only"]["M"]], [study["last_only"]["saved"]], "k^", label="last-only")
        ax.axhline(study["saturated_saving"], color="0.5", lw=0.8, ls=":", label="every candidate")
        ax.set(title=f"recompute saved: {study['name']}", xlabel="checkpoints M", ylabel="tokens saved / request",
               xscale="log", ylim=(0, None))
        ax.legend(fontsize=7)
    for ax in axes[1, len(studies):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def targets(results: dict) -> list[dict]:
    """The issue's targets, each with whether it holds and the figures that say so."""
    out = []
    for label, runs in results["generate"].items():
        if "mixed" in runs:
            lru, arc = runs["mixed"]["lru"]["token_hit_rate"], runs["mixed"]["arc"]["token_hit_rate"]
            out.append({"target": f"ARC >= LRU + 5 points on mixed ({label})", "holds": arc - lru >= 0.05,
                        "evidence": f"ARC {100 * arc:.1f}% vs LRU {100 * lru:.1f}% ({100 * (arc - lru):+.1f} points)"})
    for study in results["placement"]:
        bl = [b for b in study["block"] if b["M"] >= 2]
        ok = [b for b in bl if b["ratio"] is not None and b["ratio"] <= 0.5]
        worst = max((b for b in bl if b["ratio"] is not None), key=lambda b: b["ratio"], default=None)
        fails = [f"k={b['every']} (M_block {b['M']}, DP needs {b['dp_M_to_match']}, ratio {b['ratio']:.2f})"
                 for b in bl if b not in ok]
        out.append({
            "target": f"DP matches block placement with <= half the checkpoints ({study['name']})",
            "holds": len(ok) == len(bl),
            "evidence": f"{len(ok)}/{len(bl)} block spacings with M_block >= 2"
                        + (f"; misses at {', '.join(fails)}" if fails else "")
                        + (f"; largest ratio {worst['ratio']:.2f} at k={worst['every']}" if worst else ""),
        })
    return out

