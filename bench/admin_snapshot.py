"""The admin page's figures where no browser runs (the GPU machine): JSON plus a small
self-contained HTML page with the same memory bar, which `--render` screenshots elsewhere.

    python bench/admin_snapshot.py --model DIR --device cuda --out DIR   # admin.json, admin.html
    python bench/admin_snapshot.py --render admin.html admin.png         # chromium, here

The figures come from `ui/monitor.py` (`memory(engine)`: VRAM on CUDA) and `engine.stats()`,
taken after a short load so that KV is in use. `ui/monitor.py` is loaded by path: the `ui`
package imports Gradio, which the GPU machine does not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import html
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 2**20
PARTS = (  # as ui/admin_page.py draws them
    ("model", "Model weights", "#6366f1"),
    ("kv_used", "KV used", "#f97316"),
    ("kv_free", "KV free", "#fdba74"),
    ("other", "Other", "#94a3b8"),
    ("free", "Free", "#e2e8f0"),
)
PAGE_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #0f172a; max-width: 1100px; }
h1 { font-size: 1.3em; margin: 0 0 4px; } .note { color: #64748b; margin-bottom: 16px; }
table { border-collapse: collapse; margin-top: 18px; font-size: 0.92em; }
td { padding: 3px 14px 3px 0; border-bottom: 1px solid #e2e8f0; } td.v { text-align: right; }
"""


def load_monitor() -> ModuleType:
    """`ui/monitor.py` without `ui/__init__.py` (which needs Gradio)."""
    spec = importlib.util.spec_from_file_location("crowdchat_monitor", ROOT / "ui" / "monitor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def snapshot(engine, label: str, monitor: ModuleType) -> dict:  # noqa: ANN001 - engine.Engine
    """The admin page's figures as plain JSON-able values."""
    import torch

    from engine.model.loader import dtype_name

    mem = monitor.memory(engine)
    out = {
        "label": label,
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "memory": dataclasses.asdict(mem),
        "stats": dataclasses.asdict(engine.stats()),
        "model_id": engine.loaded.model_id,
        "quant": engine.loaded.quant,
        "dtype": dtype_name(engine.loaded.dtype),
        "torch": torch.__version__,
    }
    if engine.loaded.device.type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(engine.loaded.device)
    return out


def memory_bar(mem: dict) -> str:
    """The admin page's stacked bar (ui/admin_page.py), from a snapshot's `memory`."""
    total = mem["total"]
    segs, legend = [], []
    for key, label, color in PARTS:
        pct = 100 * mem[key] / total if total else 0
        segs.append(f'<div title="{label}" style="width:{pct:.3f}%;background:{color}"></div>')
        legend.append(
            f'<span class="cc-key"><i style="background:{color}"></i>{label} '
            f"<b>{mem[key] / MB:,.1f} MB</b></span>"
        )
    detail = " · ".join(f"{k.replace('_', ' ')} {v / MB:,.0f} MB" for k, v in mem["detail"].items())
    return (
        f'<div class="cc-mem"><div class="cc-title">Device memory: {html.escape(mem["device"])}, '
        f'{total / MB:,.0f} MB total</div><div class="cc-bar">{"".join(segs)}</div>'
        f'<div class="cc-legend">{"".join(legend)}</div><div class="cc-detail">{detail}'
        f"</div></div>"
    )


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def page(snap: dict) -> str:
    """A self-contained HTML page: the memory bar and the engine's figures."""
    css = (ROOT / "static" / "crowdchat.css").read_text() + PAGE_CSS
    s = snap["stats"]
    rows = {
        "model": f"{snap['model_id']} ({snap['quant']}, {snap['dtype']})",
        "batch / queue": f"{s['running']} / {s['waiting']}",
        "KV blocks used / total": f"{s['blocks_used']:,} / {s['blocks_total']:,}",
        "KV pool": f"{s['kv_bytes'] / MB:,.0f} MB ({s['kv_bytes_per_token']:,} B/token)",
        "max model len": f"{s['max_model_len']:,}",
        "tokens/s (recent)": f"{s['tokens_per_s']:,.1f}",
        "max batch seen": s["max_batch_seen"],
        "TTFT p50 / ITL p50": f"{ms(s['ttft_p50_s'])} / {ms(s['itl_p50_s'])}",
        "requests finished": s["requests_finished"],
        "torch": snap["torch"],
    }
    table = "".join(
        f"<tr><td>{html.escape(k)}</td><td class='v'>{html.escape(str(v))}</td></tr>"
        for k, v in rows.items()
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>crowdchat admin snapshot"
        f"</title><style>{css}</style></head><body><h1>crowdchat admin: memory</h1>"
        f"<div class='note'>{html.escape(snap['label'])} · {snap['time']}</div>"
        f"{memory_bar(snap['memory'])}<table>{table}</table></body></html>"
    )


def render(html_file: Path, png: Path) -> None:
    """Screenshot the page with Debian's chromium through Playwright (never downloads one)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1150, "height": 620})
            tab.goto(html_file.resolve().as_uri())
            tab.screenshot(path=str(png), full_page=True)
        finally:
            browser.close()


def measure(args: argparse.Namespace) -> dict:
    """Load the model, run a short load that leaves KV resident, take the snapshot."""
    from bench.random_model import is_random
    from bench.throughput import TEXT
    from engine import Engine, EngineConfig, SamplingParams
    from engine.model.loader import load_model

    monitor = load_monitor()  # before the model: fail in seconds, not minutes
    config = EngineConfig.from_namespace(args)
    loaded = load_model(config)
    engine = Engine(config, loaded)
    try:
        ids = loaded.tokenizer.encode(TEXT * 4, add_special_tokens=False)
        sp = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
        t0 = time.perf_counter()
        handles = [
            engine.submit(ids[i * 7 : i * 7 + 300], sp, owner=f"u{i}", retain=True)
            for i in range(args.users)
        ]
        for h in handles:
            h.result()
        wall = time.perf_counter() - t0
        weights = "random weights" if is_random(config.model) else "real weights"
        label = (
            f"{args.users} users x 300-token prompts x 64 tokens in {wall:.2f} s "
            f"({args.users * 64 / wall:,.1f} tok/s), {weights}, KV left resident"
        )
        return snapshot(engine, label, monitor)
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--render", nargs=2, type=Path, metavar=("HTML", "PNG"))
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for admin.json/html")
    ap.add_argument("--users", type=int, default=16)
    from engine import EngineConfig

    EngineConfig.add_arguments(ap)
    args = ap.parse_args()
    if args.render:
        render(*args.render)
        print(json.dumps({"rendered": str(args.render[1])}))
        return
    logging.basicConfig(level=logging.WARNING)
    snap = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admin.json").write_text(json.dumps(snap, indent=1))
    (args.out / "admin.html").write_text(page(snap))
    mem = snap["memory"]
    print(
        json.dumps(
            {
                "admin_snapshot": str(args.out / "admin.html"),
                "device": mem["device"],
                **{f"{k}_mb": round(mem[k] / MB, 1) for k, _, _ in PARTS},
                "total_mb": round(mem["total"] / MB, 1),
                "label": snap["label"],
            }
        )
    )


if __name__ == "__main__":
    main()
