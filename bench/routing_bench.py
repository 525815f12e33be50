#!/usr/bin/env python3
"""Routing benchmarks (issue #12), with the release binaries.

    python3 bench/routing_bench.py strategies   # p50 / p99 per strategy, one backend 5x slower
    python3 bench/routing_bench.py failover     # a backend dies under load: client errors, and
                                               # the time from the kill to the last of them

strategies: two mock-llm backends in one target group; backend `fast` streams 8 tokens with a
20 ms time to first token and 5 ms between tokens, backend `slow` five times slower (100 ms and
25 ms). sluice-load sends streamed chat completions open loop at RATE req/s (default 100) over 64
connections for DURATION s (default 15) per strategy; Sluice on core 0, the mocks and the load
on core 1. Prints each strategy's latency percentiles (the whole stream) and the share of
requests the slow backend got.

failover: two backends, weighted; a Python client sends small non-streamed requests at 200 req/s
(and holds 4 streams open at a time); at 3 s one backend is killed. Prints the client errors, and
the time from the kill to the last client error (0 errors: nothing to wait for).
"""
import json, os, socket, subprocess, sys, threading, time, http.client

BIN = os.environ.get("BIN", "target/release")
RATE = int(os.environ.get("RATE", "100"))
DURATION = int(os.environ.get("DURATION", "15"))
procs = []


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start(cmd, core, **kw):
    p = subprocess.Popen(["taskset", "-c", str(core), *cmd], **kw); procs.append(p); return p


def wait_port(port, secs=10):
    end = time.time() + secs
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close(); return True
        except OSError:
            time.sleep(0.05)
    return False


def mock(port, *args):
    p = start([f"{BIN}/mock-llm", "--listen", f"127.0.0.1:{port}", *args], 1, stdout=subprocess.DEVNULL)
    assert wait_port(port)
    return p


def stats(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/_mock/stats"); return json.loads(c.getresponse().read())


def sluice(config_text):
    path = f"/tmp/routing-bench-{os.getpid()}.toml"
    open(path, "w").write(config_text)
    port = int(config_text.split('listen = "127.0.0.1:')[1].split('"')[0])
    p = start([f"{BIN}/sluice", "--config", path], 0, stderr=subprocess.DEVNULL)
    assert wait_port(port), "sluice did not start"
    return p, port


def group_config(listen, fast, slow, strategy, extra="", scraped=False):
    cluster = "queue_metrics = true\n" if scraped else ""
    return f'''[server]
listen = "127.0.0.1:{listen}"
workers = 1
pin_workers = false
[clusters.fast]
backends = [{{ base_url = "http://127.0.0.1:{fast}/v1" }}]
{cluster}[clusters.slow]
backends = [{{ base_url = "http://127.0.0.1:{slow}/v1" }}]
{cluster}
[[routes]]
model = "gpt-4o"
groups = [{{ strategy = "{strategy}", targets = [{{ cluster = "fast" }}, {{ cluster = "slow" }}] }}]
{extra}'''


def strategies():
    fast, slow = free_port(), free_port()
    mock(fast, "--ttft-ms", "20", "--inter-token-ms", "5", "--tokens", "8")
    mock(slow, "--ttft-ms", "100", "--inter-token-ms", "25", "--tokens", "8")
    print(f"| strategy | req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | slow backend's share | errors |")
    print(f"| --- | --- | --- | --- | --- | --- | --- | --- |")
    # queue_aware twice: on this process's in-flight counts, and on the queues the mocks report
    # on /metrics (both vLLM's and SGLang's names on one page, read every 200 ms).
    runs = [(s, False) for s in ["weighted", "least_in_flight", "peak_ewma", "lowest_ttft", "latency_first", "queue_aware"]]
    runs.append(("queue_aware", True))
    for strategy, scraped in runs:
        listen = free_port()
        extra = "[routing]\nscrape_interval_ms = 200\n" if scraped else ""
        gw, port = sluice(group_config(listen, fast, slow, strategy, extra, scraped))
        before = (stats(fast)["requests"], stats(slow)["requests"])
        out = f"/tmp/routing-bench-{strategy}.json"
        subprocess.run(["taskset", "-c", "1", f"{BIN}/sluice-load", "--url", f"http://127.0.0.1:{port}/v1/chat/completions",
                        "--stream", "--rate", str(RATE), "--connections", "64", "--duration", f"{DURATION}s",
                        "--warmup", "2s", "--models", "gpt-4o", "--json", out], stdout=subprocess.DEVNULL, check=True)
        after = (stats(fast)["requests"], stats(slow)["requests"])
        j = json.load(open(out)); lat = j["latency"]
        to_fast, to_slow = after[0] - before[0], after[1] - before[1]
        share = to_slow / max(1, to_fast + to_slow)
        name = strategy + (" (scraped queues)" if scraped else "")
        print(f"| {name} | {j['rps']:.0f} | {lat['p50_ms']:.1f} | {lat['p90_ms']:.1f} | {lat['p99_ms']:.1f} | "
              f"{lat['p999_ms']:.1f} | {share:.1%} | {j['errors_total']} |", flush=True)
        gw.terminate(); gw.wait()


def failover():
    a, b = free_port(), free_port()
    ma = mock(a, "--ttft-ms", "5", "--inter-token-ms", "50", "--tokens", "40")
    mock(b, "--ttft-ms", "5", "--inter-token-ms", "50", "--tokens", "40")
    listen = free_port()
    gw, port = sluice(f'''[server]
listen = "127.0.0.1:{listen}"
workers = 1
pin_workers = false
[clusters.main]
backends = [{{ base_url = "http://127.0.0.1:{a}/v1" }}, {{ base_url = "http://127.0.0.1:{b}/v1" }}]
[[routes]]
model = "gpt-4o"
cluster = "main"
''')
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    stream_body = json.dumps({"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    stop = threading.Event(); errors = []; counts = {"small": 0, "streams": 0}; lock = threading.Lock()

    def small():
        conn = None; interval = 4 / 200; nxt = time.time()
        while not stop.is_set():
            nxt += interval; time.sleep(max(0, nxt - time.time()))
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse(); r.read()
                with lock:
                    counts["small"] += 1
                    if r.status != 200:
                        errors.append((time.time(), f"small {r.status}"))
            except Exception as e:
                conn = None
                with lock:
                    errors.append((time.time(), f"small {type(e).__name__}"))

    def streams():
        while not stop.is_set():
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("POST", "/v1/chat/completions", stream_body, {"Content-Type": "application/json"})
                r = c.getresponse(); data = r.read().decode(errors="replace"); c.close()
                with lock:
                    counts["streams"] += 1
                    if r.status != 200 or '"error"' in data or "[DONE]" not in data:
                        kind = "error event" if '"error"' in data else "no [DONE]"
                        errors.append((time.time(), f"stream {r.status} {kind}"))
            except Exception as e:
                with lock:
                    errors.append((time.time(), f"stream {type(e).__name__}"))

    threads = [threading.Thread(target=small) for _ in range(4)] + [threading.Thread(target=streams) for _ in range(int(os.environ.get("STREAMS", "4")))]
    [t.start() for t in threads]
    time.sleep(3)
    killed_at = time.time(); ma.kill(); ma.wait()
    time.sleep(7)
    stop.set(); [t.join() for t in threads]
    after_kill = [(t - killed_at, what) for t, what in errors if t >= killed_at - 0.01]
    print(json.dumps({
        "small_requests": counts["small"], "streams": counts["streams"],
        "errors_before_kill": len(errors) - len(after_kill),
        "errors_after_kill": len(after_kill),
        "kinds": sorted({w for _, w in after_kill}),
        "last_error_after_kill_ms": round(max((t for t, _ in after_kill), default=0) * 1000, 1),
    }, indent=1))
    gw.terminate(); gw.wait()


if __name__ == "__main__":
    try:
        {"strategies": strategies, "failover": failover}[sys.argv[1]]()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
