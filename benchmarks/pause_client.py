"""A lean process that times `POST /admin/pause` for the weight-sync benchmark.

The benchmark's own process runs 32 agents on one event loop and imports torch: its GIL
switches and garbage collections (a full one walks ~400k objects there) would be counted in a
pause timed from inside it. This process imports nothing heavy and does one thing: for each
line `MODE` on stdin it sends the pause on a kept-alive connection and prints one JSON line,
`{"rtt_s": ..., "status": ..., "body": ...}`.

    python benchmarks/pause_client.py http://127.0.0.1:PORT ADMIN_TOKEN
"""

from __future__ import annotations

import gc
import http.client
import json
import sys
import time
from urllib.parse import urlsplit


def main() -> int:
    url, token = urlsplit(sys.argv[1]), sys.argv[2]
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    gc.disable()  # nothing here makes cycles; no collection may land inside a timed request
    for line in sys.stdin:
        body = json.dumps({"mode": line.strip() or "abort", "timeout_s": 600})
        conn.request("GET", "/health")  # a live connection first: the timed request is the pause
        conn.getresponse().read()
        started = time.perf_counter()
        conn.request("POST", "/admin/pause", body=body, headers=headers)
        resp = conn.getresponse()
        answer = resp.read()
        rtt = time.perf_counter() - started
        print(json.dumps({"rtt_s": rtt, "status": resp.status, "body": json.loads(answer)}))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
