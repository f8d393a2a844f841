"""The playground page at `/`, driven in a real headless browser (Debian's chromium and chromedriver through
selenium) against a live server: streaming, Stop freeing the request on the server, the engine charts, and
the API key's 401 shown in the page. Plain HTTP checks cover --no-ui and --root-path.

Set ASERVE_SCREENSHOTS=/some/folder to keep PNGs of the page (mid-stream, and the engine panel).
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
from pathlib import Path

import httpx
import pytest

from conftest import wait_idle
from server_util import RunningServer

KEY = "playground-key"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SHOTS = os.environ.get("ASERVE_SCREENSHOTS")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The playground's server and one with --no-ui, started at once: start-up is most of this module's time.
    A small KV cache, so that one long reply shows on the usage chart, in float32 whatever the CPU (with `auto`
    the same bytes hold twice the tokens where bf16 is native); --root-path as behind a prefix-stripping proxy,
    which forwards /llm/ as /; a LoRA adapter of the embedded model for the model picker."""
    import torch

    from aserve.bench.lora_bench import write_random_adapter

    adapter = write_random_adapter(tmp_path_factory.mktemp("playground") / "verse", {"q_proj": (288, 288)},
                                   num_layers=6, rank=4, seed=0, dtype=torch.float32)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(RunningServer, *args) for args in
                  (("--api-key", KEY, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--root-path", "/llm",
                    "--enable-lora", "--lora-modules", f"verse={adapter}"),
                   ("--no-ui",))]
    started = [f.result() for f in starts if f.exception() is None]
    try:
        for f in starts:
            if f.exception() is not None:
                raise f.exception()
        yield started
    finally:
        for srv in started:  # both shut down at once too
            srv.proc.terminate()
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromedriver not installed (the README's test command installs Debian's "
                    "chromium and chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (the test extra has it)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def wait(driver, condition, timeout=30.0, message=""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(), message)


def open_page(driver, server, key: str):
    """Load the page in a fresh tab state and type the key (the field commits on blur, as a person leaves it)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{server.url}/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{server.url}/")
    driver.find_element(By.ID, "api-key").send_keys(key, Keys.TAB)
    return lambda id: driver.find_element(By.ID, id)


def chart(el) -> tuple[int, float]:
    return int(el.get_attribute("data-points")), float(el.get_attribute("data-max") or 0)


def screenshot(target, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        path = str(Path(SHOTS) / name)
        target.save_screenshot(path) if hasattr(target, "save_screenshot") else target.screenshot(path)


def test_chat_streams_stop_frees_the_request_and_charts_update(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = open_page(browser, server, KEY)
    wait(browser, lambda: el("model-name").text == "aserve-default", message="the model name (GET v1/models)")
    assert el("error").get_attribute("hidden") is not None
    assert browser.execute_script("return sessionStorage.getItem('aserve.apiKey')") == KEY
    assert browser.execute_script("return localStorage.length") == 0

    el("prompt").send_keys("a", Keys.SHIFT, Keys.ENTER, Keys.NULL, "b")  # Shift+Enter: a new line, nothing sent
    assert el("prompt").get_attribute("value") == "a\nb" and not browser.find_elements(By.CSS_SELECTOR, ".message")
    el("prompt").clear()

    el("system").send_keys("Answer in verse.")
    for field, value in (("max_tokens", "1900"), ("seed", "7")):
        el(field).clear()
        el(field).send_keys(value)
    el("ignore_eos").click()  # so the reply is still streaming when Stop is pressed
    el("logprobs").click()
    el("prompt").send_keys("Good morrow, who goes there?", Keys.ENTER)

    reply = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant .text"),
                 timeout=60, message="an assistant reply")[0]
    first = wait(browser, lambda: len(reply.text) >= 20 and len(reply.text), timeout=60, message="streamed text")
    wait(browser, lambda: len(reply.text) > first, message="more streamed text")
    assert browser.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute("data-finish") is None
    assert el("stop").is_enabled() and not el("send").is_enabled()
    token = browser.find_element(By.CSS_SELECTOR, ".message.assistant .token")  # logprobs: hover shows them
    assert "logprob" in token.get_attribute("title")
    wait(browser, lambda: chart(el("chart-tokens"))[1] > 0 and chart(el("chart-requests"))[1] >= 1,
         message="the charts to see the request")
    screenshot(browser, "chat-mid-stream.png")

    el("stop").click()
    message = browser.find_element(By.CSS_SELECTOR, ".message.assistant")
    wait(browser, lambda: message.get_attribute("data-finish") == "stopped", timeout=10, message="stopped")
    stats = message.find_element(By.CSS_SELECTOR, ".stats").text
    assert "tokens ·" in stats and "TTFT" in stats and "tokens/s" in stats and "finish: stopped" in stats, stats
    assert el("send").is_enabled() and not el("stop").is_enabled()

    wait_idle(server.url, KEY)  # the closed connection aborted the request: its blocks are free again

    points = chart(el("chart-kv"))[0]  # the panel keeps sampling, and sees the engine idle
    wait(browser, lambda: chart(el("chart-kv"))[0] >= points + 2, timeout=10, message="new samples")
    wait(browser, lambda: "running 0" in el("chart-requests").text, timeout=10, message="running back to 0")
    assert chart(el("chart-kv"))[1] > 0  # the reply's blocks showed while it ran
    screenshot(el("engine"), "engine-panel.png")


def test_a_wrong_api_key_shows_the_servers_401_message(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = open_page(browser, server, "not-the-key")
    wait(browser, lambda: "401: Incorrect or missing API key" in el("error").text, timeout=10,
         message="the 401 message after typing the key")
    el("prompt").send_keys("hello", Keys.ENTER)
    message = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-finish]"),
                   timeout=10, message="the failed reply")[0]
    assert message.get_attribute("data-finish") == "error"
    assert "401: Incorrect or missing API key" in el("error").text and el("error").is_displayed()


def test_completion_mode_n_samples_and_a_json_schema(server, browser):
    import json

    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = open_page(browser, server, KEY)
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=completion]").click()
    assert not el("system").is_displayed()  # no system prompt for a plain completion
    for field, value in (("n", "2"), ("max_tokens", "8"), ("seed", "3")):
        el(field).clear()
        el(field).send_keys(value)
    el("prompt").send_keys("ROMEO:", Keys.ENTER)
    done = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".message.completion[data-finish]"),
                message="the completion")[0]
    assert done.get_attribute("data-finish") == "length, length"
    assert len(done.find_elements(By.CSS_SELECTOR, ".text")) == 2 and "16 tokens" in done.text

    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=chat]").click()
    el("n").clear()
    el("n").send_keys("1")
    el("max_tokens").clear()
    el("max_tokens").send_keys("40")
    el("schema").send_keys('{"type": "object"')  # not JSON yet: said so, and nothing is sent
    el("prompt").send_keys("Who are you?", Keys.ENTER)
    assert el("error").text.startswith("JSON schema:") and not browser.find_elements(By.CSS_SELECTOR, ".message")
    el("schema").send_keys(', "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}')
    el("prompt").send_keys(Keys.ENTER)
    done = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-finish]"),
                message="the structured reply")[0]
    assert done.get_attribute("data-finish") == "stop"
    assert set(json.loads(done.find_element(By.CSS_SELECTOR, ".text").text)) == {"name"}


def test_the_model_picker_lists_lora_adapters_and_sends_the_choice(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    el = open_page(browser, server, KEY)
    wait(browser, lambda: el("model").is_displayed(), message="the model picker (the server has an adapter)")
    picker = Select(el("model"))
    assert [o.text for o in picker.options] == ["aserve-default", "verse (LoRA)"]
    assert picker.first_selected_option.get_attribute("value") == "aserve-default"
    picker.select_by_value("verse")
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=completion]").click()
    el("max_tokens").clear()
    el("max_tokens").send_keys("4")
    el("prompt").send_keys("ROMEO:", Keys.ENTER)
    wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".message.completion[data-finish]"),
         message="the completion under the adapter")

    def served_by_verse() -> float:
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("aserve:lora_requests_total{") and 'lora_name="verse"' in line)
    wait(browser, lambda: served_by_verse() >= 1, message="a request counted under the adapter")


def test_page_is_served_under_root_path_with_relative_urls(server):
    page = httpx.get(f"{server.url}/")  # what a proxy that strips /llm forwards; no key needed for the page
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="ui/app.js"' in page.text and 'href="ui/style.css"' in page.text
    script = httpx.get(f"{server.url}/ui/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert '"/' not in script.text and '"v1/chat/completions"' in script.text  # every URL relative to the page
    assert httpx.get(f"{server.url}/ui/style.css").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the API stays guarded


def test_no_ui_answers_404_at_root(servers):
    bare = servers[1]
    for path in ("/", "/ui/app.js"):
        response = httpx.get(f"{bare.url}{path}")
        assert response.status_code == 404 and "error" in response.json(), path
    assert httpx.get(f"{bare.url}/v1/models").status_code == 200
