"""Request-body memory under slow uploads, with and without the per-worker cap.

N clients each announce an 8 MiB body and send half of it (64 KiB at a time, round robin), then
stall; prints Sluice's RSS before and after and how many were shed with a 503. One worker; the
config is written to /tmp/shedexp/c.toml. Run from the repository root after a build:

    python3 bench/shed_bodies.py target/debug/sluice target/debug/mock-llm 400 268435456
    python3 bench/shed_bodies.py target/debug/sluice target/debug/mock-llm 400 68719476736  # no cap

Results: perf/RESULTS.md, "Where Sluice sheds".
"""
import socket, subprocess, sys, time, os, re, threading
SLUICE, MOCK, N, CAP = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mock = subprocess.Popen([MOCK, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
line = mock.stdout.readline(); mport = re.search(r":(\d+)", line).group(1)
conf = f'''[server]
listen = "127.0.0.1:0"
workers = 1
pin_workers = false
max_body_memory_per_worker = {CAP}
[timeouts]
body_read_ms = 60000
body_total_ms = 120000
[clusters.main]
backends = [{{ base_url = "http://127.0.0.1:{mport}/v1" }}]
[[routes]]
model = "gpt-4o"
cluster = "main"
'''
os.makedirs("/tmp/shedexp", exist_ok=True)
open("/tmp/shedexp/c.toml","w").write(conf)
gw = subprocess.Popen([SLUICE, "--config", "/tmp/shedexp/c.toml"], stderr=subprocess.PIPE, text=True)
while True:
    l = gw.stderr.readline()
    m = re.search(r"listening on 127.0.0.1:(\d+)", l)
    if m: port = int(m.group(1)); break
def rss():
    for l in open(f"/proc/{gw.pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024
base = rss()
BODY = 8 * 1024 * 1024
socks, shed = [], 0
head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {BODY}\r\n\r\n".encode()
chunk = b" " * (64 * 1024)
for i in range(N):
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(head); socks.append(s)
time.sleep(0.5)
# Half of each body, 64 KiB at a time, round robin.
for rnd in range(64):
    for s in socks:
        try: s.sendall(chunk)
        except OSError: pass
time.sleep(1.0)
peak = rss()
for s in socks:
    s.setblocking(False)
    try:
        d = s.recv(4096)
        if d.startswith(b"HTTP/1.1 503"): shed += 1
    except (BlockingIOError, OSError): pass
print(f"cap={CAP} clients={N} sent=4MiB/8MiB each: RSS {base} MiB -> {peak} MiB, shed {shed} of {N}")
for s in socks: s.close()
gw.kill(); mock.kill()
