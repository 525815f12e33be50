#!/usr/bin/env python3
"""Time to first token of a translated stream against a passed-through one (issue #14), with the
release binaries.

    python3 bench/translation_ttft.py          # N=400 streams of each, interleaved

One mock-llm serves both APIs (`/v1/chat/completions` and `/v1/messages`, 8 tokens, first token
at once, 2 ms between tokens); Sluice routes `gpt-4o` to it as an OpenAI-dialect cluster and
`claude` to it as an Anthropic-dialect one (the chat completion goes out as a Messages request
and its events come back translated). A client sends the same streamed chat completion for each
model in turn, one at a time, and reads each stream to its end. Sluice's own `ttft_us` (request
received → first content chunk written to the client, from the access log) and the client's
time to its first content chunk are compared, median and p90. Sluice on core 0, the mock and
the client on core 1.
"""
import json, os, socket, subprocess, statistics, sys, tempfile, time, http.client

BIN = os.environ.get("BIN", "target/release")
N = int(os.environ.get("N", "400"))
procs = []


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def wait_port(port, secs=10):
    end = time.time() + secs
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close(); return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listening on {port}")


def start(cmd, core, **kw):
    p = subprocess.Popen(["taskset", "-c", str(core), *cmd], **kw); procs.append(p); return p


def first_token_ms(port, model):
    body = json.dumps({"model": model, "stream": True,
                       "messages": [{"role": "user", "content": "hello"}]})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    first = None
    for line in r:
        if first is None and line.startswith(b"data: {") and b'"content":"' in line:
            first = time.perf_counter()
    c.close()
    assert r.status == 200 and first is not None, (model, r.status)
    return (first - t0) * 1000


def pct(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(len(xs) * p))]


def main():
    logdir = tempfile.mkdtemp(prefix="ttft-")
    mport, sport = free_port(), free_port()
    start([f"{BIN}/mock-llm", "--listen", f"127.0.0.1:{mport}", "--tokens", "8",
           "--ttft-ms", "0", "--inter-token-ms", "2"], 1, stdout=subprocess.DEVNULL)
    wait_port(mport)
    config = f"""
[server]
listen = "127.0.0.1:{sport}"
workers = 1
[access_log]
dir = "{logdir}"
flush_interval_ms = 50
[clusters.openai]
backends = [{{ base_url = "http://127.0.0.1:{mport}/v1" }}]
[clusters.claude]
backends = [{{ base_url = "http://127.0.0.1:{mport}/v1" }}]
dialect = "anthropic"
credential = {{ env = "ANTHROPIC_KEY", header = "x-api-key" }}
[[routes]]
model = "gpt-4o"
cluster = "openai"
[[routes]]
model = "claude"
cluster = "claude"
"""
    path = os.path.join(logdir, "sluice.toml")
    open(path, "w").write(config)
    start([f"{BIN}/sluice", "--config", path], 0, stderr=subprocess.DEVNULL,
          env={**os.environ, "ANTHROPIC_KEY": "sk-ant-bench"})
    wait_port(sport)
    client = {"gpt-4o": [], "claude": []}
    for model in ("gpt-4o", "claude"):  # warm both paths
        first_token_ms(sport, model)
    for _ in range(N):
        for model in ("gpt-4o", "claude"):
            client[model].append(first_token_ms(sport, model))
    time.sleep(0.5)
    for p in procs[1:]:
        p.terminate(); p.wait()
    out = subprocess.run([f"{BIN}/sluice", "logs", *sorted(
        os.path.join(logdir, f) for f in os.listdir(logdir) if f.endswith(".pb"))],
        capture_output=True, text=True, check=True).stdout
    sluice = {"gpt-4o": [], "claude": []}
    for line in out.splitlines():
        rec = json.loads(line)
        if rec.get("ttft_us"):
            sluice[rec["requested_model"]].append(rec["ttft_us"] / 1000)
    print("| stream | n | Sluice ttft median (ms) | p90 | client ttft median (ms) | p90 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model, name in (("gpt-4o", "passed through (OpenAI dialect)"),
                        ("claude", "translated (Anthropic dialect)")):
        s, c = sluice[model], client[model]
        print(f"| {name} | {len(s)} | {statistics.median(s):.3f} | {pct(s, 0.9):.3f} | "
              f"{statistics.median(c):.3f} | {pct(c, 0.9):.3f} |")


try:
    main()
finally:
    for p in procs:
        if p.poll() is None:
            p.terminate()
