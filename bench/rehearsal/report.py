"""The tables of the ImageNet rehearsal (`python -m bench.rehearsal.imagenet`): phase x class count
(seconds, seconds per class, peak memory, dataset listings), the `fadrm distill` split, and the
summary of per-class costs and peak memory growth between class counts."""
from __future__ import annotations

ORDER = ("weights", "import", "distill", "verify", "export", "rest")


def summarize(result: dict) -> dict:
    """Per-class costs and their ratios between class counts."""
    rows = {r["classes"]: r for r in result["counts"]}
    counts = sorted(rows)
    summary: dict = {}
    if len(counts) >= 2:
        big = counts[-1]
        base = 100 if 100 in rows and big != 100 else counts[0]
        a, b = rows[base]["phases"]["distill"], rows[big]["phases"]["distill"]
        per_a, per_b = a["outside_recover_s"] / base, b["outside_recover_s"] / big
        summary["outside_recover_per_class"] = {"from": base, "to": big, "s_per_class_from": round(per_a, 4),
                                                "s_per_class_to": round(per_b, 4), "ratio": round(per_b / per_a, 3),
                                                "marginal_s_per_class": round((b["outside_recover_s"]
                                                                               - a["outside_recover_s"]) / (big - base), 4)}
        summary["peak_rss_growth_mb_per_class"] = {
            name: round((rows[big]["phases"][name]["peak_rss_mb"] - rows[base]["phases"][name]["peak_rss_mb"])
                        / (big - base), 3) for name in ORDER if name in rows[big]["phases"] and name in rows[base]["phases"]}
    return summary


def report(result: dict) -> str:
    lines = [f"CPU: {result['cpu']} ({result['cpus']} CPUs), load {result['load_before']} -> {result['load_after']}; "
             f"IPC 1, T = {result['iterations']}, {result['workers']} workers, {result['train_per_class']} train + "
             f"{result['val_per_class']} val images per class", "",
             "| phase | classes | seconds | s/class | peak tree RSS MB | peak tree PSS MB | largest VmHWM MB "
             "| processes | dataset listings |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["counts"]:
        n = r["classes"]
        lines.append(f"| data (generated, in the bench) | {n} | {r['data']['seconds']:.1f} | "
                     f"{r['data']['seconds'] / n:.3f} | | | | | |")
        for name in ORDER:
            p = r["phases"].get(name)
            if p is None or "seconds" not in p:
                continue
            k = p.get("classes", n) if name == "rest" else n
            listings = "n/a" if p.get("listings") is None else str(p["listings"])
            if p.get("cache_written"):
                listings += " (cache written)"
            lines.append(f"| {name} | {k} | {p['seconds']:.1f} | {p['seconds'] / k:.3f} | {p.get('peak_rss_mb', '')} | "
                         f"{p.get('peak_pss_mb', '')} | {p.get('max_process_hwm_mb', '')} | {p.get('processes', '')} | "
                         f"{listings} |")
    lines += ["", "`fadrm distill` split (wall seconds; worker seconds in brackets where 2 workers overlap)", "",
              "| classes | wall | run's own | recover | patch scoring | rest | outside recover | outside recover "
              "s/class | stages | units |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["counts"]:
        d = r["phases"].get("distill", {})
        if "recover_wall_s" not in d:
            continue
        n = r["classes"]
        lines.append(f"| {n} | {d['seconds']:.1f} | {d['own_s']:.1f} | {d['recover_wall_s']:.1f} "
                     f"({d['recover_worker_s']:.1f}) | {d['patch_scoring_wall_s']:.1f} ({d['patch_scoring_worker_s']:.1f}) "
                     f"| {d['rest_s']:.1f} | {d['outside_recover_s']:.1f} | {d['outside_recover_s'] / n:.3f} | "
                     f"{d['stages']} ({d['stage_resolutions']}) | {d.get('units')} |")
    s = result.get("summary", {})
    o = s.get("outside_recover_per_class")
    if o:
        verdict = "within" if o["ratio"] <= 1.2 else "above"
        lines += ["", f"outside-recover cost per class, {o['to']} vs {o['from']} classes: {o['s_per_class_to']:.4f} / "
                      f"{o['s_per_class_from']:.4f} s = {o['ratio']:.2f}x ({verdict} the 1.2x target); marginal "
                      f"{o['marginal_s_per_class']:.4f} s per added class"]
    g = s.get("peak_rss_growth_mb_per_class")
    if g:
        lines.append("peak tree RSS growth per added class (MB): " + ", ".join(f"{k} {v:+.3f}" for k, v in g.items()))
    return "\n".join(lines)
