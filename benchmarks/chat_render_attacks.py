"""Chat requests that cost renders, against a running `conveyor serve` (issue 49, item 5).

Sends one chat request of N empty user messages and records its status and seconds; then
SENDERS clients send it back to back for --seconds while a steady client times a one-message
`max_tokens: 1` chat in a loop beside them. stdout has one JSON object: the single request's
status, seconds and error message, and the steady client's p50, max and count.

    conveyor serve --model SmolLM2-135M-Instruct.Q4_1.gguf --port 8000 &
    python benchmarks/chat_render_attacks.py --url http://127.0.0.1:8000 --messages 65000
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

CHAT = "/v1/chat/completions"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--messages", type=int, default=65_000)
    ap.add_argument("--senders", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    body = json.dumps(
        {"messages": [{"role": "user", "content": ""}] * args.messages, "max_tokens": 1}
    )
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=args.url, timeout=300) as client:
        started = time.monotonic()
        resp = client.post(CHAT, content=body, headers=headers)
        single = {
            "status": resp.status_code,
            "seconds": round(time.monotonic() - started, 2),
            "message": resp.json().get("error", {}).get("message"),
            "body_bytes": len(body),
        }
    stop = time.monotonic() + args.seconds

    def send() -> None:
        with httpx.Client(base_url=args.url, timeout=300) as client:
            while time.monotonic() < stop:
                client.post(CHAT, content=body, headers=headers)

    senders = [threading.Thread(target=send) for _ in range(args.senders)]
    for sender in senders:
        sender.start()
    time.sleep(1.0)
    latencies = []
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with httpx.Client(base_url=args.url, timeout=300) as client:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            assert client.post(CHAT, json=small).status_code == 200
            latencies.append(time.monotonic() - t0)
    for sender in senders:
        sender.join()
    steady = {
        "p50_s": round(statistics.median(latencies), 2),
        "max_s": round(max(latencies), 2),
        "count": len(latencies),
    }
    print(json.dumps({"single": single, "senders": args.senders, "steady": steady}))


if __name__ == "__main__":
    main()
