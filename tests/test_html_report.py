"""report --html: one self-contained page, checked in a real headless Chromium (skipped where none starts):
it renders, the table sorts and filters, a layer's details draw when opened, no request leaves the page and
the console shows no error."""
import json
import os
import shutil

import pytest

from qgcli.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "samples")


def _cli(*args):
    from clirunner import make_runner

    return make_runner().invoke(main, list(args))


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("needs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as exc:  # noqa: BLE001 - a browser that cannot start here is a skip, not a failure
        pytest.skip(f"chromium does not start here: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _requests(driver):
    """The URLs the page asked for, from Chromium's network log."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def _drawn(element, selector, timeout=10.0):
    """The elements ``selector`` finds under ``element`` once the page's script has drawn them (the details'
    ``toggle`` event fires after the click returns)."""
    import time

    end = time.monotonic() + timeout
    while True:
        found = element.find_elements("css selector", selector)
        if found or time.monotonic() > end:
            return found
        time.sleep(0.05)


def _column(driver, index):
    return [td.text for td in driver.find_elements("css selector", f"#qg-table tbody tr td:nth-child({index})")
            if td.is_displayed()]


def test_run_file_page_in_chromium(tmp_path, browser):
    page = tmp_path / "report.html"
    r = _cli("report", os.path.join(SAMPLES, "run.h5"), "--html", str(page), "-q")
    assert r.exit_code == 0, r.output
    browser.get_log("browser"), browser.get_log("performance")  # start both logs from here
    browser.get(page.as_uri())
    assert browser.find_element("id", "verdict").text.startswith("Verdict: 4 of 8 layers")
    headers = browser.find_elements("css selector", "#qg-table thead th")
    names = [h.text for h in headers]
    assert names[:3] == ["layer", "op", "family"]
    blocked = names.index("blocked") + 1
    worst_first = _column(browser, blocked)
    assert worst_first[0] == "29.2%" and len(worst_first) == 8
    headers[blocked - 1].click()  # descending first
    headers[blocked - 1].click()  # then ascending
    ascending = [float(v.rstrip("%")) for v in _column(browser, blocked)]
    assert ascending == sorted(ascending) and ascending[0] < ascending[-1]
    sqnr = names.index("SQNR dB") + 1
    headers[sqnr - 1].click()
    values = [float(v) for v in _column(browser, sqnr)]
    assert values == sorted(values, reverse=True)
    box = browser.find_element("css selector", "input.filter")
    box.send_keys("weight_quant")
    assert all("weight_quant" in t for t in _column(browser, 1)) and len(_column(browser, 1)) == 2
    box.clear()
    # a layer's details are drawn when it is opened: a histogram (SVG) and its per-channel table
    first = browser.find_element("css selector", "details[data-layer='step_000100/backbone/conv1/weight_quant']")
    assert first.find_elements("css selector", "svg") == []
    first.find_element("tag name", "summary").click()
    assert _drawn(first, "svg rect")
    rows = _drawn(first, "table tbody tr")
    assert len(rows) == 16  # the weight quantizer's 16 channels, worst first
    torch_layer = browser.find_element("css selector", "details[data-layer='step_000100/head/act_quant']")
    torch_layer.find_element("tag name", "summary").click()
    assert _drawn(torch_layer, "svg rect")
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    assert [u for u in _requests(browser) if not u.startswith(("file:", "data:"))] == []


def test_bundle_page_and_its_checks(tmp_path, browser):
    page = tmp_path / "channels.html"
    r = _cli("report", os.path.join(SAMPLES, "per_channel.h5"), "--html", str(page), "-q")
    assert r.exit_code == 0, r.output
    browser.get_log("browser")
    browser.get(page.as_uri())
    assert browser.find_element("id", "verdict").text.startswith("Verdict: 3 of 16 channels")
    assert _column(browser, 1)[:3] == ["3", "12", "7"]
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_html_output_is_checked_like_every_output(tmp_path):
    page = tmp_path / "p.html"
    assert _cli("report", os.path.join(SAMPLES, "per_channel.h5"), "--html", str(page), "-q").exit_code == 0
    before = page.read_bytes()
    r = _cli("report", os.path.join(SAMPLES, "per_channel.h5"), "--html", str(page), "-q")
    assert r.exit_code == 2 and "exists; use --force" in r.output and page.read_bytes() == before
    r = _cli("report", os.path.join(SAMPLES, "run.h5"), "--html", str(tmp_path / "missing" / "p.html"), "-q")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = _cli("report", os.path.join(SAMPLES, "per_channel.h5"), "--html", os.path.join(SAMPLES, "per_channel.h5"),
             "--force", "-q")
    assert r.exit_code == 2 and "is also an input" in r.output
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".qgcli")]


def test_page_is_self_contained_and_escapes_names(tmp_path):
    from qgcli.report import html

    doc = {"command": "report", "verdict": "Verdict: OK", "layers": [
        {"path": "<script>alert(1)</script>", "op": "x", "family": "tf", "gradient_blocked": 0.5, "flagged": True}]}
    text = html.page(doc, details={"<script>alert(1)</script>": {"note": "</script><script>alert(2)"}})
    assert "<script>alert(1)</script>" not in text and "</script><script>alert(2)" not in text
    head = text.split("</head>")[0]
    assert "default-src 'none'" in head
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text


def _big_run(tmp_path):
    import numpy as np
    import h5py

    run = tmp_path / "big.h5"
    rng = np.random.default_rng(5)
    with h5py.File(run, "w") as f:
        for i in range(500):
            g = f.create_group(f"step_000001/block{i:03d}/act_quant")
            g.attrs["op"] = "FakeQuantWithMinMaxVars"
            g["inputs"] = rng.standard_normal((4, 64)).astype(np.float32)
            g["gradients"] = rng.standard_normal((4, 64)).astype(np.float32)
            g["min"], g["max"] = np.float32(-1), np.float32(1)
    page = tmp_path / "big.html"
    r = _cli("report", str(run), "--html", str(page), "-q")
    assert r.exit_code == 0, r.output
    return page


@pytest.fixture(scope="module")
def big_page(tmp_path_factory):
    return _big_run(tmp_path_factory.mktemp("big"))


def test_a_page_of_500_layers_stays_small(big_page):
    """Hundreds of layers: a few KB each (the figures are drawn when opened, from compact data)."""
    size = big_page.stat().st_size
    assert size < 500 * 4096, size


def test_a_page_of_500_layers_opens_within_2_s(big_page, browser):
    """Chromium's own clock, from navigation start to the end of the load event (script run, table laid out)."""
    def load_ms():
        browser.get(big_page.as_uri())
        return browser.execute_script("var t = performance.getEntriesByType('navigation')[0]; return t.loadEventEnd;")

    browser.get_log("browser")
    took = load_ms()
    if took >= 2000:  # a load spike on a shared CI machine passes; a page that is slow twice does not
        took = min(took, load_ms())
    assert 0 < took < 2000, took
    assert len(browser.find_elements("css selector", "#qg-table tbody tr")) == 500
    last = browser.find_elements("css selector", "details[data-layer]")[-1]
    browser.execute_script("arguments[0].open = true;", last)
    assert _drawn(last, "svg rect")  # the last layer's details drawn on demand
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_history_page_in_chromium(tmp_path, browser):
    import history_samples

    history = history_samples.write(tmp_path / "run.qgh")
    page = tmp_path / "trend.html"
    assert _cli("trend", history, "--html", str(page)).exit_code == 0
    browser.get_log("browser")
    browser.get(page.as_uri())
    assert browser.find_element("id", "verdict").text == "3 events in 2 of 3 layers over 4 samples (steps 1..30)"
    assert _column(browser, 1)[0] == "conv2.act"  # the most blocked first
    box = browser.find_element("css selector", "details[data-layer='conv2.act']")
    box.find_element("tag name", "summary").click()
    rows = _drawn(box, "table tbody tr")
    assert [r.find_elements("tag name", "td")[0].text for r in rows] == ["1", "10", "20", "30"]
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    assert [u for u in _requests(browser) if not u.startswith(("file:", "data:"))] == []


def _cells(driver, index):
    return [td for td in driver.find_elements("css selector", f"#qg-table tbody tr td:nth-child({index})")]


def test_run_file_page_with_a_baseline_in_chromium(tmp_path, browser):
    """report B --baseline A --html: the comparison's verdict, the layers worst change first, each change beside
    its value (red when worse), the score column sortable; the same numbers as the JSON's baseline section."""
    import h5py
    import numpy as np

    a, b = os.path.join(SAMPLES, "run.h5"), tmp_path / "b.h5"
    shutil.copy(a, b)
    with h5py.File(b, "r+") as f:  # B narrows one activation range: more clipped, more gradient blocked
        g = f["step_000200/backbone/conv1/act_quant"]
        g["min"][()], g["max"][()] = np.float32(-0.2), np.float32(0.2)
    doc = json.loads(_cli("report", str(b), "--baseline", a, "--json", "-q").stdout)
    page = tmp_path / "b.html"
    assert _cli("report", str(b), "--baseline", a, "--html", str(page), "-q").exit_code == 0
    browser.get_log("browser"), browser.get_log("performance")
    browser.get(page.as_uri())
    assert browser.find_element("id", "baseline").text == f"Against the baseline {a}: {doc['baseline']['verdict']}"
    names = [h.text for h in browser.find_elements("css selector", "#qg-table thead th")]
    assert names[:3] == ["layer", "Δ worse", "op"]
    worst = doc["baseline"]["rows"][0]
    assert _column(browser, 1)[0] == worst["paths"][1] == "step_000200/backbone/conv1/act_quant"
    blocked = _cells(browser, names.index("blocked") + 1)
    marks = blocked[0].find_elements("css selector", "span.d.worse")
    assert [m.text for m in marks] == [f"{100 * worst['change']['gradient_blocked']:+.1f}"]
    assert blocked[0].text.startswith(f"{100 * worst['b']['gradient_blocked']:.1f}%")
    assert all(not c.find_elements("css selector", "span.d") for c in blocked[1:])  # the others did not change
    sqnr = _cells(browser, names.index("SQNR dB") + 1)[0]
    assert sqnr.find_element("css selector", "span.d.worse").text == f"{worst['change']['sqnr_db']:+.1f}"
    scores = _column(browser, 2)
    assert scores[0] == f"{worst['score']:+.1f}" and scores[1:] == ["0"] * 7
    header = browser.find_elements("css selector", "#qg-table thead th")[names.index("blocked")]
    header.click()  # sorting by a value still works with the changes beside the values
    values = [float(v.split("%")[0]) for v in _column(browser, names.index("blocked") + 1)]
    assert values == sorted(values, reverse=True)
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    assert [u for u in _requests(browser) if not u.startswith(("file:", "data:"))] == []


def test_history_page_with_a_baseline_in_chromium(tmp_path, browser):
    import history_samples

    a = history_samples.write(tmp_path / "a.qgh")
    b = history_samples.write(tmp_path / "b.qgh", worse=2.0, steps=(1, 10, 20, 30, 40))
    doc = json.loads(_cli("report", b, "--baseline", a, "--json").stdout)
    page = tmp_path / "b.html"
    assert _cli("report", b, "--baseline", a, "--html", str(page)).exit_code == 0
    browser.get_log("browser")
    browser.get(page.as_uri())
    assert browser.find_element("id", "baseline").text.startswith(f"Against the baseline {a} at step 30: Verdict: "
                                                                   "3 of 3 rows worse")
    assert _column(browser, 1) == [r["path"] for r in doc["baseline"]["rows"]]  # worst change first
    names = [h.text for h in browser.find_elements("css selector", "#qg-table thead th")]
    assert _column(browser, names.index("step") + 1) == ["30"] * 3  # the values at the step compared
    for cell, row in zip(_cells(browser, names.index("blocked") + 1), doc["baseline"]["rows"]):
        assert cell.find_element("css selector", "span.d.worse").text == f"{100 * row['change']['gradient_blocked']:+.1f}"
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
