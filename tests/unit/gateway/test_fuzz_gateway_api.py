"""Fuzzing the gateway's HTTP API with schemathesis (issue 18).

Every agent route and every admin route is fuzzed from an OpenAPI document derived from the
request models the routes validate against (tests/gateway_openapi.py: the app's own
/openapi.json knows none of the bodies), with schema-conforming bodies and with bodies that
break the schema, each with valid credentials, invalid ones and none. The gateway runs under
uvicorn on a loopback port, as in production, over a fake replica that answers from a few
completions chosen by the prompt (text, a tool call, reasoning, characters split across
tokens, random ids), into a real SQLite store. For every case:

- no 5xx, and an answer within `CALL_TIMEOUT_S` (no hang);
- every 4xx (and every error event of a stream) in OpenAI's shape,
  `{"error": {"message", "type", "param", "code"}}`;
- without valid credentials, the admin routes, the session-key routes and the enrolment
  routes (client-driven rollouts: `POST /v1/sessions`, `GET /v1/enrolment`, with the run's
  enrolment key) answer 401, the enrolment key is refused on the admin and session-key routes,
  and a session URL with another session's key is a 401;
- a session enrolled (201) is in the store with its task and group, a session finished by its
  own key has ended, and a refusal for the bound on new groups (429) says when to retry;
- exactly one call recorded for a generation that succeeded, nothing for anything refused,
  and that record whole (a completion id per logprob, versions covering every token);
then, once all cases ran, every session's records in the store are consistent.

Fixture state is neutralised rather than excluded: each case that names an open session gets a
fresh one (a fuzzed `finish` would otherwise end the session every later case uses), and after
each admin case the gateway is put back to serving with only its own replica (a fuzzed pause
would hold every later call; a fuzzed replica URL would take calls that fail over; a fuzzed
enrolment would change the key and the bound: the fixture's is opened again). So here a
weight load (`POST /admin/weights`), which needs a paused gateway, is only ever refused (409),
and a removal never finds the gateway's own replica.

What that leaves out, `test_fuzz_sequences_of_admin_and_agent_calls` does: sequences of calls,
pauses, weight loads, resumes, finished sessions, replicas coming and going and clients
enrolling sessions into groups, on a gateway of their own, with nothing put back in between
(only the documented 5xx allowed; every group whose sessions all ended is complete, once). And
`test_fuzz_paths_and_methods_no_route_serves` sends what no schema describes: unknown paths,
methods a route does not take. The regressions at the end hold what the fuzzing found.

The generated cases per route and auth and the answers' statuses are written to the terminal
at the end of the module (and asserted: no 5xx).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pydantic import BaseModel
from schemathesis import Case, GenerationMode

from lockgate.gateway.api.app import create_app
from lockgate.gateway.api.session_keys import ENROLMENT_KEY_PREFIX
from lockgate.gateway.calls.bodies import MAX_JSON_DEPTH
from lockgate.gateway.config import GatewayConfig
from lockgate.gateway.records.codecs import CALL_COLUMNS, call_from_row
from lockgate.gateway.schema import ChatCompletionRequest, CompletionRequest, CreateSession
from lockgate.trainer.tiny_models.builder import ensure_tiny_model, family_spec
from tests.support.chat_strategies import chat_bodies, completion_bodies
from tests.support.fake_gateway import ADMIN, REPLICA, FakeReplica, sse_chunks
from tests.support.gateway_openapi import (
    FINISHED_SESSION,
    OPEN_SESSION,
    ROUTES,
    Route,
    gateway_openapi,
)
from tests.support.threaded_server import serve_in_thread

# An answer that takes longer than this is a hang: every fake generation is instant, and a
# pause the fuzzer leaves behind is undone before the next case.
CALL_TIMEOUT_S = 15.0
# Cases per route and auth. Generation routes reach the renderer, the parser and the store:
# they get the most. Derandomized: the same cases on every run, so CI is stable.
EXAMPLES_GENERATION = 40
EXAMPLES_OTHER = 12
# Sequences of interleaved admin and agent calls, and the steps in each.
SEQUENCES = 20
STEPS_PER_SEQUENCE = 20
AUTHS = ("valid", "invalid", "none")
ERROR_KEYS = {"message", "type", "param", "code"}
_ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
# Client-driven rollouts: the enrolment every case finds open, and the longest a case's long
# poll for complete groups waits (what it asks for beyond that is pinned down to it).
ENROLMENT_KEY = ENROLMENT_KEY_PREFIX + "fuzz-enrolment-key"
# Few groups admitted, so that enrolling meets the bound (429) as well as full groups (409).
ENROLMENT = {"key": ENROLMENT_KEY, "group_size": 2, "groups_admitted": 6}
ENROLMENT_WAIT_S = 0.05

SCHEMA = schemathesis.openapi.from_dict(gateway_openapi())
_REALISTIC: dict[type[BaseModel] | None, st.SearchStrategy[dict[str, Any]]] = {
    ChatCompletionRequest: chat_bodies(),
    CompletionRequest: completion_bodies(),
    # A few tasks and groups, so that sessions join groups, fill them and meet other tasks'.
    CreateSession: st.fixed_dictionaries(
        {"task_id": st.sampled_from(["t0", "t1"])},
        optional={"group_id": st.sampled_from(["g0", "g1", "g2"])},
    ),
}


class FuzzReplica(FakeReplica):
    """A fake replica whose answer depends on the prompt: one of a few completions that reach
    different parts of the parser and the streamer, the same for the same prompt."""

    answers: list[list[int]]
    vocab: int

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.down or request.url.path != "/inference/v1/generate":
            return super().handler(request)
        body = json.loads(request.content)
        self.requests.append(body)
        prompt: list[int] = body["token_ids"]
        seed = zlib.crc32(json.dumps(prompt).encode())
        pick = seed % (len(self.answers) + 1)
        if pick < len(self.answers):
            completion = self.answers[pick]
        else:
            # What a random-weight model does: any id of the vocabulary, specials included.
            completion = [(seed >> i) % self.vocab for i in range(0, 24, 3)]
        n = min(len(completion), body["sampling_params"]["max_tokens"])
        ids = completion[:n]
        finish = "stop" if n == len(completion) else "length"
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=sse_chunks(ids, [-0.5 - 0.01 * i for i in range(n)], finish),
        )


@dataclass
class Tally:
    cases: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500)


@dataclass
class Served:
    base_url: str
    db_path: Path
    http: requests.Session
    finished: dict[str, str]  # the finished session: id, api_key
    other: dict[str, str]  # an open session whose key is "another session's key"
    tally: Tally

    def admin(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        r = self.http.request(
            method, self.base_url + path, headers=_ADMIN_HEADERS, timeout=CALL_TIMEOUT_S, **kwargs
        )
        assert r.status_code < 300, r.text
        return r

    def new_session(self) -> dict[str, str]:
        return self.admin("POST", "/admin/sessions", json={"task_id": "fuzz"}).json()

    def calls_recorded(self) -> int:
        with sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True) as db:
            return int(db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])

    def restore(self) -> None:
        """Serving again, with the fixture's one replica, whatever an admin case changed."""
        status = self.admin("GET", "/admin/status").json()
        replicas = {r["url"]: r for r in status["replicas"]}
        for url in set(replicas) - {REPLICA}:
            self.admin("DELETE", "/admin/replicas", params={"url": url})
        ours = replicas.get(REPLICA)
        if (
            ours is None
            or ours["stale"]
            or not ours["healthy"]
            or ours["version"] != status["version"]
        ):
            # Taken out, or left holding other weights: back as new, at the version served.
            if ours is not None:
                self.admin("DELETE", "/admin/replicas", params={"url": REPLICA})
            self.admin("POST", "/admin/replicas", json={"url": REPLICA})
        if status["state"] != "serving":
            self.admin("POST", "/admin/resume", json={"version": status["version"]})
        status = self.admin("GET", "/admin/status").json()
        assert status["state"] == "serving", status
        assert [r["url"] for r in status["replicas"]] == [REPLICA], status
        # The fixture's enrolment, fresh, whatever an admin case opened or admitted: opened
        # with another key first, since the same key would reopen it with its groups.
        self.admin("PUT", "/admin/enrolment", json={**ENROLMENT, "key": ENROLMENT_KEY + "-x"})
        self.admin("PUT", "/admin/enrolment", json=ENROLMENT)


@contextlib.contextmanager
def _serve(model_dir: Path, db_path: Path, **config: Any) -> Iterator[Served]:
    """The gateway under uvicorn over a `FuzzReplica`, with a finished and an open session."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    end = [tok.convert_tokens_to_ids(tok.eos_token)]  # what ends a turn in the model's format
    texts = [
        "hello there",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "<think>\nlet me see\n</think>\n\nit is 3",
        "héllo 🎉 日本 the end",  # characters split across byte-level tokens
        '<tool_call>\n{"name": "add", "arguments": not json\n</tool_call>',
    ]
    replica = FuzzReplica(completion=tok.encode("hello there", add_special_tokens=False) + end)
    replica.answers = [tok.encode(t, add_special_tokens=False) + end for t in texts]
    replica.answers.append(tok.encode("cut off without an end", add_special_tokens=False))
    replica.vocab = len(tok)

    def route(req: httpx.Request) -> httpx.Response:
        # Replicas the fuzzer adds exist nowhere: refused, as an unreachable host is.
        if f"{req.url.scheme}://{req.url.host}:{req.url.port}" != REPLICA:
            raise httpx.ConnectError("connection refused", request=req)
        return replica.handler(req)

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(route))
    app = create_app(
        GatewayConfig(
            model_dir=model_dir,
            replicas=[REPLICA],
            db_path=db_path,
            admin_token=ADMIN,
            # Room for a few turns with tools beside a budget (the replica is a fake).
            max_model_len=1024,
            **config,
        ),
        http=upstream,
    )
    try:
        with serve_in_thread(app) as port, requests.Session() as http:
            s = Served(f"http://127.0.0.1:{port}", db_path, http, {}, {}, Tally())
            s.finished = s.new_session()
            s.admin("POST", f"/admin/sessions/{s.finished['session_id']}/finish", json={})
            s.other = s.new_session()
            s.admin("PUT", "/admin/enrolment", json=ENROLMENT)
            yield s
    finally:
        asyncio.run(upstream.aclose())


# Every route fuzzed in three chat formats (issue 42), each on its tiny model: the answers and
# errors must not depend on which format the model speaks.
@pytest.fixture(scope="module", params=["qwen3", "deepseek-r1", "glm-4.5"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Served]:
    model_dir = ensure_tiny_model(spec=family_spec(request.param))
    db_path = tmp_path_factory.mktemp("fuzz") / "store.sqlite"
    with _serve(model_dir, db_path, max_pause_wait_s=2.0, renderer=request.param) as s:
        yield s
    _report(request.config, s.tally)


def _report(config: pytest.Config, tally: Tally) -> None:
    """The cases per route and auth, and the statuses they got, on the terminal."""
    if tally.cases:
        _write_line(config, *_report_lines(tally))


def _write_line(config: pytest.Config, *lines: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    # Written past pytest's capture: the counts are the point of the run (issue 18).
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


def _report_lines(tally: Tally) -> list[str]:
    lines = [
        "schemathesis fuzzing of the gateway: generated cases per route",
        f"{'route':<52} {'valid':>6} {'invalid':>8} {'none':>6}  statuses",
    ]
    for route in ROUTES:
        counts = [tally.cases[(route.label, auth)] for auth in AUTHS]
        statuses = sorted(
            (s, n) for (label, s), n in tally.statuses.items() if label == route.label
        )
        lines.append(
            f"{route.label:<52} {counts[0]:>6} {counts[1]:>8} {counts[2]:>6}  "
            + ", ".join(f"{s}: {n}" for s, n in statuses)
        )
    total = sum(tally.cases.values())
    lines.append(f"{total} cases in all; 5xx answers: {tally.server_errors()}")
    return lines


def _credentials(served: Served, route: Route) -> list[str]:
    """Invalid credentials for the route (one is drawn per case). The enrolment key is one on
    the admin and session-key routes: it creates sessions and is no admin's or session's key."""
    if route.auth == "admin":
        return [
            "Bearer not-the-admin-token",
            f"Bearer {served.other['api_key']}",
            f"Basic {ADMIN}",
            f"Bearer {ADMIN}x",
            "Bearer ",
            f"Bearer {ENROLMENT_KEY}",
        ]
    if route.auth == "session_key":
        return [
            "Bearer lg-sk-not-a-key",
            f"Bearer {ADMIN}",
            f"Basic {served.other['api_key']}",
            f"Bearer {served.other['api_key']}x",
            f"Bearer {ENROLMENT_KEY}",
        ]
    if route.auth == "session_path":
        # The session in the URL is the capability; only another session's key is refused
        # (a case's session is a fresh one or the finished one, never `other`). Any other
        # bearer, the enrolment key too, is an SDK's placeholder key there, ignored.
        return [f"Bearer {served.other['api_key']}", "Bearer lg-sk-forged"]
    if route.auth == "enrolment":
        return [
            f"Bearer {ENROLMENT_KEY_PREFIX}forged-enrolment-key",
            f"Bearer {served.other['api_key']}",
            f"Basic {ENROLMENT_KEY}",
            f"Bearer {ENROLMENT_KEY}x",
            "Bearer ",
        ]
    return ["Bearer nope"]


def _strategy(route: Route) -> st.SearchStrategy[Case]:
    operation = SCHEMA[route.path][route.method]
    positive = operation.as_strategy(GenerationMode.POSITIVE)
    has_input = route.body is not None or route.query or "{session_id}" in route.path
    if not has_input:
        return positive  # nothing to generate but the one request, and nothing to break
    negative = operation.as_strategy(GenerationMode.NEGATIVE)
    if route.body not in _REALISTIC:
        return st.one_of(positive, negative)
    # Schema-valid bodies seldom get past the gateway's checks to the renderer and the
    # store: a third of the cases are conversations an agent could really send.
    by_path = "{session_id}" in route.path
    realistic = _REALISTIC[route.body].map(
        lambda body: operation.Case(
            path_parameters={"session_id": OPEN_SESSION} if by_path else None,
            body=body,
            media_type="application/json",
        )
    )
    return st.one_of(positive, negative, realistic)


def _assert_openai_error(body: Any, where: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, (
        f"{where}: not OpenAI's shape: {body!r}"
    )
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"{where}: {error!r}"
    assert isinstance(error["message"], str) and error["message"], f"{where}: {error!r}"
    assert isinstance(error["type"], str) and error["type"], f"{where}: {error!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{where}: {error!r}"
    assert error["code"] is None or isinstance(error["code"], str), f"{where}: {error!r}"


RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def _assert_whole_record(call: dict[str, Any], where: str) -> None:
    n = len(call["completion_ids"])
    assert len(call["logprobs"]) == n, f"{where}: {n} tokens, {len(call['logprobs'])} logprobs"
    assert call["prompt_ids"], f"{where}: a call recorded without its prompt"
    assert call["finish_reason"] in ("stop", "length"), f"{where}: {call['finish_reason']}"
    covered = 0
    for span in call["versions"]:
        assert span["start"] == covered and span["end"] > span["start"], (
            f"{where}: {call['versions']}"
        )
        covered = span["end"]
    assert covered == n, f"{where}: versions cover {covered} of {n} tokens"
    assert call["sampling"]["max_tokens"] >= 1


def _check(served: Served, route: Route, auth: str, case: Case, invalid: str) -> None:
    where = f"{route.label} [{auth}]"
    # Placeholders in the path become real sessions: a fresh open one, the finished one.
    session: dict[str, str] | None = None
    named = case.path_parameters.get("session_id") if case.path_parameters else None
    if named == OPEN_SESSION:
        session = served.new_session()
    elif named == FINISHED_SESSION:
        session = served.finished
    elif route.auth == "session_key":
        session = served.new_session()
    if session is not None and named is not None:
        case.path_parameters["session_id"] = session["session_id"]
    headers: dict[str, str] = {}
    if auth == "valid" and route.auth == "admin":
        headers["Authorization"] = f"Bearer {ADMIN}"
    elif auth == "valid" and route.auth in ("session_key", "session_path") and session:
        headers["Authorization"] = f"Bearer {session['api_key']}"
    elif auth == "valid" and route.auth == "enrolment":
        headers["Authorization"] = f"Bearer {ENROLMENT_KEY}"
    elif auth == "invalid":
        headers["Authorization"] = invalid
    _pin_long_poll(case)
    kwargs = case.as_transport_kwargs(base_url=served.base_url, headers=headers)
    if auth == "none":
        kwargs["headers"].pop("Authorization", None)

    before = served.calls_recorded()
    try:
        resp = served.http.request(**kwargs, timeout=CALL_TIMEOUT_S)
    except requests.Timeout:
        pytest.fail(f"{where}: no answer within {CALL_TIMEOUT_S} s: {kwargs}")
    served.tally.cases[(route.label, auth)] += 1
    served.tally.statuses[(route.label, resp.status_code)] += 1
    detail = f"{where}: {resp.status_code} {resp.text[:500]}\nrequest: {str(kwargs)[:2000]}"

    assert resp.status_code < 500, detail
    if resp.status_code >= 400:
        _assert_openai_error(resp.json(), detail)
    streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
    if streamed and route.path.endswith("/responses"):
        # The Responses API's stream: typed events, numbered, ending in the response's end.
        events = [json.loads(e) for e in _sse_events(resp.text)]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), detail
        assert events and events[-1]["type"] in RESPONSE_ENDS, detail
    elif streamed:
        events = _sse_events(resp.text)
        assert events and events[-1] == "[DONE]", detail
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                _assert_openai_error(payload, detail)
                assert payload["error"]["type"] != "server_error", detail

    # Without valid credentials nothing is done on a route that needs them.
    if auth != "valid" and route.auth in ("admin", "session_key", "enrolment"):
        assert resp.status_code == 401, detail
    if auth == "invalid" and route.auth == "session_path" and session is not None:
        assert resp.status_code == 401, detail

    # A generation that succeeded is recorded, whole; anything refused records nothing.
    recorded = served.calls_recorded() - before
    if route.generates and resp.status_code == 200:
        assert recorded == 1, f"{detail}\n{recorded} calls recorded"
        assert session is not None
        (call,) = served.admin("GET", f"/admin/sessions/{session['session_id']}/calls").json()[
            "calls"
        ]
        _assert_whole_record(call, detail)
        if not streamed:
            usage = resp.json()["usage"]
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            assert completion == len(call["completion_ids"]), detail
    else:
        assert recorded == 0, f"{detail}\n{recorded} calls recorded"
    _assert_session_kept(served, route, resp, session, detail)

    if route.auth == "admin" and auth == "valid":
        served.restore()


def _pin_long_poll(case: Case) -> None:
    """A case's wait for complete groups, at most `ENROLMENT_WAIT_S`: the route holds a request
    up to a minute, and a fuzzed number would hold the run as long (one that is no number, or
    not finite, stays as generated: the route must refuse it)."""
    if not case.query or "wait_s" not in case.query:
        return
    try:
        wait = float(case.query["wait_s"])
    except (TypeError, ValueError):
        return
    if wait > ENROLMENT_WAIT_S and wait != float("inf"):
        case.query["wait_s"] = ENROLMENT_WAIT_S


def _assert_session_kept(
    served: Served,
    route: Route,
    resp: requests.Response,
    session: dict[str, str] | None,
    detail: str,
) -> None:
    """What a client-driven route answered as done is in the store: an enrolled session (with
    its task and group), a finished one ended."""
    if resp.status_code == 429:
        assert int(resp.headers["retry-after"]) >= 1, detail
    if route.label == "POST /v1/sessions" and resp.status_code == 201:
        created = resp.json()
        stored = served.admin("GET", f"/admin/sessions/{created['session_id']}").json()
        assert stored["status"] == "open", detail
        assert (stored["task_id"], stored["group_id"]) == (
            created["task_id"],
            created["group_id"],
        ), detail
        assert created["members"] + created["needed"] == ENROLMENT["group_size"], detail
    if route.path.endswith("/finish") and route.auth != "admin" and resp.status_code == 200:
        assert session is not None, detail
        stored = served.admin("GET", f"/admin/sessions/{session['session_id']}").json()
        assert stored["status"] in ("finished", "failed"), detail


def _fuzz(served: Served, route: Route, auth: str) -> None:
    examples = EXAMPLES_GENERATION if route.generates else EXAMPLES_OTHER

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=_strategy(route), pick=st.integers(min_value=0, max_value=99))
    def run(case: Case, pick: int) -> None:
        invalid = _credentials(served, route)
        _check(served, route, auth, case, invalid[pick % len(invalid)])

    run()


@pytest.mark.parametrize("auth", AUTHS)
@pytest.mark.parametrize("route", ROUTES, ids=[r.label for r in ROUTES])
def test_fuzz_the_gateway_api(served: Served, route: Route, auth: str) -> None:
    _fuzz(served, route, auth)


def test_the_store_is_consistent_after_fuzzing(served: Served) -> None:
    """No half-written record: every session's counters agree with its calls, and every call
    is whole (runs after the fuzz cases above, on the same store)."""
    assert served.tally.server_errors() == 0
    _assert_store_consistent(served.db_path)


def _assert_store_consistent(db_path: Path, interrupted_ok: bool = False) -> None:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        sessions = db.execute(
            "SELECT id, status, finished_at, num_calls, rerender_splits FROM sessions"
        ).fetchall()
        rows = db.execute(
            f"SELECT {', '.join(CALL_COLUMNS)} FROM calls ORDER BY session_id, idx"
        ).fetchall()
    calls: dict[str, list[Any]] = {}
    for row in rows:
        calls.setdefault(row[0], []).append(call_from_row(row))
    for sid, status, finished_at, num_calls, splits in sessions:
        mine = calls.pop(sid, [])
        assert num_calls == len(mine), sid
        assert (finished_at is None) == (status == "open"), sid
        assert len({c.index for c in mine}) == len(mine), sid
        assert splits == sum(1 for c in mine if c.index > 0 and not c.extends_previous), sid
        previous: list[int] | None = None
        for c in mine:
            where = f"{sid}/{c.index}"
            record = c.model_dump(mode="json")
            if interrupted_ok and c.finish_reason == "interrupted":
                record["finish_reason"] = "length"  # whole otherwise: checked the same
            _assert_whole_record(record, where)
            if c.extends_previous:
                assert previous is not None and c.prompt_ids[: len(previous)] == previous, where
            previous = c.prompt_ids + c.completion_ids
    assert calls == {}, "calls recorded for sessions that do not exist"


# -- regressions: what the fuzzing found ----------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["http://[::1", "http://replica:port", "http://a b:8000", "0", "ftp://replica", "é://x"]
)
def test_a_replica_url_the_gateway_cannot_address_is_refused(served: Served, url: str) -> None:
    """Such a URL was added (201); every call routed to it then failed with a 500 and the
    replicas' health checks stopped for good."""
    r = served.http.post(
        f"{served.base_url}/admin/replicas",
        json={"url": url},
        headers=_ADMIN_HEADERS,
        timeout=CALL_TIMEOUT_S,
    )
    assert r.status_code == 400, r.text
    _assert_openai_error(r.json(), r.text)
    assert r.json()["error"]["param"] == "url"
    status = served.admin("GET", "/admin/status").json()
    assert [x["url"] for x in status["replicas"]] == [REPLICA]
    session = served.new_session()
    chat = served.http.post(
        f"{served.base_url}{session['base_url']}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=CALL_TIMEOUT_S,
    )
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_removing_a_replica_without_the_admin_token_is_refused_before_its_query_is_read(
    served: Served, headers: dict[str, str]
) -> None:
    """A missing `url` was a 400 to anyone: FastAPI validated it before the route checked the
    token. Without the token it is a 401, whatever the query; with it, a 400 naming `url`."""
    url = f"{served.base_url}/admin/replicas"
    r = served.http.delete(url, headers=headers, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 401, r.text
    r = served.http.delete(url, headers=_ADMIN_HEADERS, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text


def test_finishing_a_session_of_a_completed_group_again_is_no_server_error(served: Served) -> None:
    """The admin API may finish a session again (a rollout's finish is retried on a fresh
    connection); for an enrolled session whose group had completed, that was a 500 (the group
    was gone from the enrolment's books, its sessions not). The group completes once."""
    served.restore()  # the fixture's enrolment, fresh: its bound not used up by the fuzzing
    key = {"Authorization": f"Bearer {ENROLMENT_KEY}"}
    sessions = []
    for _ in range(ENROLMENT["group_size"]):
        r = served.http.post(
            f"{served.base_url}/v1/sessions",
            json={"task_id": "t-again", "group_id": "g-again"},
            headers=key,
            timeout=CALL_TIMEOUT_S,
        )
        assert r.status_code == 201, r.text
        sessions.append(r.json()["session_id"])
    for sid in [*sessions, sessions[0]]:
        served.admin("POST", f"/admin/sessions/{sid}/finish", json={"reward": 1.0})
    groups = served.admin("GET", "/admin/enrolment/groups", params={"after": 0}).json()["groups"]
    assert [g["sessions"] for g in groups if g["group_id"] == "g-again"] == [sessions]


# -- sequences: admin and agent calls interleaved, nothing put back in between ----------------------

# The 5xx a sequence may meet by design (docs/gateway-api.md): a call held by a pause past the
# limit, no replica left to serve, a weight load no replica took, a cut call not continued.
_DOCUMENTED_5XX = {"paused", "no_replica", "load_failed", "interrupted"}
_GHOSTS = ["http://ghost-a:8000", "http://ghost-b:9000"]


class GatewaySequences(RuleBasedStateMachine):
    """Sessions, calls, pauses, weight loads, resumes and replicas coming and going, in any
    order: nothing unplanned (no 500, only the documented 5xx), no hang, errors in OpenAI's
    shape, and one record for every answered call (checked per step and on the store after)."""

    served: Served
    # Across all sequences: sessions enrolled, and complete groups checked against them.
    stats: Counter[str]

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.paused = False
        self.served.restore()  # each sequence starts from a serving gateway
        # Client-driven rollouts: the sessions enrolled per group, and the sessions ended.
        self.enrolled: dict[str, list[str]] = {}
        self.ended: set[str] = set()
        self.checked: set[str] = set()  # groups found complete

    sessions = Bundle("sessions")

    def _send(
        self, method: str, path: str, admin: bool = False, key: str | None = None, **kwargs: Any
    ) -> requests.Response:
        s = self.served
        headers = _ADMIN_HEADERS if admin else {}
        if key is not None:
            headers = {"Authorization": f"Bearer {key}"}
        try:
            r = s.http.request(
                method, s.base_url + path, headers=headers, timeout=CALL_TIMEOUT_S, **kwargs
            )
        except requests.Timeout:
            pytest.fail(f"{method} {path}: no answer within {CALL_TIMEOUT_S} s")
        self.steps += 1
        detail = f"{method} {path} {kwargs}: {r.status_code} {r.text[:500]}"
        if r.status_code >= 400:
            _assert_openai_error(r.json(), detail)
        if r.status_code >= 500:
            assert r.json()["error"]["code"] in _DOCUMENTED_5XX, detail
        return r

    @initialize(target=sessions)
    def first_session(self) -> dict[str, str]:
        return self.served.new_session()

    @rule(target=sessions)
    def new_session(self) -> dict[str, str]:
        return self.served.new_session()

    @rule(session=sessions, body=chat_bodies())
    def chat(self, session: dict[str, str], body: dict[str, Any]) -> None:
        before = self.served.calls_recorded()
        r = self._send("POST", f"{session['base_url']}/chat/completions", json=body)
        recorded = self.served.calls_recorded() - before
        if r.status_code == 200:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                assert _sse_events(r.text)[-1] == "[DONE]"
                assert recorded == 1 or '"error"' in r.text, r.text
            else:
                assert recorded == 1, r.text
        else:
            assert recorded == 0, r.text

    @rule(session=sessions, body=chat_bodies())
    def chat_more(self, session: dict[str, str], body: dict[str, Any]) -> None:
        self.chat(session, body)  # calls are what the rest is for: twice the weight

    @rule(session=sessions, body=completion_bodies())
    def complete(self, session: dict[str, str], body: dict[str, Any]) -> None:
        before = self.served.calls_recorded()
        r = self._send("POST", f"{session['base_url']}/completions", json=body)
        assert self.served.calls_recorded() - before == (r.status_code == 200), r.text

    @rule(session=sessions, status=st.sampled_from(["finished", "failed"]))
    def finish(self, session: dict[str, str], status: str) -> None:
        path = f"/admin/sessions/{session['session_id']}/finish"
        r = self._send("POST", path, admin=True, json={"status": status, "reward": 1.0})
        if r.status_code == 200:
            self.ended.add(session["session_id"])

    @rule(target=sessions, task=st.sampled_from(["t0", "t1"]))
    def enrol(self, task: str) -> Any:
        """A client's session, put in an open group of its task or a new one."""
        r = self._send("POST", "/v1/sessions", key=ENROLMENT_KEY, json={"task_id": task})
        if r.status_code == 429:  # the bound on new groups: nothing made
            assert int(r.headers["retry-after"]) >= 1, r.text
            return multiple()
        assert r.status_code == 201, r.text
        created = r.json()
        self.enrolled.setdefault(created["group_id"], []).append(created["session_id"])
        self.stats["enrolled"] += 1
        return created

    def _full_groups_open(self) -> list[str]:
        size = ENROLMENT["group_size"]
        return [
            g for g, sids in self.enrolled.items() if len(sids) == size and set(sids) - self.ended
        ]

    @precondition(lambda self: self._full_groups_open())
    @rule(data=st.data())
    def end_a_group(self, data: st.DataObject) -> None:
        """The clients of a full group finish their sessions (as `finish` would, one by one)."""
        group_id = data.draw(st.sampled_from(self._full_groups_open()))
        for sid in self.enrolled[group_id]:
            if sid not in self.ended:
                self.finish({"session_id": sid}, "finished")

    @invariant()
    def groups_complete(self) -> None:
        """Every group whose sessions all ended is complete, with exactly those sessions,
        once; no session is in two groups, and no complete group holds an open session."""
        params = {"after": 0, "wait_s": 0}
        groups = self._send("GET", "/admin/enrolment/groups", admin=True, params=params)
        complete = {g["group_id"]: g["sessions"] for g in groups.json()["groups"]}
        listed = [sid for sessions in complete.values() for sid in sessions]
        assert len(listed) == len(set(listed)), complete
        assert set(listed) <= self.ended, complete
        size = ENROLMENT["group_size"]
        for group_id, sessions in self.enrolled.items():
            if len(sessions) == size and set(sessions) <= self.ended:
                assert complete.get(group_id) == sessions, (group_id, complete)
                self.stats["groups complete"] += group_id not in self.checked
                self.checked.add(group_id)

    @rule(session=sessions)
    def samples(self, session: dict[str, str]) -> None:
        self._send("GET", f"/admin/sessions/{session['session_id']}/samples", admin=True)

    @precondition(lambda self: not self.paused)
    @rule(mode=st.sampled_from(["abort", "keep", "drain"]))
    def pause(self, mode: str) -> None:
        r = self._send("POST", "/admin/pause", admin=True, json={"mode": mode, "timeout_s": 5})
        self.paused = r.status_code == 200

    @precondition(lambda self: self.paused)
    @rule(version=st.integers(min_value=0, max_value=3), real=st.booleans())
    def load_weights(self, version: int, real: bool) -> None:
        path = str(self.model_dir) if real else "/nonexistent/snapshot"
        self._send("POST", "/admin/weights", admin=True, json={"version": version, "path": path})

    @precondition(lambda self: self.paused)
    @rule(latest=st.booleans(), version=st.integers(min_value=0, max_value=3))
    def resume(self, latest: bool, version: int) -> None:
        if latest:
            replicas = self._send("GET", "/admin/status", admin=True).json()["replicas"]
            version = max((r["version"] for r in replicas if r["healthy"]), default=version)
        r = self._send("POST", "/admin/resume", admin=True, json={"version": version})
        self.paused = r.status_code != 200

    @rule(url=st.sampled_from([REPLICA, *_GHOSTS]), version=st.none() | st.integers(0, 3))
    def add_replica(self, url: str, version: int | None) -> None:
        self._send("POST", "/admin/replicas", admin=True, json={"url": url, "version": version})

    @rule(url=st.sampled_from([REPLICA, *_GHOSTS]))
    def remove_replica(self, url: str) -> None:
        self._send("DELETE", "/admin/replicas", admin=True, params={"url": url})

    @invariant()
    def health_answers(self) -> None:
        assert self._send("GET", "/health").status_code == 200

    model_dir: Path


def test_fuzz_sequences_of_admin_and_agent_calls(
    tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db_path = tmp_path / "store.sqlite"
    # A short pause limit: a call a sequence leaves waiting fails (503 `paused`) soon.
    with _serve(tiny_model_dir, db_path, max_pause_wait_s=0.1) as served:
        GatewaySequences.served = served
        GatewaySequences.stats = Counter()
        GatewaySequences.model_dir = tiny_model_dir
        steps = 0

        def machine() -> GatewaySequences:
            nonlocal steps
            m = GatewaySequences()
            original = m.teardown

            def teardown() -> None:
                nonlocal steps
                steps += m.steps
                original()

            m.teardown = teardown  # type: ignore[method-assign]
            return m

        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=SEQUENCES,
                stateful_step_count=STEPS_PER_SEQUENCE,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            ),
        )
    _assert_store_consistent(db_path, interrupted_ok=True)
    stats = GatewaySequences.stats
    _write_line(
        request.config,
        f"fuzzed sequences of admin and agent calls: {steps} requests, "
        f"{stats['enrolled']} sessions enrolled, {stats['groups complete']} complete groups checked",
    )


# -- outside the schema: paths no route serves, methods a route does not take ---------------------

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_KNOWN = sorted({r.path.replace("{session_id}", "s") for r in ROUTES})


@st.composite
def _off_schema_requests(draw: st.DrawFn) -> tuple[str, str]:
    # Printable: a request line with control characters is refused by uvicorn itself (a 400
    # in plain text) before any of the gateway sees it.
    segment = st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%"),
        min_size=0,
        max_size=8,
    )
    path = draw(
        st.one_of(
            st.sampled_from(_KNOWN),
            st.lists(segment, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts)),
            st.tuples(st.sampled_from(_KNOWN), segment).map(lambda t: f"{t[0]}/{t[1]}"),
        )
    )
    return draw(st.sampled_from(_METHODS)), path


def test_fuzz_paths_and_methods_no_route_serves(
    served: Served, request: pytest.FixtureRequest
) -> None:
    """An unknown path or a method a route does not take is answered in OpenAI's shape (it
    was Starlette's `{"detail": "Not Found"}`), never with a 5xx, and records nothing."""
    before = served.calls_recorded()
    seen: Counter[int] = Counter()

    @settings(
        max_examples=150,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(call=_off_schema_requests())
    def run(call: tuple[str, str]) -> None:
        method, path = call
        r = served.http.request(method, served.base_url + path, timeout=CALL_TIMEOUT_S)
        seen[r.status_code] += 1
        if path.startswith("/ui"):
            return  # the viewer: a browser's pages, its login form in HTML (test_viewer_api.py)
        assert r.status_code < 500, f"{method} {path}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            assert r.text, f"{method} {path}: {r.status_code} with no body {dict(r.headers)}"
            _assert_openai_error(r.json(), f"{method} {path}: {r.text[:300]}")
        if r.status_code == 405:
            assert r.headers.get("allow"), f"{method} {path}: a 405 names the methods it takes"

    run()
    assert served.calls_recorded() == before
    assert seen[404] and seen[405], seen
    _write_line(
        request.config,
        f"paths and methods outside the schema: {sum(seen.values())} requests, statuses "
        + ", ".join(f"{s}: {n}" for s, n in sorted(seen.items())),
    )


def _nested(levels: int) -> list[Any]:
    """A JSON value `levels` deep: lists in lists."""
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize("route", ["chat", "metadata", "create"])
def test_a_body_nested_too_deep_to_be_read_back_is_refused(served: Served, route: str) -> None:
    """A body nested 300 levels deep (orjson parses 1024, writes 254) was answered and recorded,
    and then its session's calls (or the session) could not be read: a 500. Now a 400 past
    `MAX_JSON_DEPTH`; a body at it is recorded and read back."""
    session = served.new_session()
    sid, base = session["session_id"], f"{served.base_url}/sessions/{session['session_id']}"

    def send(levels: int) -> requests.Response:
        # The body's own levels above the nested value: 3 for chat, 2 for the others.
        body: dict[str, Any]
        if route == "chat":
            message = {"role": "user", "content": "hi", "audio": _nested(levels - 3)}
            body, url, headers = {"messages": [message]}, f"{base}/v1/chat/completions", {}
        elif route == "metadata":
            body = {"metadata": {"k": _nested(levels - 2)}}
            url, headers = f"{base}/metadata", {}
        else:
            body = {"task_id": "t", "metadata": {"k": _nested(levels - 2)}}
            url, headers = f"{served.base_url}/admin/sessions", _ADMIN_HEADERS
        return served.http.post(
            url,
            data=json.dumps(body).encode(),
            headers={**headers, "content-type": "application/json"},
            timeout=CALL_TIMEOUT_S,
        )

    over = send(MAX_JSON_DEPTH + 1)
    assert over.status_code == 400, over.text
    _assert_openai_error(over.json(), over.text)
    assert f"nested more than {MAX_JSON_DEPTH} levels" in over.json()["error"]["message"]

    at = send(MAX_JSON_DEPTH)
    assert at.status_code in (200, 201), at.text
    read = at.json()["session_id"] if route == "create" else sid
    assert served.admin("GET", f"/admin/sessions/{read}").status_code == 200
    calls = served.admin("GET", f"/admin/sessions/{read}/calls").json()["calls"]
    assert len(calls) == (route == "chat")
