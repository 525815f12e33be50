#!/usr/bin/env python3
"""Saturation benchmarks (issue #42), with the release binaries.

    python3 bench/saturation.py priority   # interactive latency beside a batch flood
    python3 bench/saturation.py fairness   # two keys of one class, offered 4:1, weights 1:1 / 3:1

The backend is one mock-llm with `--max-running CAP` (default 4): it answers CAP requests at once,
each after a fixed service time (`x-mock-delay-ms`, default 100 ms), and queues the rest in its
own FIFO, as vLLM does. Capacity is CAP / service time (40 req/s by default).

priority: interactive requests arrive open loop (Poisson) at half the capacity from one key; a
batch key keeps 3 x CAP requests in flight (closed loop: the offered load stays above twice the
capacity). Three runs of DURATION s (default 15): interactive alone, with the flood and queueing
on (`[saturation]`, the target's `max_in_flight = CAP`), and with the flood and queueing off
(today's behaviour: everything goes to the backend, whose FIFO decides). Prints the interactive
requests' latency p50 / p99 (the mock answers whole, after its service time: the latency is the
time to the first byte), how many each key got through and, with queueing, how many requests
went out of the queue and how many of those left while a better waiter waited on the other
worker (`sluice_queue_inversions_total`).

fairness: two keys in one class, key A with 4 x CAP clients in a closed loop, key B with CAP
(offered 4:1; each alone could fill the backend, so both always have requests waiting). Counts each key's completions over DURATION s and
prints the shares and Jain's index; then the same with A's queue_weight = 3.

Sluice runs on core 0 with two workers; the mock and the clients on core 1.
"""
import http.client, json, os, random, socket, subprocess, sys, threading, time

BIN = os.environ.get("BIN", "target/release")
CAP = int(os.environ.get("CAP", "4"))
SERVICE_MS = int(os.environ.get("SERVICE_MS", "100"))
DURATION = float(os.environ.get("DURATION", "15"))
procs = []

KEYS = {"interactive": "sk-bench-interactive", "batch": "sk-bench-batch",
        "a": "sk-bench-a", "b": "sk-bench-b"}


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


def sha(key):
    import hashlib
    return hashlib.sha256(key.encode()).hexdigest()


def config(listen, mock, queueing, weight_a=1, admin=None):
    keys = "".join(f'''
[[keys]]
id = "{name}"
sha256 = "{sha(key)}"
{'class = "' + ('batch' if name != 'interactive' else 'interactive') + '"' if queueing else ''}
{f'queue_weight = {weight_a}' if queueing and name == 'a' else ''}
''' for name, key in KEYS.items())
    saturation = '''
[saturation]
classes = [{ name = "interactive", max_wait_ms = 60000 }, { name = "batch", max_wait_ms = 600000 }]
max_queued_per_worker = 4096
''' if queueing else ""
    cap = f", max_in_flight = {CAP}" if queueing else ""
    admin_section = f'[admin]\nlisten = "127.0.0.1:{admin}"\n' if admin else ""
    return f'''[server]
listen = "127.0.0.1:{listen}"
workers = 2
pin_workers = false
{admin_section}[upstream]
max_connections_per_backend = 512
[clusters.vllm]
backends = [{{ base_url = "http://127.0.0.1:{mock}/v1" }}]
[[routes]]
model = "*"
groups = [{{ targets = [{{ cluster = "vllm"{cap} }}] }}]
{saturation}{keys}'''


def up(queueing, weight_a=1):
    mport, sport, aport = free_port(), free_port(), free_port()
    m = start([f"{BIN}/mock-llm", "--listen", f"127.0.0.1:{mport}", "--max-running", str(CAP)], 1,
              stdout=subprocess.DEVNULL)
    assert wait_port(mport)
    path = f"/tmp/saturation-bench-{os.getpid()}.toml"
    open(path, "w").write(config(sport, mport, queueing, weight_a, aport))
    s = start([f"{BIN}/sluice", "--config", path], 0, stderr=subprocess.DEVNULL)
    assert wait_port(sport), "sluice did not start"
    global ADMIN
    ADMIN = aport
    return m, s, sport


ADMIN = None


def scrape(name, **labels):
    """The sum of a family's samples whose labels include `labels`, from Sluice's /metrics."""
    c = http.client.HTTPConnection("127.0.0.1", ADMIN, timeout=5)
    c.request("GET", "/metrics")
    total = 0.0
    for line in c.getresponse().read().decode().splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def down(*ps):
    for p in ps:
        p.terminate(); p.wait()


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def one(port, key, conn=None):
    """One request; (latency s, status, the connection to reuse)."""
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t = time.perf_counter()
    try:
        c.request("POST", "/v1/chat/completions", BODY, {
            "Authorization": f"Bearer {key}", "Content-Type": "application/json",
            "x-mock-delay-ms": str(SERVICE_MS)})
        r = c.getresponse(); r.read()
        return time.perf_counter() - t, r.status, c
    except Exception:
        c.close()
        return time.perf_counter() - t, 0, None


def closed_loop(port, key, clients, until, counts, name):
    def run():
        c = None
        while time.time() < until:
            _, status, c = one(port, key, c)
            if time.time() < until and status == 200:
                counts[name] = counts.get(name, 0) + 1
    ts = [threading.Thread(target=run) for _ in range(clients)]
    for t in ts:
        t.start()
    return ts


def open_loop(port, key, rate, until, lat):
    def fire():
        dt, status, c = one(port, key)
        if c:
            c.close()
        if status == 200:
            lat.append(dt)
    ts = []
    t = time.time()
    while t < until:
        t += random.expovariate(rate)
        time.sleep(max(0, t - time.time()))
        th = threading.Thread(target=fire); th.start(); ts.append(th)
    return ts


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")


def priority():
    capacity = CAP * 1000 / SERVICE_MS
    for label, queueing, flood in [("no flood", True, False), ("flood, queueing on", True, True),
                                   ("flood, queueing off", False, True)]:
        m, s, port = up(queueing)
        until = time.time() + DURATION
        counts, lat = {}, []
        threads = closed_loop(port, KEYS["batch"], 3 * CAP, until, counts, "batch") if flood else []
        time.sleep(1 if flood else 0)
        threads += open_loop(port, KEYS["interactive"], capacity / 2, until, lat)
        for t in threads:
            t.join()
        inv = scrape("sluice_queue_inversions_total")
        sent = scrape("sluice_queue_total", outcome="dispatched")
        down(s, m)
        print(f"{label:22} interactive n={len(lat):4} p50={pct(lat, .5):7.1f} ms "
              f"p99={pct(lat, .99):7.1f} ms   batch done={counts.get('batch', 0)}"
              + (f"   dispatched from the queue={sent:.0f}, cross-worker inversions={inv:.0f}"
                 if queueing else ""))


def fairness():
    for weight in (1, 3):
        m, s, port = up(True, weight)
        until = time.time() + DURATION
        counts = {}
        ts = closed_loop(port, KEYS["a"], 4 * CAP, until, counts, "a")
        ts += closed_loop(port, KEYS["b"], CAP, until, counts, "b")
        for t in ts:
            t.join()
        down(s, m)
        a, b = counts.get("a", 0), counts.get("b", 0)
        x = [a / weight, b]
        jain = sum(x) ** 2 / (2 * sum(v * v for v in x)) if a and b else 0
        print(f"weights {weight}:1  A={a} B={b}  A share={a / max(1, a + b):.3f}  "
              f"A:B={a / max(1, b):.2f}  Jain (per weight)={jain:.3f}")


if __name__ == "__main__":
    try:
        {"priority": priority, "fairness": fairness}[sys.argv[1]]()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
