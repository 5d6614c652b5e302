"""The DeepResearch retrieval service: the index, the micro-batcher, and the real server started
as a subprocess by its launcher, checked against bm25s computed directly on the same corpus."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import bm25s
import httpx
import numpy as np
import orjson
import pytest

from lockgate.examples.deepresearch.retrieval.__main__ import main as cli_main
from lockgate.examples.deepresearch.retrieval.client import Hit, RetrievalClient, RetrievalError
from lockgate.examples.deepresearch.retrieval.index import (
    BM25Index,
    CorpusError,
    IndexConfig,
    IndexLoadError,
    split_title,
)
from lockgate.examples.deepresearch.retrieval.launcher import (
    RetrievalService,
    RetrievalStartError,
)
from lockgate.examples.deepresearch.retrieval.server import MicroBatcher, create_app

_ARTICLES = [
    (
        "Ada Lovelace",
        "Ada Lovelace was an English mathematician who wrote the first computer "
        "program, for the Analytical Engine of Charles Babbage.",
    ),
    (
        "Analytical Engine",
        "The Analytical Engine was a proposed mechanical general-purpose "
        "computer designed by Charles Babbage in 1837.",
    ),
    (
        "Charles Babbage",
        "Charles Babbage was an English polymath and mechanical engineer who "
        "originated the concept of a digital programmable computer.",
    ),
    ("Paris", "Paris is the capital and most populous city of France, on the Seine river."),
    ("France", "France is a country in Western Europe; its capital is Paris."),
    ("Seine", "The Seine is a river in northern France that flows through Paris to the sea."),
    (
        "Mount Everest",
        "Mount Everest is Earth's highest mountain above sea level, in the "
        "Himalayas on the border of Nepal and China.",
    ),
    ("Nepal", "Nepal is a landlocked country in South Asia, home to Mount Everest."),
    (
        "Alan Turing",
        "Alan Turing was an English mathematician and computer scientist, a "
        "founder of theoretical computer science and artificial intelligence.",
    ),
    (
        "Python (programming language)",
        "Python is a high-level programming language created "
        "by Guido van Rossum and first released in 1991.",
    ),
    ("Twin A", "identical twin paragraph about lighthouses and foghorns"),
    ("Twin B", "identical twin paragraph about lighthouses and foghorns"),
]
_FILLER = "river mountain city computer engine language capital english country sea".split()
QUERIES = [
    "who wrote the first computer program",
    "Analytical Engine Babbage",
    "capital of France",
    "highest mountain Nepal",
    "Seine river Paris",
    "English mathematician",
    "programming language 1991",
    "lighthouses foghorns",
]


def _documents() -> list[dict[str, str]]:
    docs = [
        {"id": f"wiki/{i}", "contents": f'"{title}"\n{text}'}
        for i, (title, text) in enumerate(_ARTICLES)
    ]
    rng = random.Random(7)  # filler, so that document frequencies are not all 1
    for i in range(28):
        text = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(5, 30)))
        docs.append({"id": str(1000 + i), "contents": f'"Filler {i}"\n{text}'})
    return docs


def _write_corpus(path: Path, docs: list[dict[str, str]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    return path


class Reference:
    """bm25s used directly, as its README shows, with the service's settings."""

    def __init__(self, docs: list[dict[str, str]]) -> None:
        self.ids = [d["id"] for d in docs]
        tokens = bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False)
        self.bm25 = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
        self.bm25.index(tokens, show_progress=False)

    def top(self, query: str, k: int) -> list[tuple[str, float]]:
        query_tokens = bm25s.tokenize(
            [query], stopwords="en", return_ids=False, show_progress=False
        )
        rows, scores = self.bm25.retrieve(query_tokens, k=len(self.ids), show_progress=False)
        ranked = sorted(
            (-float(s), int(r)) for r, s in zip(rows[0], scores[0], strict=True) if s > 0
        )
        return [(self.ids[r], -neg) for neg, r in ranked[:k]]


def _pairs(hits: list[Hit]) -> list[tuple[str, float]]:
    assert all(h.score is not None for h in hits)
    return [(h.id, float(h.score or 0.0)) for h in hits]


def _assert_same(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert [i for i, _ in got] == [i for i, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-6, abs=1e-6)


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return _documents()


@pytest.fixture(scope="module")
def reference(docs: list[dict[str, str]]) -> Reference:
    return Reference(docs)


@pytest.fixture(scope="module")
def corpus(docs: list[dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus") / "wiki.jsonl", docs)


@pytest.fixture(scope="module")
def service(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RetrievalService]:
    work = tmp_path_factory.mktemp("retrieval")
    # --corpus: the server builds the index itself before it serves (the on-the-fly path).
    with RetrievalService(work / "index", corpus=corpus, log_path=work / "server.log") as svc:
        yield svc


@pytest.fixture
async def client(service: RetrievalService) -> AsyncIterator[RetrievalClient]:
    async with RetrievalClient(service.url, timeout_s=30.0) as retrieval:
        yield retrieval


# --- the index, in process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def built(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    return BM25Index.build(corpus, tmp_path_factory.mktemp("built") / "index")


def test_index_matches_bm25s(built: BM25Index, reference: Reference) -> None:
    for k in (1, 3, 10):
        for query, hits in zip(QUERIES, built.search_batch(QUERIES, k), strict=True):
            _assert_same(_pairs(hits), reference.top(query, k))
            assert hits, query


def test_save_load_round_trip_is_identical(built: BM25Index) -> None:
    loaded = BM25Index.load(built.index_dir)
    assert len(loaded) == len(built)
    for k in (1, 5, 100):
        assert loaded.search_batch(QUERIES, k) == built.search_batch(QUERIES, k)
    assert loaded.document("wiki/3") == built.document("wiki/3")
    assert loaded.config == built.config


def test_k_larger_than_corpus_returns_every_match(built: BM25Index, docs: list) -> None:
    hits = built.search_batch(["english computer river"], 10 * len(docs))[0]
    assert 3 < len(hits) < len(docs)  # the filler matches too, the twins do not
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    assert "wiki/10" not in {h.id for h in hits}


def test_queries_without_indexed_terms_get_no_hits(built: BM25Index) -> None:
    # Empty, stopwords only, single characters only, unknown words: none has an indexed term.
    assert built.search_batch(["", "the of and", "a b c 7", "xylophone quartz"], 5) == [[]] * 4
    with pytest.raises(ValueError, match="k must be at least 1"):
        built.search_batch(["paris"], 0)


def test_ties_are_broken_by_corpus_order(built: BM25Index) -> None:
    hits = built.search_batch(["lighthouses"], 2)[0]
    assert [h.id for h in hits] == ["wiki/10", "wiki/11"]
    assert hits[0].score == hits[1].score


def test_document_lookup(built: BM25Index) -> None:
    hit = built.document("wiki/0")
    assert hit is not None and hit.title == "Ada Lovelace" and hit.score is None
    assert hit.text.startswith("Ada Lovelace was an English mathematician")
    assert built.document("wiki/999") is None


def test_split_title() -> None:
    assert split_title('"Paris"\nParis is the capital.') == ("Paris", "Paris is the capital.")
    assert split_title('"A"\nline one\nline two') == ("A", "line one\nline two")
    assert split_title("No newline at all") == ("No newline at all", "")
    assert split_title('"Quoted "inner" title"\n') == ('Quoted "inner" title', "")
    hit = Hit(id="1", contents='"T"\nbody')
    assert (hit.title, hit.text) == ("T", "body")


def test_stopwords_can_be_kept(corpus: Path, tmp_path: Path) -> None:
    index = BM25Index.build(corpus, tmp_path / "idx", IndexConfig(stopwords="none"))
    assert index.search_batch(["the"], 3)[0]  # "the" is indexed now


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": "1", "contents": "x y"}', "not json"], r":2: not JSON"),
        (['{"id": "1"}'], r':1: needs "id" and "contents"'),
        (["[1, 2]"], r":1: each line must be a JSON object"),
        (['{"id": "1", "contents": "aa"}', '{"id": "1", "contents": "bb"}'], "appears twice"),
        ([], "no documents"),
        (['{"id": "1", "contents": "a the"}'], "no document has an indexable term"),
    ],
)
def test_bad_corpus_is_refused_with_its_line(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=message):
        BM25Index.build(corpus, tmp_path / "idx")
    with pytest.raises(IndexLoadError, match="holds no retrieval index"):
        BM25Index.load(tmp_path / "idx")  # a failed build leaves nothing loadable


def test_cli_reports_bad_input_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "x yy"}\n{oops\n')
    assert cli_main(["build", "--corpus", str(bad), "--index", str(tmp_path / "i")]) == 2
    assert cli_main(["build", "--corpus", str(tmp_path / "nope.jsonl"), "--index", "x"]) == 2
    assert cli_main(["serve", "--index", str(tmp_path / "missing")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert "bad.jsonl:2: not JSON" in lines[0]
    assert "nope.jsonl does not exist" in lines[1]
    assert "missing does not exist" in lines[2]


def test_cli_build_writes_a_loadable_index(corpus: Path, tmp_path: Path) -> None:
    assert cli_main(["build", "--corpus", str(corpus), "--index", str(tmp_path / "i")]) == 0
    assert len(BM25Index.load(tmp_path / "i")) == len(_documents())


# --- the micro-batcher, with a fake index that counts its calls ----------------------------


class CountingIndex:
    """Answers query q with documents q#0..q#9 (scores 10..1) after `delay_s`; counts calls."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s = delay_s
        self.batches: list[tuple[int, int]] = []  # (queries, k) per call
        self.fail_next = False

    def __len__(self) -> int:
        return 10

    def search_batch(self, queries: list[str], k: int) -> list[list[Hit]]:
        assert threading.current_thread() is not threading.main_thread()
        self.batches.append((len(queries), k))
        time.sleep(self.delay_s)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("index exploded")
        return [
            [Hit(id=f"{q}#{i}", contents=q, score=float(10 - i)) for i in range(min(k, 10))]
            for q in queries
        ]

    def document(self, doc_id: str) -> Hit | None:
        return None


async def test_concurrent_queries_share_search_batch_calls() -> None:
    index = CountingIndex()
    batcher = MicroBatcher(index, max_batch=64, max_wait_s=0.005)
    async with batcher.running():
        results = await asyncio.gather(*(batcher.search([f"q{i}"], 1 + i % 5) for i in range(32)))
    for i, result in enumerate(results):
        assert [h.id for h in result[0]] == [f"q{i}#{j}" for j in range(1 + i % 5)]
    assert sum(n for n, _ in index.batches) == 32
    assert len(index.batches) < 32 / 4, index.batches


async def test_batches_are_bounded_and_a_large_request_goes_whole() -> None:
    index = CountingIndex()
    batcher = MicroBatcher(index, max_batch=8, max_wait_s=0.005)
    async with batcher.running():
        small = [batcher.search([f"s{i}"], 3) for i in range(20)]
        results = await asyncio.gather(batcher.search([f"big{i}" for i in range(12)], 2), *small)
    assert [len(r) for r in results] == [12] + [1] * 20
    sizes = [n for n, _ in index.batches]
    assert sizes.count(12) == 1  # the 12-query request, alone
    assert all(n <= 8 for n in sizes if n != 12) and sum(sizes) == 32


async def test_a_failed_batch_fails_its_requests_only() -> None:
    index = CountingIndex()
    batcher = MicroBatcher(index, max_batch=64, max_wait_s=0.0)
    async with batcher.running():
        index.fail_next = True
        with pytest.raises(RuntimeError, match="index exploded"):
            await batcher.search(["a"], 1)
        assert (await batcher.search(["b"], 1))[0][0].id == "b#0"
    with pytest.raises(RuntimeError, match="not running"):
        await batcher.search(["c"], 1)


async def test_the_app_batches_concurrent_requests() -> None:
    index = CountingIndex()
    app = create_app(index, max_batch=64, max_wait_s=0.005)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        RetrievalClient("http://retrieval", transport=transport) as client,
    ):
        results = await asyncio.gather(*(client.search(f"q{i}", topk=2) for i in range(32)))
    assert [[h.id for h in r] for r in results] == [[f"q{i}#0", f"q{i}#1"] for i in range(32)]
    assert results[0][0].score == 10.0
    assert len(index.batches) < 32 / 4, index.batches


# --- the client's errors, with injected transports -----------------------------------------


async def test_client_errors_say_what_failed() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    cases = [
        (httpx.MockTransport(timeout), "timed out after 30s"),
        (httpx.MockTransport(lambda r: httpx.Response(200, json={"x": 1})), "unexpected answer"),
        (httpx.MockTransport(lambda r: httpx.Response(502, text="bad gateway")), "HTTP 502"),
        (httpx.MockTransport(lambda r: httpx.Response(200, json={"result": []})), "0 results"),
    ]
    for transport, message in cases:
        async with RetrievalClient("http://r", transport=transport) as client:
            with pytest.raises(RetrievalError, match=message):
                await client.search("paris")
    async with RetrievalClient("http://127.0.0.1:9", timeout_s=5) as client:
        with pytest.raises(RetrievalError, match="transport error"):
            await client.health()


# --- the real server, a subprocess --------------------------------------------------------


async def test_service_is_healthy(client: RetrievalClient, docs: list) -> None:
    assert await client.health() == {"status": "ok", "documents": len(docs)}


async def test_concurrent_searches_match_bm25s(
    client: RetrievalClient, reference: Reference
) -> None:
    queries = [QUERIES[i % len(QUERIES)] for i in range(32)]
    topks = [1 + i % 4 for i in range(32)]
    results = await asyncio.gather(
        *(client.search(q, topk=k) for q, k in zip(queries, topks, strict=True))
    )
    for query, k, hits in zip(queries, topks, results, strict=True):
        _assert_same(_pairs(hits), reference.top(query, k))
    assert results[0][0].title == "Ada Lovelace"


async def test_search_many_returns_one_list_per_query(
    client: RetrievalClient, reference: Reference
) -> None:
    results = await client.search_many([*QUERIES, "", "xylophone"], topk=100)
    assert len(results) == len(QUERIES) + 2
    for query, hits in zip(QUERIES, results[: len(QUERIES)], strict=True):
        _assert_same(_pairs(hits), reference.top(query, 100))
    assert results[-2:] == [[], []]


async def _post(url: str, body: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{url}/retrieve", content=orjson.dumps(body))


async def test_single_query_form_and_return_scores(
    service: RetrievalService, reference: Reference
) -> None:
    plain = await _post(service.url, {"query": "capital of France", "topk": 2})
    assert plain.status_code == 200
    want = reference.top("capital of France", 2)
    items = plain.json()["result"]
    assert len(items) == 1 and [set(d) for d in items[0]] == [{"id", "contents"}] * 2
    assert [d["id"] for d in items[0]] == [i for i, _ in want]

    scored = await _post(service.url, {"queries": ["capital of France"], "return_scores": True})
    (items,) = scored.json()["result"]
    assert len(items) == 3  # topk defaults to 3, as in the peers' servers
    assert [set(d) for d in items] == [{"document", "score"}] * 3
    assert items[0]["score"] == pytest.approx(want[0][1], rel=1e-6)


async def test_document_hit_and_404(client: RetrievalClient, service: RetrievalService) -> None:
    hit = await client.document("wiki/3")  # a "/" in the id survives the URL
    assert hit is not None and hit.title == "Paris" and hit.score is None
    assert await client.document("wiki/404") is None
    async with httpx.AsyncClient() as http:
        missing = await http.get(f"{service.url}/document/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"queries": []}', '"queries" is empty'),
        (b'{"topk": 3}', 'give either "queries"'),
        (b'{"query": "a", "queries": ["b"]}', 'give either "queries"'),
        (b'{"queries": "paris"}', "queries: Input should be a valid array"),
        (b'{"queries": ["paris", 7]}', "queries.1: Input should be a valid string"),
        (b'{"queries": ["paris"], "topk": "3"}', "topk: Input should be a valid integer"),
        (b'{"queries": ["paris"], "topk": 0}', "topk: Input should be greater than or equal"),
        (b'{"queries": ["paris"], "topk": 101}', "topk: Input should be less than or equal"),
        (orjson.dumps({"queries": ["paris"] * 257}), "at most 256 queries per request"),
        (orjson.dumps({"query": "x" * 2001}), "query 0 has 2001 characters; at most 2000"),
        (b"{not json", "the body is not valid JSON"),
        (b"[1, 2]", "the body must be a JSON object"),
    ],
)
async def test_malformed_requests_get_a_400_and_the_service_goes_on(
    service: RetrievalService, client: RetrievalClient, body: bytes, message: str
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{service.url}/retrieve", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"] and "\n" not in error["message"]
    assert [h.id for h in await client.search("Analytical Engine", topk=1)] == ["wiki/1"]


async def test_client_raises_the_servers_message(client: RetrievalClient) -> None:
    with pytest.raises(RetrievalError, match=r'HTTP 400: "queries" is empty'):
        await client.search_many([])


# --- the launcher ---------------------------------------------------------------------------


def test_launcher_explains_a_server_that_cannot_start(tmp_path: Path) -> None:
    service = RetrievalService(tmp_path / "no-index", log_path=tmp_path / "server.log")
    with pytest.raises(RetrievalStartError) as info:
        service.start()
    message = str(info.value)
    assert "exited with code 2 before serving" in message
    assert "no-index does not exist" in message  # the log's tail, the server's own words
    assert service.pid is None


def test_launcher_times_out_with_the_logs_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A child that never prints a URL: the wait ends at the timeout, and the child with it.
    service = RetrievalService(tmp_path, log_path=tmp_path / "s.log", startup_timeout_s=1.5)
    script = "import os, time; print('warming up', os.getpid(), flush=True); time.sleep(60)"
    monkeypatch.setattr(service, "command", lambda: [sys.executable, "-c", script])
    with pytest.raises(RetrievalStartError, match=r"did not serve within 1\.5s") as info:
        service.start()
    assert "warming up" in str(info.value)
    child = int(str(info.value).split("warming up ")[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.killpg(child, 0)
    assert service.pid is None


def test_launcher_shuts_the_server_down(service: RetrievalService, tmp_path: Path) -> None:
    # The module's service built this index; this one loads it.
    with RetrievalService(service.index_dir, log_path=tmp_path / "second.log") as second:
        pid = second.pid
        assert pid is not None and second.url != service.url
        assert httpx.get(f"{second.url}/health", timeout=10).status_code == 200
        url = second.url
    assert second.exit_code == 0  # a clean shutdown on SIGTERM, not a death by it (-15)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the process group is gone, not only the leader
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_external_service_is_checked_and_left_running(service: RetrievalService) -> None:
    with RetrievalService.external(service.url + "/") as external:
        assert external.url == service.url and external.pid is None
    assert httpx.get(f"{service.url}/health", timeout=10).status_code == 200
    with pytest.raises(RetrievalStartError, match="no retrieval service answers"):
        RetrievalService.external("http://127.0.0.1:9", timeout_s=2)


def test_numbers_are_float32_exact(built: BM25Index) -> None:
    # The scores the service sends are bm25s's float32 values, widened without rounding.
    score = built.search_batch(["paris"], 1)[0][0].score
    assert score is not None and float(np.float32(score)) == score
