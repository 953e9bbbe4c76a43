"""Remake the docs' screenshots (run from the repository root): the HTML report of samples/run.h5
(docs/report_html.png) and TensorBoard's scalars of a monitor's history (docs/tensorboard_history.png).

    python docs/make_screenshots.py            # both
    python docs/make_screenshots.py report     # one of them: report, tensorboard

Needs headless Chromium driven by selenium, as tests/test_html_report.py drives it (Debian's ``chromium`` and
``chromium-driver``, ``pip install selenium``), and for the TensorBoard one torch (a tiny torch.ao QAT model
trained for 40 steps under ``qgcli.monitor.torch.monitor``) and ``tensorboard``, started on the loopback
interface only and stopped when the page has been shot.  The PNGs are saved with a palette of 256 colours to
stay small.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def browser(width, height):
    """A headless Chromium (selenium) whose viewport is ``width`` x ``height``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(60)
    return driver


def wait_for(driver, script, timeout=60.0):
    """Wait until ``script`` (JavaScript returning a truthy value when the page is ready) holds."""
    end = time.monotonic() + timeout
    while not driver.execute_script(script):
        if time.monotonic() > end:
            raise TimeoutError(f"the page did not get ready: {script}")
        time.sleep(0.25)


def save_small(driver, dest):
    """The viewport as a PNG with a 256-colour palette (a few times smaller than the screenshot)."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(dest, optimize=True)
    print(f"wrote {os.path.relpath(dest, ROOT)} ({os.path.getsize(dest) // 1024} KB)")


def qgcli(*args):
    subprocess.run([sys.executable, "-m", "qgcli", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def report_screenshot(work):
    """``qgcli report samples/run.h5 --html``, the whole page, one TensorFlow layer's details opened (its
    histogram against its range)."""
    page = os.path.join(work, "run_report.html")
    qgcli("report", "samples/run.h5", "--html", page, "-q")  # run in ROOT: the title names samples/run.h5
    driver = browser(1100, 1700)
    try:
        driver.get("file://" + page)
        box = driver.find_element("css selector", "details[data-layer='step_000100/backbone/conv1/act_quant']")
        box.find_element("tag name", "summary").click()
        wait_for(driver, "return document.querySelector('details[open] svg rect') !== null")
        driver.execute_script("window.scrollTo(0, 0);")
        save_small(driver, os.path.join(DOCS, "report_html.png"))
    finally:
        driver.quit()


def _history(path):
    """A tiny torch.ao QAT model trained for 40 steps, sampled every 2; at step 25 conv2's output quantizer gets
    a scale that clips everything (the fault docs/monitor.md plants)."""
    import warnings

    import torch
    import torch.ao.quantization as tq
    from torch import nn

    from qgcli.monitor.torch import monitor

    warnings.simplefilter("ignore")
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
            self.conv2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
            self.fc = nn.Linear(8 * 8 * 8, 4)

        def forward(self, x):
            x = self.relu1(self.bn1(self.conv1(self.quant(x))))
            return self.dequant(self.fc(torch.flatten(self.relu2(self.conv2(x)), 1)))

    model = Net()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(model.train(), inplace=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor(model, path, every=2, optimizer=optimizer):
        for step in range(1, 41):
            if step == 25:
                q = model.conv2.activation_post_process
                q.disable_observer()
                q.scale.fill_(1e-12)
                q.forward = lambda x: torch.fake_quantize_per_tensor_affine(x, q.scale, q.zero_point, 0, 127)
            x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: True once four of the scalars dashboard's charts have drawn their line (the charts live in shadow DOMs).
_LINES_DRAWN = """
function deep(root, selector) {
  var found = Array.from(root.querySelectorAll(selector));
  root.querySelectorAll("*").forEach(function (e) { if (e.shadowRoot) found = found.concat(deep(e.shadowRoot, selector)); });
  return found;
}
return deep(document, "path.line").filter(function (p) { return (p.getAttribute("d") || "").length > 20; }).length >= 4;
"""


def tensorboard_screenshot(work):
    """``qgcli trend HISTORY --tensorboard LOGDIR``, TensorBoard on the loopback interface, its scalars of the
    blocked gradient per layer and the aggregate curves."""
    history, logdir = os.path.join(work, "run.qgh"), os.path.join(work, "tb")
    _history(history)
    qgcli("trend", history, "--tensorboard", logdir)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", "tb", "--host", "127.0.0.1",
                               "--port", str(port), "--reload_interval", "0"], cwd=work,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        end = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "data/runs", timeout=2) as answer:
                    if answer.read().strip() not in (b"", b"[]") or time.monotonic() > end:
                        break
            except OSError:
                if time.monotonic() > end:
                    raise
            time.sleep(0.5)
        driver = browser(1280, 1000)
        try:
            # the scalars dashboard: conv2's blocked gradient (its output quantizer's jump at step 25) and the
            # aggregate curves, without smoothing
            driver.get(url + "#scalars&tagFilter=gradient_blocked%2Fconv2&_smoothingWeight=0")
            wait_for(driver, _LINES_DRAWN)
            time.sleep(2)  # the charts' last frames
            save_small(driver, os.path.join(DOCS, "tensorboard_history.png"))
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(which):
    with tempfile.TemporaryDirectory() as work:
        if "report" in which:
            report_screenshot(work)
        if "tensorboard" in which:
            tensorboard_screenshot(work)


if __name__ == "__main__":
    main(sys.argv[1:] or ["report", "tensorboard"])
