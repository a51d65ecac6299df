"""The chat page at GET /, in a real headless Chromium (the distribution's, driven by Selenium)
against a real daemon: it lists the model and the server's context cap, streams a reply with
its stats, stops a reply mid-stream, renders Markdown safely, asks for the key on a server
that wants one, and keeps to its own origin. A screenshot of each run is kept under
test-artifacts/ (or $MTPLX_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from mtplxd.flight import read_records
from support.api_daemon import MODEL_ID, ApiDaemon, start_api_daemon

ARTIFACTS = Path(os.environ.get("CHAT_PAGE_ARTIFACTS") or Path(__file__).resolve().parents[2] / "test-artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

if not (CHROMIUM and DRIVER):
    # .ci/run installs both from apt; only when apt itself failed does it say why here.
    pytest.skip("the chat page's browser test needs the distribution's chromium and chromium-driver "
                f"(apt-get install -y chromium chromium-driver): "
                f"{os.environ.get('CI_BROWSER_SKIP_REASON') or 'not installed'}", allow_module_level=True)

from selenium import webdriver  # noqa: E402  (only with a browser to drive)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as ready  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    daemon = start_api_daemon(tmp_path_factory.mktemp("chat-home"), MTPLX_MODEL=str(tiny_checkpoint))
    try:
        yield daemon
    finally:
        daemon.stop()


def _wait(driver, seconds: float = 30) -> WebDriverWait:
    return WebDriverWait(driver, seconds, poll_frequency=0.1)


def _send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def test_the_page_streams_a_reply_with_its_stats(browser, served):
    browser.get(served.base_url + "/")
    _wait(browser).until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == MODEL_ID)
    context = browser.find_element(By.ID, "context").text
    assert "this server's cap" in context and "tokens" in context
    _send(browser, "write a function that adds two numbers")
    # No max_tokens from the page: the reply ends when the model samples its end (the tiny
    # model does within a few hundred tokens), so allow a loaded machine minutes.
    stats = _wait(browser, 300).until(
        ready.presence_of_element_located((By.CSS_SELECTOR, ".msg.assistant .stats[data-done='1']")))
    for part in ("tok/s", "accepted", "TTFT", "cache", "prompt tokens"):
        assert part in stats.text, stats.text
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "write a function that adds two numbers"
    assert browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text.strip()
    assert "Powered by MTPLX" in browser.find_element(By.TAG_NAME, "footer").text
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "chat-page.png"))
    # The page's turns are recorded like any agent's, under the page's own session id.
    records = [r for r in read_records(served.home / "metrics") if r.get("outcome") == "completed"]
    assert records and records[-1]["client"]["session_id"].startswith("web-")


def test_stop_ends_a_reply_mid_stream(browser, served):
    browser.get(served.base_url + "/")
    _wait(browser).until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == MODEL_ID)
    # The tiny model samples its end within a few hundred tokens, a tenth of a second: Stop
    # would race the reply's own end. The page sends no max_tokens, so with `ignore_eos` added
    # to its request (the API's field, put in by wrapping the page's fetch) a reply runs to the
    # context cap, seconds long. A reply that still ended on the server just as Stop was
    # pressed (the page says "stopped", the daemon's record "completed") is tried again: only
    # the daemon's record tells the two apart.
    browser.execute_script("""
        const pageFetch = window.fetch;
        window.fetch = (url, init) => {
          if (String(url).endsWith("/v1/chat/completions") && init && init.body) {
            const body = Object.assign(JSON.parse(init.body), { ignore_eos: true });
            init = Object.assign({}, init, { body: JSON.stringify(body) });
          }
          return pageFetch(url, init);
        };""")

    def records() -> list[dict]:
        return list(read_records(served.home / "metrics"))

    for _ in range(3):
        before = len(records())
        browser.find_element(By.ID, "new-chat").click()
        _send(browser, "tell me a very long story")
        _wait(browser).until(lambda d: len(d.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text) > 20
                             or d.find_element(By.ID, "send").is_enabled())
        if browser.find_element(By.ID, "send").is_enabled():
            continue  # it ended by itself
        browser.find_element(By.ID, "stop").click()
        _wait(browser).until(lambda d: d.find_element(By.ID, "send").is_enabled())
        if browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text != "stopped":
            continue
        assert not browser.find_element(By.ID, "stop").is_enabled()
        # The request's record is written when the daemon sees the client leave.
        ended = _wait(browser, 120).until(lambda d: {r.get("outcome") for r in records()[before:]}
                                          & {"disconnected", "completed"})
        if "disconnected" in ended:
            break
    else:
        pytest.fail("three replies in a row ended before Stop could end them")


def test_markdown_renders_code_blocks_and_never_raw_html(browser, served):
    browser.get(served.base_url + "/")
    html = browser.execute_script(
        "return renderMarkdown(arguments[0]);",
        "# Plan\n- **one** and `x<y`\n\n```python\nif a < b:\n    print('<b>')\n```\n<img src=x onerror=alert(1)>")
    assert "<h1>Plan</h1>" in html and "<li><strong>one</strong> and <code>x&lt;y</code></li>" in html
    assert '<pre><code class="language-python">if a &lt; b:\n    print(&#39;&lt;b&gt;&#39;)</code></pre>' in html
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_the_page_keeps_to_its_own_origin(served):
    page = httpx.get(served.base_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
    assert "http" not in page.text.replace("http-equiv", "")  # nothing from another origin
    assert httpx.get(served.base_url + "/ui/chat.js").headers["content-type"].startswith("text/javascript")
    missing = httpx.get(served.base_url + "/ui/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    evil = httpx.post(served.base_url + "/v1/chat/completions", headers={"Origin": "http://evil.example"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert evil.status_code == 403


def test_reasoning_streams_into_a_collapsed_section(browser, tiny_checkpoint, tmp_path):
    # A template that opens <think> for the answer (as Qwen3.6's do): the reply streams as
    # reasoning until the model closes it, which this random tiny model does not.
    thinking = tmp_path / "thinking-model"
    shutil.copytree(tiny_checkpoint, thinking)
    config_file = thinking / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    opener = "{%- if add_generation_prompt %}\n{{- '<|im_start|>assistant\\n"
    assert opener in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(opener, opener + "<think>\\n")
    config_file.write_text(json.dumps(config))
    daemon = start_api_daemon(tmp_path / "home", MTPLX_MODEL=str(thinking))
    try:
        browser.get(daemon.base_url + "/")
        _wait(browser).until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
        _send(browser, "think about it")
        section = _wait(browser).until(ready.visibility_of_element_located(
            (By.CSS_SELECTOR, ".msg.assistant details.reasoning")))
        assert section.get_attribute("open") is None  # folded until the reader opens it
        browser.find_element(By.ID, "stop").click()
        section.find_element(By.TAG_NAME, "summary").click()
        text = section.find_element(By.CSS_SELECTOR, ".text").text
        assert section.get_attribute("open") is not None and text.strip()
    finally:
        daemon.stop()


def test_with_a_key_the_page_asks_for_it(browser, tmp_path):
    home = tmp_path / "keyed"
    key = "mtplx-page-key-123"
    (home / "secrets").mkdir(parents=True, mode=0o700)
    (home / "secrets" / "api_key").write_text(key + "\n")
    os.chmod(home / "secrets" / "api_key", 0o600)
    daemon = start_api_daemon(home, "--host", "0.0.0.0", "--no-model", wait_model=False)
    try:
        assert httpx.get(daemon.base_url + "/").status_code == 200  # the page itself is open
        assert httpx.get(daemon.base_url + "/v1/models").status_code == 401
        browser.get(daemon.base_url + "/")
        form = _wait(browser).until(ready.visibility_of_element_located((By.ID, "key-form")))
        assert "mtplxctl key show" in form.text
        browser.find_element(By.ID, "key").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        _wait(browser).until(lambda d: d.find_element(By.ID, "key-error").text == "that key was refused")
        browser.find_element(By.ID, "key").clear()
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        _wait(browser).until(ready.invisibility_of_element_located((By.ID, "key-form")))
        assert "no model loaded" in browser.find_element(By.ID, "context").text
    finally:
        browser.execute_script("sessionStorage.clear()")
        daemon.stop()
