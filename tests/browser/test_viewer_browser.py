"""The viewer in a real headless browser: Debian's chromium driven by Playwright's Python
package (never `playwright install`; scripts/setup.sh installs chromium with apt).

Against a gateway serving a store written by its own writer (over a fake replica): the page
loads, a session recorded during the test appears within 2 s without a reload, the sampled
tokens' colours are those of their stored logprobs and weight versions, and filtering works.
Screenshots go to the test's tmp dir; LOCKGATE_UPDATE_SCREENSHOT=1 also writes docs/viewer.png.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lockgate.gateway.api.app import create_app
from lockgate.gateway.config import GatewayConfig
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica
from tests.support.threaded_server import serve_in_thread
from tests.support.viewer_fixtures import Built, build_store

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DOCS_PNG = Path(__file__).resolve().parents[2] / "docs" / "viewer.png"

playwright_sync = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():  # scripts/setup.sh installs it on Debian
    pytest.skip(f"no {CHROMIUM} (apt-get install -y chromium)", allow_module_level=True)


def _hsl_rgb(h: float, s: float, lum: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hls_to_rgb(h / 360, lum, s)
    return round(r * 255), round(g * 255), round(b * 255)


def logprob_rgb(lp: float) -> tuple[int, int, int]:
    p = min(1.0, max(0.0, math.exp(lp)))
    return _hsl_rgb(round(120 * p, 1), 0.75, 0.80)


def version_rgb(v: int) -> tuple[int, int, int]:
    if v < 0:
        return _hsl_rgb(0, 0, 0.85)
    return _hsl_rgb(round((v * 137.508) % 360, 1), 0.65, 0.78)


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(x) for x in re.findall(r"\d+", css)[:3])
    return r, g, b


def _close(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return all(abs(x - y) <= 2 for x, y in zip(a, b, strict=True))


class Gateway:
    def __init__(self, port: int, built: Built) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.built = built
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN}"})

    def calls(self, sid: str) -> list[dict[str, Any]]:
        return self.http.get(f"/admin/sessions/{sid}/calls").json()["calls"]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    run = tmp_path_factory.mktemp("viewer-run")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    built = build_store(
        run / "trajectories.sqlite",
        groups=2,
        tokenize=lambda text: tok.encode(text, add_special_tokens=False),
    )
    records = [
        {"step": s, "reward/mean": 0.2 + 0.05 * s, "reward/min": 0.0, "reward/max": 1.0,
         "staleness/hist": {"0": 100 - 7 * s, "1": 7 * s}, "staleness/mean": 0.1 * s,
         "staleness/max": 1, "perf/gen_tokens_per_s": 300 + 20 * s, "time/step_s": 10.0,
         "time/train_s": 7.0 + 0.2 * s, "sync/pause_latency_s": 0.02, "sync/load_s": 0.3,
         "sync/resume_s": 0.01, "sync/stage_s": 0.5, "sync/interrupted": float(s % 3),
         "count/groups_dropped/stale": s // 2,
         **({"val/version": float(s - 1), "val/reward_mean": 0.3 + 0.04 * s} if s % 3 == 1 else {})}
        for s in range(1, 13)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    completion = tok.encode("hello there, the answer is 51", add_special_tokens=False)
    replica = FakeReplica(completion=[*completion, tok.convert_tokens_to_ids("<|im_end|>")])
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(replica.handler))
    app = create_app(
        GatewayConfig(
            model_dir=tiny_model_dir,
            replicas=[REPLICA],
            db_path=run / "trajectories.sqlite",
            metrics_path=run / "metrics.jsonl",
            admin_token=ADMIN,
            max_model_len=256,
        ),
        http=upstream,
    )
    with serve_in_thread(app) as port:
        gw = Gateway(port, built)
        yield gw
        gw.http.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, gateway: Gateway) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1500, "height": 950})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    p.goto(f"{gateway.url}/ui/?token={ADMIN}")
    p.wait_for_selector("body[data-ready='1']", timeout=10_000)
    assert p.url.endswith("/ui/")  # the token left the address bar for a cookie
    yield p
    context.close()
    assert errors == []


def test_the_page_needs_the_token(browser: Any, gateway: Gateway) -> None:
    context = browser.new_context()
    p = context.new_page()
    response = p.goto(f"{gateway.url}/ui/")
    assert response.status == 401
    p.fill("input[name=token]", ADMIN)
    p.click("button")
    p.wait_for_selector("body[data-ready='1']", timeout=10_000)
    context.close()


def test_a_session_recorded_now_appears_within_2s_with_its_token_colours(
    page: Any, gateway: Gateway, tmp_path: Path
) -> None:
    rows = page.locator("#sessions tbody tr")
    assert rows.count() == len(gateway.built.sessions)
    page.screenshot(path=str(tmp_path / "sessions.png"))

    started = time.monotonic()
    created = gateway.http.post("/admin/sessions", json={"task_id": "live-task", "group_id": "gl"})
    sid = created.json()["session_id"]
    answer = gateway.http.post(
        f"{created.json()['base_url']}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "17*3?"}]},
    )
    assert answer.status_code == 200
    page.wait_for_selector(f"#sessions tbody tr[data-id='{sid}']", timeout=2_000)
    appeared = time.monotonic() - started
    assert appeared < 2.0
    # Its call's row shows up-to-date stats once the feed has seen the call.
    page.wait_for_function(
        f"document.querySelector(\"tr[data-id='{sid}']\").children[5].textContent === '1'",
        timeout=2_000,
    )
    page.click(f"#sessions tbody tr[data-id='{sid}']")
    page.wait_for_selector(".toks .t.s")
    (stored,) = gateway.calls(sid)
    spans = page.locator(".toks .t.s")
    assert spans.count() == len(stored["completion_ids"])
    for i in range(spans.count()):
        el = spans.nth(i)
        assert int(el.get_attribute("data-id")) == stored["completion_ids"][i]
        assert float(el.get_attribute("data-lp")) == stored["logprobs"][i]
        colour = _rgb(el.evaluate("e => getComputedStyle(e).backgroundColor"))
        assert _close(colour, logprob_rgb(stored["logprobs"][i])), (i, colour)
    prompt = page.locator(".toks .t.p")
    assert prompt.count() == len(stored["prompt_ids"])
    spans.nth(0).hover()
    tip = page.locator("#tip")
    assert f"id {stored['completion_ids'][0]}" in tip.inner_text()
    assert f"logprob {stored['logprobs'][0]:.4f}" in tip.inner_text()
    page.screenshot(path=str(tmp_path / "live-session.png"))


def test_a_synced_session_colours_tokens_by_version_and_marks_the_cut(
    page: Any, gateway: Gateway, tmp_path: Path
) -> None:
    sid = sorted(gateway.built.ids(kind="cut"))[0]
    page.click(f"#sessions tbody tr[data-id='{sid}']")
    page.wait_for_selector(".toks .t.s")
    stored = gateway.calls(sid)
    page.select_option("#colour", "version")
    spans = page.locator(".toks .t.s")
    versions = [
        v for call in stored for v in _token_versions(call["versions"], len(call["completion_ids"]))
    ]
    assert spans.count() == len(versions) and set(versions) == {0, 1}
    for i, v in enumerate(versions):
        el = spans.nth(i)
        assert int(el.get_attribute("data-v")) == v
        colour = _rgb(el.evaluate("e => getComputedStyle(e).backgroundColor"))
        assert _close(colour, version_rgb(v)), (i, v, colour)
    assert page.locator(".cutmark").count() == 1
    assert page.locator(".flag.cut").count() == 1
    assert "tool result" in page.locator(".msg.tool").first.inner_text()
    assert page.locator("table.group tbody tr").count() == 4
    spans.nth(len(versions) - 1).hover()
    page.screenshot(path=str(tmp_path / "session-versions.png"))
    if os.environ.get("LOCKGATE_UPDATE_SCREENSHOT") == "1":
        shutil.copy(tmp_path / "session-versions.png", DOCS_PNG)


def _token_versions(spans: list[dict[str, int]], n: int) -> list[int]:
    out = [-1] * n
    for s in spans:
        out[s["start"] : s["end"]] = [s["version"]] * (s["end"] - s["start"])
    return out


def test_filtering_narrows_the_list(page: Any, gateway: Gateway) -> None:
    built = gateway.built
    page.fill("input[name=task]", "search-2")
    page.select_option("select[name=interrupted]", "true")
    page.click("#filters button[type=submit]")
    want = built.ids(task="search-2", interrupted=True)
    page.wait_for_function(
        f"document.querySelectorAll('#sessions tbody tr').length === {len(want)}", timeout=5_000
    )
    shown = page.eval_on_selector_all("#sessions tbody tr", "rs => rs.map(r => r.dataset.id)")
    assert set(shown) == want
    page.click("#clear")
    page.fill("input[name=reward_min]", "0.5")
    page.click("#filters button[type=submit]")
    want = {s for s, f in built.sessions.items() if (f["reward"] or 0) >= 0.5}
    page.wait_for_function(
        f"document.querySelectorAll('#sessions tbody tr').length === {len(want)}", timeout=5_000
    )
    shown = page.eval_on_selector_all("#sessions tbody tr", "rs => rs.map(r => r.dataset.id)")
    assert set(shown) == want


def test_the_dashboard_draws_the_runs_metrics(page: Any, tmp_path: Path) -> None:
    page.click("#tab-dashboard")
    page.wait_for_selector(".chart svg")
    assert page.locator(".chart").count() == 6
    assert "12" in page.locator("#dash-summary").inner_text()
    assert page.locator(".chart circle").count() > 0
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
