"""What translating hostile and large Messages bodies costs a worker (Hostile clients II, item 4).

One worker, an OpenAI-dialect mock behind it, an Anthropic client's `/v1/messages`. For each case,
a neighbour on its own connection asks the same worker for `/v1/models` every 2 ms while the case
runs; prints the case's status and time, the neighbour's slowest answer, and the process's peak
RSS growth (VmHWM against VmRSS before). Cases:

- `250k-blocks`: 250,000 text blocks (7.4 MB): refused from its shape (400).
- `250k-blocks x20`: twenty of them at once.
- `9k-blocks`: 9,000 tiny blocks (45,000 values, near the default limit of 50,000): translated.
- `1k-large-blocks`: 1,000 blocks of 4 KB (4 MB): translated.

Run from the repository root after a release build:

    python3 bench/translation_bounds.py target/release/sluice target/release/mock-llm

Results: perf/RESULTS.md, "Translation bounds".
"""
import json, os, re, socket, subprocess, sys, threading, time

SLUICE, MOCK = sys.argv[1], sys.argv[2]
KEY = "sk-translation-bench"
mock = subprocess.Popen([MOCK, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
mport = re.search(r":(\d+)", mock.stdout.readline()).group(1)
digest = __import__("hashlib").sha256(KEY.encode()).hexdigest()
conf = f'''[server]
listen = "127.0.0.1:0"
workers = 1
pin_workers = false
[http]
max_body_bytes = 16777216
[timeouts]
body_read_ms = 60000
body_total_ms = 120000
[clusters.main]
backends = [{{ base_url = "http://127.0.0.1:{mport}/v1" }}]
[[routes]]
model = "gpt-4o"
cluster = "main"
[[keys]]
id = "k"
sha256 = "{digest}"
'''
os.makedirs("/tmp/translation-bounds", exist_ok=True)
open("/tmp/translation-bounds/c.toml", "w").write(conf)
gw = subprocess.Popen([SLUICE, "--config", "/tmp/translation-bounds/c.toml"],
                      stderr=subprocess.PIPE, text=True)
while True:
    m = re.search(r"listening on 127.0.0.1:(\d+)", gw.stderr.readline())
    if m:
        port = int(m.group(1))
        break


def status_kb(field):
    for line in open(f"/proc/{gw.pid}/status"):
        if line.startswith(field):
            return int(line.split()[1])


def read_response(s):
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        rest += s.recv(65536)
    return int(head.split(b" ")[1]), rest[:length]


def blocks(n, text):
    block = json.dumps({"type": "text", "text": text}, separators=(",", ":"))
    return ('{"model":"gpt-4o","max_tokens":16,"messages":[{"role":"user","content":['
            + ",".join([block] * n) + "]}]}").encode()


def messages(body, out, i):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: {KEY}\r\n"
              f"anthropic-version: 2023-06-01\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    out[i] = read_response(s)[0]
    s.close()


def case(name, body, copies=1):
    busy, slowest = [True], [0.0]

    def neighbour():
        s = socket.create_connection(("127.0.0.1", port))
        while busy[0]:
            t = time.perf_counter()
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            assert read_response(s)[0] == 200
            slowest[0] = max(slowest[0], time.perf_counter() - t)
            time.sleep(0.002)
        s.close()

    before = status_kb("VmRSS")
    # VmHWM only rises: reset it (Linux ≥ 4.0) so each case reads its own peak.
    open(f"/proc/{gw.pid}/clear_refs", "w").write("5")
    n = threading.Thread(target=neighbour)
    n.start()
    time.sleep(0.05)
    statuses = [None] * copies
    t = time.perf_counter()
    threads = [threading.Thread(target=messages, args=(body, statuses, i)) for i in range(copies)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.perf_counter() - t
    time.sleep(0.05)
    busy[0] = False
    n.join()
    grown = (status_kb("VmHWM") - before) / 1024
    print(f"{name:18} body {len(body) / 1e6:5.2f} MB  status {sorted(set(statuses))}  "
          f"took {took * 1000:7.1f} ms  neighbour slowest {slowest[0] * 1000:6.1f} ms  "
          f"peak RSS +{grown:6.1f} MiB")


try:
    case("250k-blocks", blocks(250_000, "hello"))
    case("250k-blocks x20", blocks(250_000, "hello"), copies=20)
    case("9k-blocks", blocks(9_000, "hello"))
    case("1k-large-blocks", blocks(1_000, "a" * 4_000))
finally:
    gw.kill()
    mock.kill()
