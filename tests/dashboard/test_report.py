"""`tidal simulate --report` writes one self-contained page; Chromium opens it
from disk and every plot renders (a real image, not a broken one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_report_opens_in_chromium_with_every_image_rendered(page, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["simulate", "--trace", "cluster10", "--cluster", "n8g8", "--policy", "fifo,elasticflow", "--report",
            "--out", str(out)]
    res = subprocess.run([sys.executable, "-m", "tidal", *argv], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, COLUMNS="120"))
    assert res.returncode == 0, res.stderr
    report = out / "report.html"
    assert f"report: {report}" in " ".join(res.stderr.split())
    text = report.read_text()
    assert "src=\"http" not in text and "<script" not in text  # self-contained: nothing fetched
    page.goto(report.as_uri())
    imgs = page.eval_on_selector_all("img", "els => els.map(e => [e.alt, e.complete, e.naturalWidth, e.naturalHeight])")
    alts = [a for a, *_ in imgs]
    assert alts == ["GPUs allocated over time", "Job completion time CDF", "Deadline ratio per policy",
                    "GPU allocation, fifo", "GPU allocation, elasticflow"]
    assert all(done and w > 300 and h > 150 for _, done, w, h in imgs), imgs
    rows = page.eval_on_selector_all("tbody tr", "rs => rs.map(r => r.cells[0].textContent)")
    assert rows == ["fifo", "elasticflow"]
    assert page.text_content("#command") == "tidal " + " ".join(argv)
    page.set_viewport_size({"width": 1100, "height": 900})
    page.screenshot(path=str(Path(__file__).resolve().parents[2] / "docs" / "img" / "simulate-report.png"),
                    full_page=False)
