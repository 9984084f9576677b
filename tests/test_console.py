"""The console (/console on the reader) in a real headless Chromium driven by selenium, against
a real ingester + reader with auth on (a static token, one private prefix): the page lists
buckets and streams (private ones only with the token), opens a stream, shows its metadata and
tails it live (EventSource without a token, fetch streaming with one), and shows appends made
after it opened, escaped. A page served from another origin reads a stream with fetch and
EventSource through CORS and sees Stream-Next-Offset. With DS3_UPDATE_SCREENSHOTS=1 it saves
the README's screenshots, docs/img/console-*.png.

Needs Debian's `chromium` and `chromium-driver` (scripts/test installs them with apt when run as
root). Without them the tests skip, except under CI=true, where they fail."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.cluster import Cluster, StoreView
from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
# The README's screenshots: refreshed only on request, so a test run leaves the checkout as it was.
IMG = ROOT / "docs" / "img" if os.environ.get("DS3_UPDATE_SCREENSHOTS") == "1" else None
TOKEN = "console-test-token-7f3a9c1e5b2d"
TOKENS = json.dumps([{"token": TOKEN, "sub": "console-test", "read": ["*"], "write": ["*"]}])
AUTH_ARGS = ["--tokens", TOKENS, "--private", "stream:private/", "--internal-token", "internal-console-test-0123456789"]
OFFSET_RE = re.compile(r"^\d{16}_\d{16}$")
WAIT = 20.0


# ---------------------------------------------------------------- chromium
def _binary(names: tuple[str, ...], paths: tuple[str, ...]) -> str | None:
    for n in names:
        found = shutil.which(n)
        if found:
            return found
    return next((p for p in paths if os.access(p, os.X_OK)), None)


def chromium_binaries() -> tuple[str, str]:
    browser = _binary(("chromium", "chromium-browser"), ("/usr/bin/chromium", "/usr/lib/chromium/chromium"))
    driver = _binary(("chromedriver",), ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"))
    if browser is None or driver is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium / chromium-driver are not installed, and CI=true: scripts/test installs them "
                        "(apt) when run as root")
        pytest.skip("chromium / chromium-driver are not installed (scripts/test installs them with apt as root)")
    return browser, driver


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    browser, chromedriver = chromium_binaries()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,900", "--no-first-run", "--disable-extensions",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(executable_path=chromedriver), options=opts)
    d.set_page_load_timeout(WAIT)
    try:
        yield d
    finally:
        d.quit()


def wait_until(d: Any, what: str, pred: Callable[[Any], Any], timeout: float = WAIT) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, timeout, poll_frequency=0.1).until(pred)
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; page text:\n"
                             f"{d.find_element('tag name', 'body').text[:3000]}") from None


def text_of(d: Any, css: str) -> str:
    found = d.find_elements("css selector", css)
    return "\n".join(e.text for e in found)


# ---------------------------------------------------------------- the servers
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("console")
    c = Cluster(work, StoreView.local(work / "objects"), ingester_args=AUTH_ARGS, reader_args=AUTH_ARGS)
    with c:
        yield c


def call(base: str, method: str, path: str, body: bytes | None = None, content_type: str | None = None,
         token: str | None = TOKEN) -> tuple[int, dict[str, str], bytes]:
    headers = {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def must(status: tuple[int, dict[str, str], bytes], *ok: int) -> dict[str, str]:
    assert status[0] in ok, f"HTTP {status[0]}: {status[2][:300]!r}"
    return status[1]


# ---------------------------------------------------------------- tests
def test_console_lists_opens_and_tails_streams(driver: Any, cluster: Cluster) -> None:
    from selenium.webdriver.common.by import By

    r = cluster.reader.url
    must(call(r, "PUT", "/v1/stream/demo/chat", content_type="text/plain"), 201)
    must(call(r, "POST", "/v1/stream/demo/chat", b"first message", "text/plain"), 204)
    must(call(r, "PUT", "/v1/stream/demo/bytes", content_type="application/octet-stream"), 201)
    must(call(r, "POST", "/v1/stream/demo/bytes", b"\x00\x01hi", "application/octet-stream"), 204)
    must(call(r, "PUT", "/v1/stream/private/secret", content_type="text/plain"), 201)
    must(call(r, "POST", "/v1/stream/private/secret", b"top secret", "text/plain"), 204)
    must(call(r, "PUT", "/v1/buckets/agents"), 201)
    must(call(r, "PUT", "/v1/buckets/agents/user-1", content_type="application/json"), 201)
    must(call(r, "POST", "/v1/buckets/agents/user-1", b'[{"n":1},{"n":2}]', "application/json"), 204)

    driver.get(f"{r}/console")  # redirected to /console/
    chat = 'button[data-url="/v1/stream/demo/chat"]'
    wait_until(driver, "the stream list", lambda d: d.find_elements(By.CSS_SELECTOR, chat))
    assert driver.current_url.endswith("/console/")
    # Without a token the private stream is not listed (the listing applies the read rules).
    assert not driver.find_elements(By.CSS_SELECTOR, 'button[data-url="/v1/stream/private/secret"]')
    assert "agents" in text_of(driver, "#bucket-list")
    assert "no token" in text_of(driver, "#token-state")

    driver.find_element(By.CSS_SELECTOR, chat).click()
    wait_until(driver, "the metadata", lambda d: text_of(d, "#meta-content-type") == "text/plain")
    head = must(call(r, "HEAD", "/v1/stream/demo/chat", token=None), 200)
    assert text_of(driver, "#meta-next-offset") == head["Stream-Next-Offset"]
    assert text_of(driver, "#meta-closed") == "false"
    wait_until(driver, "the history", lambda d: "first message" in text_of(d, "#log li"))
    wait_until(driver, "the live tail", lambda d: "live (EventSource)" in text_of(d, "#live-state"))

    # An append made after the page opened shows up, as text (never as markup).
    hostile = 'appended later <img src=x onerror="document.title=1"><script>document.title=2</script>'
    must(call(r, "POST", "/v1/stream/demo/chat", hostile.encode(), "text/plain"), 204)
    wait_until(driver, "the live append", lambda d: hostile in text_of(d, "#log li"))
    assert not driver.find_elements(By.CSS_SELECTOR, "#log img, #log script")
    assert driver.title == "ds3 console"
    final = must(call(r, "HEAD", "/v1/stream/demo/chat", token=None), 200)["Stream-Next-Offset"]
    wait_until(driver, "the live offset", lambda d: text_of(d, "#live-offset") == final)
    # metrics: whatever /metrics calls them, some highlights are found and every ds3_* family is listed
    wait_until(driver, "the metrics", lambda d: d.find_elements(By.CSS_SELECTOR, "#metrics-all tr") and any(
        re.fullmatch(r"\d+(\.\d+)?", td.text) for td in d.find_elements(By.CSS_SELECTOR, "#metrics-highlights td")))
    if IMG is not None:
        driver.save_screenshot(str(IMG / "console-stream.png"))

    # A binary stream arrives base64-encoded and is shown as bytes.
    driver.find_element(By.CSS_SELECTOR, 'button[data-url="/v1/stream/demo/bytes"]').click()
    wait_until(driver, "the binary message", lambda d: "4 bytes: 00 01 68 69" in text_of(d, "#log li"))

    # A bucket's streams; a JSON stream's messages one per line.
    driver.find_element(By.CSS_SELECTOR, 'button[data-bucket="agents"]').click()
    user = 'button[data-url="/v1/buckets/agents/user-1"]'
    wait_until(driver, "the bucket's streams", lambda d: d.find_elements(By.CSS_SELECTOR, user))
    driver.find_element(By.CSS_SELECTOR, user).click()
    wait_until(driver, "the JSON messages", lambda d: text_of(d, "#log li") == '{"n":1}\n{"n":2}')

    # With the token: the private stream is listed and tailed (fetch streaming: EventSource
    # cannot send Authorization), live appends included.
    driver.find_element(By.CSS_SELECTOR, 'button[data-bucket=""]').click()
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "token-save").click()
    secret = 'button[data-url="/v1/stream/private/secret"]'
    wait_until(driver, "the private stream", lambda d: d.find_elements(By.CSS_SELECTOR, secret))
    assert "token set" in text_of(driver, "#token-state")
    assert TOKEN not in driver.page_source
    driver.find_element(By.CSS_SELECTOR, secret).click()
    wait_until(driver, "the private history", lambda d: "top secret" in text_of(d, "#log li"))
    wait_until(driver, "the fetch tail", lambda d: "live (fetch, with token)" in text_of(d, "#live-state"))
    must(call(r, "POST", "/v1/stream/private/secret", b"second secret", "text/plain"), 204)
    wait_until(driver, "the private live append", lambda d: "second secret" in text_of(d, "#log li"))
    if IMG is not None:
        driver.save_screenshot(str(IMG / "console-token.png"))

    # Forgetting the token hides the private stream again.
    driver.find_element(By.ID, "token-clear").click()
    wait_until(driver, "the private stream to go",
               lambda d: d.find_elements(By.CSS_SELECTOR, chat) and not d.find_elements(By.CSS_SELECTOR, secret))


CORS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>cors</title></head><body>
<p>next offset: <span id="next-offset"></span></p>
<p>body: <span id="body"></span></p>
<p>sse data: <span id="sse-data"></span></p>
<p>sse control offset: <span id="sse-offset"></span></p>
<p>post: <span id="post"></span></p>
<p>error: <span id="error"></span></p>
<script>
const q = new URLSearchParams(location.search);
const reader = q.get('reader');
const url = reader + '/v1/stream/cors/demo';
const show = (id, text) => { document.getElementById(id).textContent = text; };
(async () => {
  try {
    const r = await fetch(url + '?offset=-1');
    show('next-offset', r.headers.get('Stream-Next-Offset'));
    show('body', await r.text());
    const es = new EventSource(url + '?offset=-1&live=sse');
    es.addEventListener('data', (e) => { document.getElementById('sse-data').textContent += e.data; });
    es.addEventListener('control', (e) => show('sse-offset', JSON.parse(e.data).streamNextOffset));
    // a write that needs a preflight (Authorization, Producer-*) and reads exposed headers
    const p = await fetch(url, { method: 'POST', body: 'from the other origin', headers: {
      'Content-Type': 'text/plain', 'Authorization': 'Bearer ' + q.get('token'),
      'Producer-Id': 'cors-page', 'Producer-Epoch': '0', 'Producer-Seq': '0' } });
    show('post', p.status + ' epoch=' + p.headers.get('Producer-Epoch') + ' next=' + p.headers.get('Stream-Next-Offset'));
  } catch (e) { show('error', String(e)); }
})();
</script></body></html>
"""


class OtherOrigin:
    """A tiny aiohttp server on another port (so another origin) serving CORS_PAGE."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None

    async def _start(self) -> None:
        async def page(_request: web.Request) -> web.Response:
            return web.Response(text=CORS_PAGE, content_type="text/html")

        app = web.Application()
        app.router.add_get("/cors.html", page)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> OtherOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_cors_fetch_and_eventsource_from_another_origin(driver: Any, cluster: Cluster) -> None:
    r = cluster.reader.url
    must(call(r, "PUT", "/v1/stream/cors/demo", content_type="text/plain"), 201)
    must(call(r, "POST", "/v1/stream/cors/demo", b"cross-origin hello", "text/plain"), 204)
    offset = must(call(r, "HEAD", "/v1/stream/cors/demo", token=None), 200)["Stream-Next-Offset"]
    with OtherOrigin() as other:
        driver.get(f"http://127.0.0.1:{other.port}/cors.html?reader={r}&token={TOKEN}")
        wait_until(driver, "the POST", lambda d: text_of(d, "#post") or text_of(d, "#error"))
        assert text_of(driver, "#error") == ""
        assert text_of(driver, "#next-offset") == offset  # an exposed header, read cross-origin
        assert OFFSET_RE.match(offset)
        assert text_of(driver, "#body") == "cross-origin hello"
        wait_until(driver, "the SSE data", lambda d: "cross-origin hello" in text_of(d, "#sse-data"))
        after = must(call(r, "HEAD", "/v1/stream/cors/demo", token=None), 200)["Stream-Next-Offset"]
        assert text_of(driver, "#post") == f"200 epoch=0 next={after}"
        # the page's own append reaches its EventSource too, with its control offset
        wait_until(driver, "the appended SSE data",
                   lambda d: "from the other origin" in text_of(d, "#sse-data") and text_of(d, "#sse-offset") == after)
        driver.get("about:blank")  # closes the EventSource before the server goes
