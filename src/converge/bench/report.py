"""One self-contained HTML page of every benchmark's latest results, and its rendering to PNG.

``write_report(results_dir, out_html)`` gathers ``results_dir`` (and its
subfolders one level down, e.g. the GPU results of ``benchmarks/gpu_check.sh``).
The page opens with the headline: one table of each app's surrogate against its
classical method, accuracy and speed (from ``surrogate*.json``). Then, for each
platform section of :data:`SECTIONS` and each section the installed apps supply
(``App.report_sections``), the files ``STEM.json``, ``STEM_*.json``
(``gemm.json`` beside ``gemm_gpu.json``) and their ``STEM*.png``, a table per
result and every figure embedded as a base64 ``data:`` URI. No external CSS,
scripts or fonts: the page opens offline, from anywhere. A section without
results says "not measured yet". The page opens with the machine that built it
and each result names the machine it was measured on.

``render_png(html, png)`` screenshots the page with headless Chromium.
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from ..contract import ReportSection, app_classes
from ..data.atomic import atomic_write_bytes
from ..tables import Table
from . import report_tables as tables
from .machine import describe_machine, machine_line

PAGE_WIDTH = 1400  # px, the screenshot's width
IMAGE_WIDTH = 1300  # px, the widest a figure is shown
MAX_SCREENSHOT_HEIGHT = 16_000  # px: Chromium's compositor draws nothing beyond ~16k in one screenshot
CHROMIUM = "/usr/bin/chromium"
NOT_MEASURED = "not measured yet"


SECTIONS: tuple[ReportSection, ...] = (  # the platform's; the apps add theirs
    ReportSection("gemm", "Matrix multiply (GEMM)", ("gemm",), "TFLOP/s of square products per precision and size, "
            "against the theoretical peak (converge bench gemm).", tables.gemm_tables),
    ReportSection("allreduce", "Collectives", ("allreduce", "collectives"), "allreduce, allgather, reduce_scatter and "
            "broadcast over torch.distributed; bus bandwidth as nccl-tests define it (converge bench allreduce).",
            tables.collectives_tables),
    ReportSection("ddp", "Data-parallel training scaling", ("ddp", "scale", "scaling"), "training throughput against "
            "the number of DDP ranks, and a ring all-reduce model of GPU clusters (converge bench ddp).",
            tables.ddp_tables),
    ReportSection("serve", "Serving", ("serve",), "the model alone and converge serve under load, batching on and off "
            "(converge bench serve).", tables.serve_tables),
    ReportSection("surrogate", "Simulator against surrogate", ("surrogate",), "wall time per sample of each app's "
            "simulator and its surrogate, same machine, one run, with accuracy alongside (converge bench "
            "surrogate).", tables.surrogate_tables),
    ReportSection("precision", "Training precision", ("precision",), "bf16 against fp32 training, side by side "
            "(benchmarks/precision.py).", tables.precision_tables),
)


def app_sections() -> list[ReportSection]:
    """The sections the installed apps supply (``App.report_sections``), app by app in name order; an app that
    does not load gets a section saying so."""
    classes, errors = app_classes()
    found = [section for cls in classes.values() for section in cls().report_sections()]
    return found + [ReportSection(f"app-{name}", name, (), f"app {name!r} did not load ({error}); its sections are "
                                  "missing.", lambda result: []) for name, error in errors.items()]


def all_sections() -> list[ReportSection]:
    """The platform's sections, then the apps'."""
    return [*SECTIONS, *app_sections()]


STYLE = """
body { font-family: sans-serif; margin: 24px 40px; color: #222; max-width: 1320px; }
h1 { font-size: 26px; margin-bottom: 4px; } h2 { font-size: 21px; border-bottom: 2px solid #ccc; margin-top: 36px; }
h3 { font-size: 16px; margin: 18px 0 6px; } p.about, p.note, p.meta { color: #555; margin: 4px 0; }
p.missing { color: #a33; font-style: italic; } table { border-collapse: collapse; margin: 8px 0 14px; }
caption { text-align: left; font-weight: bold; padding: 4px 0; } th, td { border: 1px solid #ccc; padding: 3px 8px;
font-size: 13px; text-align: left; vertical-align: top; } th { background: #f0f0f0; }
figure { margin: 10px 0 18px; } figcaption { color: #555; font-size: 12px; } nav a { margin-right: 14px; }
"""


class ReportInfo(NamedTuple):
    path: Path
    files: dict[str, list[str]]  # section key -> result files shown (empty: not measured yet)
    estimated_height: int  # px at PAGE_WIDTH, for render_png


def result_files(results_dir: Path, stems: Sequence[str], suffix: str) -> list[Path]:
    """``STEM.SUFFIX``, ``STEM_*.SUFFIX`` and ``STEM-*.SUFFIX`` in ``results_dir`` and its subfolders, sorted
    (CPU before GPU: ``gemm.json`` sorts before ``gemm_gpu.json``)."""
    found: set[Path] = set()
    for stem in stems:
        for where in ("", "*/"):
            for pattern in (f"{stem}.{suffix}", f"{stem}_*.{suffix}", f"{stem}-*.{suffix}"):
                found.update(p for p in results_dir.glob(where + pattern) if p.is_file())
    return sorted(found, key=lambda p: (len(p.relative_to(results_dir).parts), p.name))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    return struct.unpack(">II", data[16:24])


def html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in table.header)
    head = f"<tr>{head}</tr>" if any(table.header) else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in table.rows)
    return f"<table><caption>{html.escape(table.caption)}</caption>{head}{body}</table>"


def html_figure(path: Path) -> tuple[str, int]:
    """An ``<img>`` with the PNG inline, and its displayed height in px."""
    data = path.read_bytes()
    width, height = png_size(data)
    shown_w = min(width, IMAGE_WIDTH)
    shown_h = round(height * shown_w / width)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    return (f'<figure><img src="{uri}" width="{shown_w}" height="{shown_h}" alt="{html.escape(path.name)}">'
            f"<figcaption>{html.escape(path.name)}</figcaption></figure>", shown_h)


def result_block(path: Path, results_dir: Path, section: ReportSection) -> tuple[str, int]:
    """One result file's heading, tables and notes; its estimated height in px."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return (f"<h3>{html.escape(str(path.relative_to(results_dir)))}</h3><p class=\"missing\">unreadable: "
                f"{html.escape(str(err))}</p>", 80)
    try:
        found = section.render(result)
        fallback = ""
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        found = tables.scalar_table(result)
        fallback = f'<p class="note">layout not recognised ({html.escape(type(err).__name__)}: ' \
                   f"{html.escape(str(err))}): its values follow as they are.</p>"
    parts = [f"<h3>{html.escape(str(path.relative_to(results_dir)))}</h3>", fallback]
    machine = result.get("machine") if isinstance(result, dict) else None
    if machine:
        parts.append(f'<p class="meta">measured on {html.escape(machine_line(machine))}</p>')
    parts += [html_table(t) for t in found]
    notes = result.get("notes", []) if isinstance(result, dict) else []
    parts += [f'<p class="note">note: {html.escape(str(n))}</p>' for n in notes]
    height = 60 + sum(40 + 26 * (len(t.rows) + 1) for t in found) + 22 * len(notes)
    return "".join(parts), height


def section_block(section: ReportSection, results_dir: Path) -> tuple[str, list[str], int]:
    """A section's HTML, the files it shows and its estimated height."""
    jsons = result_files(results_dir, section.stems, "json")
    pngs = result_files(results_dir, section.stems, "png")
    parts = [f'<section id="{section.key}"><h2>{html.escape(section.title)}</h2>',
             f'<p class="about">{html.escape(section.about)}</p>']
    height = 110
    if not jsons and not pngs:
        parts.append(f'<p class="missing">{NOT_MEASURED}</p>')
    for path in jsons:
        block, h = result_block(path, results_dir, section)
        parts.append(block)
        height += h
    for path in pngs:
        try:
            figure, h = html_figure(path)
        except (OSError, ValueError, struct.error) as err:
            figure, h = f'<p class="missing">{html.escape(path.name)} unreadable: {html.escape(str(err))}</p>', 0
        parts.append(figure)
        height += h + 40
    parts.append("</section>")
    return "".join(parts), [str(p.relative_to(results_dir)) for p in jsons + pngs], height


def headline_block(results_dir: Path) -> tuple[str, int]:
    """The headline: each app's surrogate against its classical method, from the newest-named surrogate result."""
    parts = ['<section id="headline"><h2>Surrogates against their classical methods</h2><p class="about">accuracy '
             "and speed-up per sample, same machine, one run (converge bench surrogate); the detail follows in each "
             "app's sections.</p>"]
    found = result_files(results_dir, ("surrogate",), "json")
    height = 110
    for path in found:
        try:
            table = tables.headline_table(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            parts.append(f'<p class="missing">{html.escape(path.name)}: {html.escape(str(err))}</p>')
            continue
        parts.append(f"<h3>{html.escape(str(path.relative_to(results_dir)))}</h3>{html_table(table)}")
        height += 60 + 26 * (len(table.rows) + 1)
    if not found:
        parts.append(f'<p class="missing">{NOT_MEASURED}</p>')
    parts.append("</section>")
    return "".join(parts), height


def build_html(results_dir: str | Path, machine: dict[str, Any] | None = None) -> tuple[str, dict[str, list[str]],
                                                                                       int]:
    """The page's HTML, the files shown per section and the page's estimated height."""
    results_dir = Path(results_dir)
    machine = machine or describe_machine()
    sections = all_sections()
    headline, height = headline_block(results_dir)
    blocks, files, height = [], {}, 300 + height
    for section in sections:
        block, shown, h = section_block(section, results_dir)
        blocks.append(block)
        files[section.key] = shown
        height += h
    machine_block = html_table(tables.machine_table(machine))
    height += 26 * (12 + len(machine.get("versions", {})))
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>converge platform report</title>'
            f"<style>{STYLE}</style></head><body data-estimated-height=\"{height}\">"
            f"<h1>converge platform report</h1><p class=\"meta\">{date}; results from "
            f"{html.escape(str(results_dir))}</p><nav>{nav}</nav>{headline}"
            f'<section id="machine"><h2>Machine</h2><p class="about">The machine this report was built on; each '
            f"result below names the machine it was measured on.</p>{machine_block}</section>"
            f"{''.join(blocks)}</body></html>\n")
    return page, files, height


def write_report(results_dir: str | Path, out_html: str | Path) -> ReportInfo:
    """Write the report page for ``results_dir`` to ``out_html`` atomically; see the module docstring."""
    page, files, height = build_html(results_dir)
    out_html = Path(out_html)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_html, page.encode())
    return ReportInfo(out_html, files, height)


def estimated_height(html_path: str | Path) -> int:
    """The height :func:`build_html` estimated for the page (1200 px if the page does not say)."""
    found = re.search(r'data-estimated-height="(\d+)"', Path(html_path).read_text(errors="replace"))
    return int(found.group(1)) if found else 1200


def chromium_command(chromium: str, html_path: Path, png_path: Path, width: int, height: int, profile: str
                     ) -> list[str]:
    """Headless Chromium taking one screenshot, with nothing fetched from the network."""
    return [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--screenshot={png_path}", f"--window-size={width},{height}",
            html_path.resolve().as_uri()]


def render_png(html_path: str | Path, png_path: str | Path, width: int = PAGE_WIDTH, height: int | None = None,
               chromium: str | None = None, timeout_s: float = 120.0) -> Path:
    """Screenshot ``html_path`` into ``png_path`` with headless Chromium (``--screenshot``), atomically.

    ``height`` defaults to the page's own estimate, capped at :data:`MAX_SCREENSHOT_HEIGHT`.
    Raises FileNotFoundError without Chromium, RuntimeError when it writes no image.
    """
    chromium = chromium or shutil.which("chromium") or CHROMIUM
    if not Path(chromium).is_file():
        raise FileNotFoundError(f"no Chromium at {chromium}: install it (Debian: apt-get install chromium)")
    html_path, png_path = Path(html_path), Path(png_path)
    height = min(height or estimated_height(html_path), MAX_SCREENSHOT_HEIGHT)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.name}.tmp-{os.getpid()}.png")
    with tempfile.TemporaryDirectory(prefix="converge-chromium-") as profile:
        try:
            proc = subprocess.run(chromium_command(chromium, html_path, tmp, width, height, profile),
                                  capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
            if not tmp.is_file() or tmp.stat().st_size == 0:
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
                raise RuntimeError(f"Chromium wrote no screenshot (exit {proc.returncode}):\n{tail}")
            os.replace(tmp, png_path)
        finally:
            tmp.unlink(missing_ok=True)
    return png_path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.report [RESULTS] [--out report.html] [--png report.png]``."""
    parser = argparse.ArgumentParser(prog="converge report", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=Path("benchmarks/results"),
                        help="folder of benchmark results (default benchmarks/results)")
    parser.add_argument("--out", type=Path, default=None, help="HTML file (default RESULTS/report.html)")
    parser.add_argument("--png", type=Path, default=None, help="also screenshot it here with headless Chromium")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        print(f"error: {args.results} is not a folder of results", file=sys.stderr)
        return 2
    info = write_report(args.results, args.out or args.results / "report.html")
    missing = [k for k, files in info.files.items() if not files]
    print(f"written {info.path}" + (f"; not measured yet: {', '.join(missing)}" if missing else ""), file=sys.stderr)
    if args.png:
        try:
            print(f"written {render_png(info.path, args.png)}", file=sys.stderr)
        except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
