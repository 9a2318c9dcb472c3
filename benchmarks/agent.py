"""CPU cost of the node agent: 8 stand-in GPUs at 1 Hz while an NCCL log grows at 1,000 lines/s.

Runs the real ``clusterdx agent`` process (real pynvml against the stand-in libnvidia-ml.so.1 from tests/agent,
the NCCL log source tailing a file this script appends to, the spool, gzip and HTTP delivery to a local receiver)
and reads the agent's CPU time (user + system) from /proc through psutil after a warm-up. Goal: under 1% of one
core. The stand-in answers NVML calls faster than a real driver, whose time in the kernel this cannot measure.

    .venv/bin/python benchmarks/agent.py [--seconds 30] [--lines-per-s 1000] [--sources gpu,hooks,nccl,host]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
ALL_SOURCES = ("gpu", "hooks", "host", "ib", "kmsg", "nccl", "probes")
NCCL_LINES = (
    "gpu-node-01:{pid}:{tid} [{r}] NCCL INFO Channel {c:02d}/32 : 0[{r}] -> 1[{n}] via P2P/IPC/read\n",
    "gpu-node-01:{pid}:{tid} [{r}] NCCL INFO comm 0x55d1c3e0 rank {r} nranks 8 cudaDev {r} busId 18000 "
    "- Init COMPLETE\n",
    "gpu-node-01:{pid}:{tid} [{r}] NCCL INFO AllReduce: opCount {c:x} sendbuff 0x7f1 recvbuff 0x7f2 count 262144 "
    "datatype 7 op 0 root 0 comm 0x55d1c3e0 [nranks=8] stream 0x55d1\n",
    "gpu-node-01:{pid}:{tid} [{r}] NCCL INFO Connected all rings\n",
)


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    batches = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Sink.batches += 1
        body = b'{"status":"accepted","seq":0}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def build_standin(out: Path) -> Path:
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libnvidia-ml.so.1", "-o",
                    str(out / "libnvidia-ml.so.1"), str(REPO / "tests/agent/standin_nvml.c")], check=True)
    return out


def write_nccl(path: Path, lines_per_s: int, stop: threading.Event, written: list[int]) -> None:
    """Append ``lines_per_s`` NCCL lines per second, in 100 small writes a second as NCCL itself would."""
    tick, n = 0.01, 0
    per_tick = max(1, lines_per_s // 100)
    next_t = time.monotonic()
    with open(path, "a", buffering=1) as fh:
        while not stop.is_set():
            fh.write("".join(NCCL_LINES[(n + i) % 4].format(pid=4242, tid=4300, r=(n + i) % 8, n=(n + i + 1) % 8,
                                                            c=(n + i) % 32) for i in range(per_tick)))
            n += per_tick
            next_t += tick
            time.sleep(max(0.0, next_t - time.monotonic()))
    written.append(n)


def run(seconds: float, lines_per_s: int, sources: set[str], warmup: float = 4.0) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cdx-agent-bench-"))
    lib = build_standin(tmp)
    (tmp / "scenario.txt").write_text("gpus 8\n0 3 ecc_sbe_volatile 0 1\n")
    (tmp / "token").write_text("bench-token\n")
    nccl_log = tmp / "nccl.gpu-node-01.4242.log"
    nccl_log.touch()
    options = {name: {"enabled": "true" if name in sources else "false"} for name in ALL_SOURCES}
    options["nccl"]["glob"] = f'"{tmp}/nccl.*.log"'
    options["hooks"]["addr"] = '"127.0.0.1:0"'
    tables = "".join(f"[sources.{name}]\n" + "".join(f"{k} = {v}\n" for k, v in opts.items())
                     for name, opts in options.items())
    (tmp / "agent.toml").write_text(f'agent_id = "bench"\ninterval_s = 1.0\nspool_path = "{tmp}/spool.sqlite3"\n'
                                    + tables)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "CLUSTERDX_STANDIN_NVML": str(tmp / "scenario.txt")}
    with open(tmp / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "clusterdx", "agent", "--server",
                                 f"http://127.0.0.1:{server.server_address[1]}", "--token-file", str(tmp / "token"),
                                 "--config", str(tmp / "agent.toml")], cwd=REPO, env=env, stderr=log)
    stop, written = threading.Event(), []
    writer = threading.Thread(target=write_nccl, args=(nccl_log, lines_per_s, stop, written), daemon=True)
    writer.start()
    try:
        ps = psutil.Process(proc.pid)
        time.sleep(warmup)  # imports and NVML start-up are a one-off, not the steady state
        c0, t0, b0 = sum(ps.cpu_times()[:2]), time.monotonic(), Sink.batches
        time.sleep(seconds)
        c1, t1, b1 = sum(ps.cpu_times()[:2]), time.monotonic(), Sink.batches
        rss = ps.memory_info().rss
    finally:
        stop.set()
        writer.join()
        proc.terminate()
        proc.wait(timeout=10)
        server.shutdown()
    log_text = (tmp / "agent.log").read_text()
    if proc.returncode not in (0, -15):
        print(log_text[-3000:], file=sys.stderr)
    summary = [line.strip() for line in log_text.splitlines() if line.startswith("  ") and " on  " in line]
    return {"cpu_pct": 100 * (c1 - c0) / (t1 - t0), "cpu_s": c1 - c0, "wall_s": t1 - t0,
            "batches": b1 - b0, "rss_mb": rss / 2**20, "nccl_lines": written[0] if written else 0,
            "active": summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--lines-per-s", type=int, default=1000)
    p.add_argument("--sources", default="gpu,hooks,nccl", help="comma-separated sources to enable")
    args = p.parse_args()
    sources = set(args.sources.split(","))
    if "nccl" in sources and not (REPO / "collectors/sources/nccl_tail.py").exists():
        print("collectors/sources/nccl_tail.py is not there: measuring without the NCCL log source")
        sources.discard("nccl")
    r = run(args.seconds, args.lines_per_s, sources)
    print(f"agent, 8 stand-in GPUs at 1 Hz, sources {','.join(sorted(sources))}, NCCL log "
          f"{args.lines_per_s if 'nccl' in sources else 0} lines/s:")
    print(f"  CPU {r['cpu_s']:.3f} s over {r['wall_s']:.1f} s = {r['cpu_pct']:.2f}% of one core "
          f"(goal < 1%: {'met' if r['cpu_pct'] < 1 else 'MISSED'})")
    print("  active sources:\n" + "\n".join(f"    {line}" for line in r["active"]))
    print(f"  batches delivered {r['batches']}, NCCL lines written {r['nccl_lines']}, RSS {r['rss_mb']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
