"""The HTML report in a real browser: headless Chromium renders report.html of a small report (built from the
hand-made results of tests/test_report.py) to a PNG, and a probe page (report.html with one script added) reports
what the browser made of it: the tables, and each image's naturalWidth (0 = broken image).

Chromium is the Debian package `chromium` (.ci/run installs it); without it the tests are skipped, saying so."""

import json
import os
import re
import shutil
import subprocess

import pytest

from shapewise.report import report

from test_report import make_run  # tests/ is on sys.path under pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
PROBE = """
<script>
window.addEventListener("load", function () {
  var images = Array.prototype.map.call(document.images, function (img) {
    return {src: img.getAttribute("src"), complete: img.complete, naturalWidth: img.naturalWidth};
  });
  var tables = Array.prototype.map.call(document.querySelectorAll("table"), function (t) {
    return {cls: t.className, rows: t.rows.length, width: t.getBoundingClientRect().width};
  });
  var out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({images: images, tables: tables, bodyWidth: document.body.scrollWidth});
  document.body.appendChild(out);
});
</script>
"""


def _browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium not found (install the Debian package `chromium`: "
                "apt-get install -y chromium; .ci/run does this)")


def _run(browser, tmp_path, *args):
    profile = tmp_path / "chromium-profile"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, HOME=str(tmp_path)))
    assert done.returncode == 0, f"{cmd} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def _probe(browser, tmp_path, report_dir):
    html = (report_dir / "report.html").read_text()
    probe = report_dir / "probe.html"  # beside report.html: the same relative image paths
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    dom = _run(browser, tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match, f"the probe script did not run; DOM tail:\n{dom[-2000:]}"
    return json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">"))


@pytest.fixture
def built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs = make_run(tmp_path)
    report.render(inputs, "results/report")
    return tmp_path / "results" / "report"


def test_report_renders_in_chromium(built, tmp_path):
    browser = _browser()
    png = tmp_path / "report.png"
    _run(browser, tmp_path, f"--screenshot={png}", "--window-size=1280,3000", (built / "report.html").as_uri())
    from PIL import Image

    with Image.open(png) as image:
        image.load()
        assert image.size == (1280, 3000)
        colors = image.convert("L").getextrema()
    assert colors[1] - colors[0] > 100, "the screenshot is blank"

    found = _probe(browser, tmp_path, built)
    classes = [t["cls"] for t in found["tables"]]
    for kind in ("accuracy", "timing", "resources"):
        assert kind in classes, f"no {kind} table in {classes}"
    assert all(t["rows"] >= 2 for t in found["tables"] if t["cls"] in ("accuracy", "timing", "resources"))
    assert {i["src"] for i in found["images"]} == {"figures/speedup.png", "figures/latency.png",
                                                   "figures/ablation.png"}
    broken = [i["src"] for i in found["images"] if not i["complete"] or i["naturalWidth"] == 0]
    assert not broken, f"broken images: {broken}"
    # readable at 1280 px: no table wider than the page
    assert max(t["width"] for t in found["tables"] if t["cls"]) <= 1240


def test_broken_image_is_detected(built, tmp_path):
    browser = _browser()
    (built / "figures" / "latency.png").write_bytes(b"not a png")
    found = _probe(browser, tmp_path, built)
    broken = [i["src"] for i in found["images"] if i["naturalWidth"] == 0]
    assert broken == ["figures/latency.png"]


# Sixteen switches: model.optimized.OPTIMIZATIONS' fourteen and two more as long as its longest name, so that a
# table with room for switches to come still fits.
MANY_SWITCHES = ["fused_layer", "cuda_graph", "reduced_precision", "flash_attention", "fused_layernorm",
                 "packed_qkv", "direct_input", "split_layer", "pdl", "hopper_forward", "hopper_pair", "hopper_producer",
                 "hopper_duo", "hopper_attention", "extra_switch_a_14", "extra_switch_b_15"]


def test_wide_tables_fit_the_page(tmp_path, monkeypatch):
    """The ablation table of fifteen switches and the accuracy table of a long route label stay within the page
    at 1280 px (a table wider than its box is cut off by the box's scroll bar)."""
    browser = _browser()
    import test_report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(test_report, "SWITCHES", MANY_SWITCHES)
    long_route = ("hopper/bf16+hopper-attention launch=(64, 8, 3) kv=precomputed key_block=64 ffn_block=128 "
                  "pair eager prepared-launch direct-launch (auto: wide rows)")
    monkeypatch.setattr(test_report, "ROUTE_STR", long_route)
    report.render(make_run(tmp_path), "results/report")
    built = tmp_path / "results" / "report"
    html = (built / "report.html").read_text()
    assert "pair eager prepared-launch direct-launch</a>" in html
    found = _probe(browser, tmp_path, built)
    widths = {t["cls"]: t["width"] for t in found["tables"] if t["cls"]}
    assert "ablation" in widths and "accuracy" in widths
    assert max(widths.values()) <= 1240, widths
