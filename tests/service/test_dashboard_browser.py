"""The KV dashboard in a real browser: headless Chromium (Debian's) driven by Playwright, against the real
stack (redis-server, two gateways, two workers on the demo model). The page asks for the key and then
draws the pool, follows a load of concurrent streams (n=2 ones share blocks), highlights a request's
blocks when its row is hovered, and switches engines; a screenshot goes to $PAGEDSERVE_ARTIFACTS (default
./artifacts) for CI to keep."""
from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from tests.service.conftest import API_KEY, MODEL_NAME, ROOT

try:
    from playwright import sync_api
except ImportError:
    sync_api = None
CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = ("playwright is not installed (pip install '.[test]')" if sync_api is None else
           "no chromium on PATH (apt-get install chromium)" if CHROMIUM is None else None)
# CI sets PAGEDSERVE_REQUIRE_BROWSER=1: there a missing browser fails the tests instead of skipping them.
pytestmark = pytest.mark.skipif(MISSING is not None and os.environ.get("PAGEDSERVE_REQUIRE_BROWSER") != "1",
                                reason=MISSING or "")
ARTIFACTS = os.environ.get("PAGEDSERVE_ARTIFACTS") or os.path.join(ROOT, "artifacts")
FREE_RGB, CACHED_RGB, INK_RGB = (0xE5, 0xE7, 0xEB), (0xBA, 0xE6, 0xFD), (0x11, 0x18, 0x27)

# The pixel (RGB) at a block's cell, in canvas pixels: its centre, or its top-left corner (inside the outline a
# highlighted cell gets).
PIXEL_JS = """([grid, block, corner]) => {
    const box = window.kvDashboard.cellBox(grid, block);
    const at = corner ? [box.x + 1, box.y + 1] : [box.x + box.size / 2, box.y + box.size / 2];
    const data = document.getElementById(grid).getContext("2d").getImageData(at[0], at[1], 1, 1).data;
    return [data[0], data[1], data[2]];
}"""
# One consistent reading of the hovered request: the page redraws every 0.5 s, a script runs between frames.
HIGHLIGHT_JS = """() => {
    const pixel = """ + PIXEL_JS + """;
    const d = window.kvDashboard, s = d.snapshot, grid = document.getElementById("device-grid");
    const request = s.requests.find((r) => r.id === d.hover);
    if (!request || request.state !== "running") return null;
    const mine = new Set(request.blocks);
    const others = [];
    for (let i = 0; i < s.device.size; i++) if (!mine.has(i) && s.device.state[i] >= 2) others.push(i);
    return {highlighted: grid.dataset.highlighted, blocks: [...mine].sort((a, b) => a - b),
            row: document.querySelector(`#requests tr[data-id="${request.id}"]`).className,
            mine: [...mine].map((b) => pixel(["device-grid", b, true])),
            others: others.map((b) => pixel(["device-grid", b, true]))};
}"""
RUNNING = "Number(document.querySelector('[data-counter=\"running\"]').textContent)"


def near(rgb: list[int], expected: tuple[int, int, int], tolerance: int = 6) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(rgb, expected))


class Load:
    """Concurrent streaming completions, each thread sending one after another until stopped; a shared
    prompt prefix (prefix-cache hits) and n=2 on half of them (forked sequences share blocks). The gateways
    route the shared prefix to the engine that cached it first; the other steals from its queue."""

    def __init__(self, url: str, streams: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.completed = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": "the pool of KV blocks, shared " * 3 + str(i), "max_tokens": 120,
                "n": 2 if i % 2 else 1, "temperature": 1.0, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            request = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(), headers={
                "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200
                response.read()
            self.completed += 1


@pytest.fixture
def page(stack) -> Iterator:
    if MISSING:
        pytest.fail(MISSING)
    with sync_api.sync_playwright() as playwright:
        # The system's Chromium (no browser download); a container's /dev/shm may be too small for it.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--disable-dev-shm-usage"])
        # The page's CSP forbids eval; Playwright's string predicates need it (the page's own script never does).
        page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield page
        browser.close()
        assert not errors, errors  # no script error on the page


def counter(page, name: str) -> str:
    return page.inner_text(f'[data-counter="{name}"]')


def show_engine(page, engine: str) -> None:
    page.select_option("#engine", engine)
    page.wait_for_function(f"window.kvDashboard.snapshot.engine_id === '{engine}'")


def next_snapshot(page) -> None:
    """Until the page has drawn a snapshot newer than the one it shows now."""
    page.evaluate("() => { window.seenSnapshot = window.kvDashboard.snapshot; }")
    page.wait_for_function("window.kvDashboard.snapshot !== window.seenSnapshot")


def show_an_engine_running(page, count: int) -> str:
    """Shows an engine running ``count`` requests or more: each in turn, a fresh snapshot of each, until one does
    (the shared prefix is routed to one engine; the other steals what waits there too long). Returns the other."""
    for engine in ["w0", "w1"] * 60:
        show_engine(page, engine)
        next_snapshot(page)  # the new engine's snapshot may be one drawn before the switch's fetch
        if page.evaluate(RUNNING) >= count:
            return "w0" if engine == "w1" else "w1"
    raise AssertionError(f"no engine ran {count} requests at once in 120 snapshots")


def test_dashboard_in_a_browser(stack, page) -> None:
    # Without a key the page asks for one; with it, it draws the first engine's pool.
    page.goto(f"{stack.url}/dashboard")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#key", API_KEY)
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('device-grid').dataset.blocks === '96'")
    assert page.is_hidden("#key-form") and page.input_value("#engine") == "w0"
    assert [o.get_attribute("value") for o in page.query_selector_all("#engine option")] == ["w0", "w1"]
    free = page.evaluate("window.kvDashboard.snapshot.device.state.findIndex((s) => s === 0)")
    assert near(page.evaluate(PIXEL_JS, ["device-grid", free, False]), FREE_RGB)  # a free block, drawn grey

    # 16 streams, 8 sequences at most per engine: both engines run some (one by stealing from the other).
    with Load(stack.url, streams=16) as load:
        # Updates while the load runs: requests listed, their blocks drawn, the counters and the chart moving.
        page.wait_for_function(f"""() => {RUNNING} > 0
            && Number(document.getElementById('device-grid').dataset.used) > 0
            && document.querySelectorAll('#requests tbody tr[data-state="running"]').length > 0""")
        other = show_an_engine_running(page, 2)  # a request to hover beside another one's blocks
        points = int(page.get_attribute("#chart", "data-points"))  # the chart restarts with each engine shown
        reading = None
        for _ in range(40):  # a request may end between the hover and the reading, or run alone: next snapshot
            rows = page.locator('#requests tbody tr[data-state="running"]')  # re-found: the list is redrawn
            if rows.count():
                try:
                    rows.first.hover(timeout=2000)
                except sync_api.Error:  # that request ended meanwhile
                    continue
                reading = page.evaluate(HIGHLIGHT_JS)
            if reading and reading["others"]:
                break
            next_snapshot(page)
        assert reading and reading["others"], "no running request stayed long enough beside another to hover it"
        assert reading["highlighted"] == ",".join(map(str, reading["blocks"])) and reading["blocks"]
        assert reading["row"] == "hover"
        assert all(near(rgb, INK_RGB, 40) for rgb in reading["mine"])  # outlined
        assert all(min(rgb) > 120 for rgb in reading["others"])  # the others dimmed
        os.makedirs(ARTIFACTS, exist_ok=True)
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard.png"), full_page=True)
        page.mouse.move(0, 0)
        page.wait_for_function("document.getElementById('device-grid').dataset.highlighted === ''")
        page.wait_for_function(f"Number(document.getElementById('chart').dataset.points) > {points}")
        show_engine(page, other)
        page.wait_for_function(f"{RUNNING} > 0")
    assert load.completed > 0

    # Idle again: nothing running, and the finished requests' prompt blocks stay cached (drawn light blue).
    for engine in ("w1", "w0"):
        show_engine(page, engine)
        page.wait_for_function(f"{RUNNING} === 0 && document.getElementById('device-grid').dataset.used === '0'")
        assert int(counter(page, "cached")) == int(page.get_attribute("#device-grid", "data-cached")) > 0
        cached = page.evaluate("window.kvDashboard.snapshot.device.state.findIndex((s) => s === 1)")
        assert near(page.evaluate(PIXEL_JS, ["device-grid", cached, False]), CACHED_RGB)
        assert float(counter(page, "hit-rate").rstrip("%")) > 0


def test_the_key_can_come_in_the_url_fragment(stack, page) -> None:
    """#key=... is never sent to the server; the page keeps it for the tab and drops it from the address bar."""
    page.goto(f"{stack.url}/dashboard#key={API_KEY}")
    page.wait_for_function("Boolean(window.kvDashboard?.snapshot)")
    assert page.is_hidden("#key-form") and "#" not in page.url
    page.goto(f"{stack.url}/dashboard")  # the same tab: sessionStorage still has it
    page.wait_for_function("Boolean(window.kvDashboard?.snapshot)")
    assert page.is_hidden("#key-form")
