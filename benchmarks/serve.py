"""Throughput and latency of ``meshplan serve`` under concurrent clients, against serving
one request at a time.

Three servers behind the same HTTP front (``meshplan.serving.app``, OpenAI API, streamed),
each loaded with the same requests by ``--clients`` concurrent clients (loopback only,
``--requests`` in all, prompts of mixed lengths as token ids, mixed ``max_tokens``, greedy):

- **continuous**: ``mpiexec -n R meshplan serve`` on a plan of ``--batch`` slots (a shared
  key/value buffer: requests take slots between steps);
- **meshplan 1-at-a-time**: the same model planned at batch 1, so requests queue and run
  one after another;
- **genai 1-at-a-time**: onnxruntime-genai's generator, one request at a time, behind the
  same front (what its users write: it takes one batch at a time), ``--genai-threads``;
- **continuous without prefix caching** (``serve --no-prefix-cache``), with
  ``--system-prompt TOKENS``: every prompt then begins with the same TOKENS tokens, and the
  ratio of the two servers' TTFT p50 is printed (with ``meshplan_prefix_cache_reused_positions_total``).

``--n K`` asks K choices per request of the continuous servers, and adds
**continuous-separate**: the same server sent each request as K separate ones (so do the
one-at-a-time servers); output tokens/s count every choice's tokens. ``--logprobs K`` adds
**continuous-logprobs**: the same requests asking ``logprobs`` K, and prints what that
costs on the time per output token.

The server's overhead: once the continuous server has run, ``meshplan generate`` runs on
its plan at its batch (``--batch`` prompts of the requests' mean lengths, greedy), and the
time per output token p50 of the server's ``/metrics`` (its histogram, interpolated) is
printed against the decode step of ``generate`` (the median of ``--generate-rounds`` runs).

The model is a Llama in the builder's format of ``--gigabytes`` in float32
(``sample_models.genai_large``, written into ``--workdir``), or the builder folder
``--folder`` names (its files linked into ``--workdir``, where its configuration takes
``--genai-threads``). The genai server is left out, in one line, where onnxruntime-genai
is not installed. Printed per server: output
tokens/s over the whole run, TTFT p50/p99, time per output token p50/p99 (per request:
from its first to its last token over the tokens between), failed requests, and the
server's resident memory (rank 0) before the load, once a quarter of the requests are
done, and at the end (flat when the last two agree). The exit status is 1 when a server
answered no request.

    python benchmarks/serve.py --gigabytes 0.4 --clients 8 --requests 64 [--json PATH]
    python benchmarks/serve.py --only continuous --clients 16 --requests 200   # nothing lost
    python benchmarks/serve.py --folder sample_models/genai/llama_fp32 --max-length 64 --batch 2 --clients 2 \
        --requests 4 --prompt-lengths 4:8 --new-tokens 4:8    # the 1 MB sample: every server in seconds
    python benchmarks/serve.py --folder sample_models/genai/llama_fp32 --max-length 1024 --system-prompt 512 \
        --only continuous --only continuous-no-prefix --clients 4 --requests 32 --prompt-lengths 8:16 --new-tokens 8:16
    python benchmarks/serve.py --folder sample_models/genai/llama_fp32 --max-length 256 --n 4 \
        --only continuous --only continuous-separate --clients 2 --requests 16
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("continuous", "continuous-no-prefix", "continuous-separate", "continuous-logprobs", "meshplan-one",
           "genai-one")
CONTINUOUS = ("continuous", "continuous-no-prefix", "continuous-separate", "continuous-logprobs")
BIN = Path(sys.executable).parent
MPIEXEC = [str(BIN / "mpiexec")]     # --mpiexec's words, where given
MESHPLAN = [str(BIN / "meshplan")]   # --meshplan's
PROVIDER = ["auto"]                  # --provider
START_SECONDS = 300


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def rss_bytes(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else 0


class Server:
    """A server process whose first lines say its address (and rank 0's pid)."""

    def __init__(self, command: list[str]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                   PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        began = time.monotonic()
        self.url = self.pid = None
        while time.monotonic() - began < START_SECONDS:
            text = "\n".join(self.lines)
            url = re.search(r" on (http://\S+)", text)
            pid = re.search(r"^rank 0: pid (\d+)", text, re.M)
            if url and pid:
                self.url, self.pid = url.group(1), int(pid.group(1))
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise SystemExit("the server did not start:\n" + "\n".join(self.lines))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def one_request(url: str, body: dict) -> dict:
    """Stream one completion; the arrival time of each token."""
    parts = urlparse(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    started = time.perf_counter()
    times, error = [], None
    try:
        connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {response.read()[:200]!r}", "times": [], "started": started}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                break
            now = time.perf_counter()
            times.extend([now] * sum(len(c.get("token_ids") or []) for c in event["choices"]))
    except (OSError, http.client.HTTPException) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    return {"error": error, "times": times, "started": started}


def load(url: str, requests: list[dict], clients: int, pid: int | None = None) -> dict:
    """Run the requests from ``clients`` threads; the server's RSS (rank 0, ``pid``) is
    sampled as they go."""
    results: list[dict] = []
    lock = threading.Lock()
    pending = list(requests)

    def client():
        while True:
            with lock:
                if not pending:
                    return
                body = pending.pop(0)
            result = one_request(url, body)
            with lock:
                results.append(result)

    began = time.perf_counter()
    workers = [threading.Thread(target=client) for _ in range(clients)]
    for worker in workers:
        worker.start()
    samples = []   # (requests finished, RSS)
    while any(w.is_alive() for w in workers):
        if pid is not None:
            samples.append((len(results), rss_bytes(pid)))
        time.sleep(0.25)
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    if pid is not None:
        samples.append((len(results), rss_bytes(pid)))
    done = [r for r in results if not r["error"] and r["times"]]
    ttft = [r["times"][0] - r["started"] for r in done]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in done if len(r["times"]) > 1]
    tokens = sum(len(r["times"]) for r in done)
    return {"requests": len(requests), "failed": len(results) - len(done) + (len(requests) - len(results)),
            "errors": sorted({r["error"] for r in results if r["error"]})[:3], "output_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            # memory once a quarter of the requests are done, and at the end: flat when equal
            "rss_quarter_mb": next((m / 2**20 for n, m in samples if n >= len(requests) // 4), 0.0),
            "rss_end_mb": samples[-1][1] / 2**20 if samples else 0.0}


def metrics_text(url: str) -> str:
    """The server's /metrics ("" where it answers none)."""
    parts = urlparse(url)
    try:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        connection.request("GET", "/metrics")
        return connection.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return ""


def metric(url: str, name: str) -> float:
    """A counter of the server's /metrics (0 where it has none: another server)."""
    text = metrics_text(url)
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def metric_quantile(url: str, name: str, q: float) -> float | None:
    """The ``q`` quantile of a histogram of the server's /metrics, interpolated within its
    bucket as Prometheus's ``histogram_quantile`` does (None where it has no samples)."""
    text = metrics_text(url)
    buckets = sorted((float(le), float(count)) for le, count in
                     re.findall(rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M))
    if not buckets or buckets[-1][1] == 0:
        return None
    rank, below, lower = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        below, lower = count, upper
    return lower


def generate_step(plan: Path, ranks: int, requests: list[dict], rows: int, workdir: Path,
                  rounds: int = 3) -> float | None:
    """``meshplan generate``'s decode step (seconds) on ``plan`` at ``rows`` prompts of the
    requests' mean prompt length and mean new tokens: the median of ``rounds`` runs."""
    length = max(1, round(sum(len(r["prompt"]) for r in requests) / len(requests)))
    new = max(2, round(sum(r["max_tokens"] for r in requests) / len(requests)))
    prompts = [(r["prompt"] * length)[:length] for r in (requests * rows)[:rows]]
    ids, out = workdir / "generate_prompts.json", workdir / "generate.json"
    ids.write_text(json.dumps(prompts))
    steps = []
    for _ in range(rounds):
        done = subprocess.run([*MPIEXEC, "-n", str(ranks), *MESHPLAN, "generate", str(plan),
                               "--prompt-ids", str(ids), "--max-new-tokens", str(new), "--output", str(out),
                               "--provider", PROVIDER[0]],
                              capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            print(f"meshplan generate failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            return None
        steps.append(json.loads(out.read_text())["metrics"]["time_per_output_token_seconds"])
    return percentile(steps, 50)


def make_requests(count: int, vocab: int, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int],
                  context: int, seed: int = 0, system: int = 0, n: int = 1) -> list[dict]:
    """Random prompts and token counts, each within the context; every prompt begins with
    the same ``system`` tokens (a shared system prompt) where asked; ``n`` choices each."""
    rng = random.Random(seed)
    shared = [random.Random(-1).randrange(3, vocab) for _ in range(system)]
    found = []
    for _ in range(count):
        prompt = shared + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lengths))]
        prompt = prompt[:context - 2]
        found.append({"prompt": prompt, "max_tokens": min(rng.randint(*new_tokens), context - len(prompt)),
                      "temperature": 0, "ignore_eos": True, **({"n": n} if n > 1 else {})})
    return found   # (ignore_eos: every server generates the same counts)


def genai_front(folder: str, host: str, port: int, capacity: int) -> None:
    """onnxruntime-genai's generator, one request at a time, behind meshplan's HTTP front."""
    import uvicorn

    import onnxruntime_genai as og

    sys.path.insert(0, str(REPO))
    from meshplan.model.llm import ModelFolder
    from meshplan.serving.app import build_app
    from meshplan.serving.engine import Engine
    from meshplan.serving.metrics import ServerMetrics
    from meshplan.serving.protocol import Limits

    model = og.Model(folder)

    class OneAtATime:
        rows = 1

        def __init__(self):
            self.work = self.generator = None
            self.made = []     # the kinds of calls made (the engine counts them)

        @property
        def busy(self):
            return [self.work] if self.work is not None else []

        def accepts(self, work=None):
            return self.work is None

        def admit(self, work):
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=capacity, do_sample=False)
            self.generator = og.Generator(model, params)
            self.work, self.fresh = work, True

        def release(self, work):
            self.work = self.generator = None

        def room(self, work):
            return capacity - len(work.prompt) - len(work.ids)

        def step(self):
            if self.fresh:
                self.generator.append_tokens([self.work.prompt])
                self.fresh = False
                self.made.append("prompts")
            else:
                self.made.append("decode")
            self.generator.generate_next_token()
            return [(self.work, int(self.generator.get_next_tokens()[0]))]

    info = ModelFolder.read(Path(folder) / "model.onnx")
    metrics = ServerMetrics()
    engine = Engine(OneAtATime(), info.eos_ids, metrics, max_queue=10_000)
    app = build_app(engine, Limits("genai", capacity, info.vocab_size), metrics)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="off"))
    sock_ready = threading.Thread(target=server.run, daemon=True)
    sock_ready.start()
    while not server.started:
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    print(f"serving genai on http://{bound[0]}:{bound[1]}", flush=True)
    print(f"rank 0: pid {os.getpid()}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    engine.run(stop)
    server.should_exit = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=0.4, help="size of the float32 builder model")
    parser.add_argument("--folder", type=Path, help="a builder folder to serve instead of writing a model")
    parser.add_argument("--workdir", type=Path, help="where the model and plans go [default: a temporary folder]")
    parser.add_argument("--mesh", default="1x1", help="the plans' mesh (ranks = its product)")
    parser.add_argument("--batch", type=int, default=8, help="slots of the continuous server's plan")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-lengths", default="8:48", help="LO:HI tokens per prompt")
    parser.add_argument("--new-tokens", default="32:96", help="LO:HI max_tokens per request")
    parser.add_argument("--genai-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--system-prompt", type=int, default=0, metavar="TOKENS",
                        help="every prompt begins with the same TOKENS tokens (a shared system prompt); the "
                             "continuous server then also runs without prefix caching (continuous-no-prefix)")
    parser.add_argument("--n", type=int, default=1, help="choices per request (the one-at-a-time servers take "
                                                          "n separate requests instead)")
    parser.add_argument("--logprobs", type=int, default=0, metavar="K",
                        help="also run the continuous server's requests asking logprobs K (continuous-logprobs)")
    parser.add_argument("--generate-rounds", type=int, default=3,
                        help="runs of meshplan generate whose median decode step the server is set against")
    parser.add_argument("--only", choices=SERVERS, action="append",
                        help="run only these servers (repeatable)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON here")
    parser.add_argument("--provider", default="auto", metavar="auto|cuda|cpu",
                        help="the meshplan servers' execution provider [default: auto]")
    parser.add_argument("--device", default="cpu", help="the plans' device preset [default: cpu]")
    parser.add_argument("--solver", help="the plans' ILP solver (meshplan plan --solver) [default: meshplan's]")
    parser.add_argument("--mpiexec", help="the launcher and its options, one string [default: this Python's mpiexec]")
    parser.add_argument("--meshplan", help="the meshplan command, one string [default: this Python's meshplan]")
    parser.add_argument("--genai-front", nargs=4, metavar=("FOLDER", "HOST", "PORT", "CAPACITY"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.genai_front:
        folder, host, port, capacity = args.genai_front
        genai_front(folder, host, int(port), int(capacity))
        return 0
    if args.mpiexec:
        MPIEXEC[:] = args.mpiexec.split()
    if args.meshplan:
        MESHPLAN[:] = args.meshplan.split()
    PROVIDER[0] = args.provider
    sys.path.insert(0, str(REPO))
    from sample_models.genai_large import write_builder_llama

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="meshplan-serve-"))
    if args.folder:   # its files linked, its configuration copied (the genai threads are written into it)
        source = args.folder.resolve() / "model.onnx"   # (what the plans read: onnx takes no linked data)
        folder = workdir / args.folder.resolve().name
        folder.mkdir(parents=True, exist_ok=True)
        for item in args.folder.resolve().iterdir():
            if item.is_file() and item.name != "genai_config.json" and not (folder / item.name).exists():
                (folder / item.name).symlink_to(item)
        (folder / "genai_config.json").write_text((args.folder / "genai_config.json").read_text())
    else:
        folder = workdir / f"builder_fp32_{args.gigabytes}"
        if not (folder / "model.onnx").exists():
            write_builder_llama(folder, args.gigabytes, context=args.max_length)
        source = folder / "model.onnx"
    ranks = eval(args.mesh.replace("x", "*"))
    plans = {}
    optional = {"continuous-no-prefix": args.system_prompt, "continuous-separate": args.n > 1,
                "continuous-logprobs": args.logprobs > 0}
    running = [n for n in SERVERS if (not args.only or n in args.only)
               and (optional.get(n, True) or (args.only and n in args.only))]
    batches = ({args.batch} if set(CONTINUOUS) & set(running) else set()) \
        | ({1} if "meshplan-one" in running else set())
    for batch in sorted(batches):   # (only those of the servers that run)
        out = workdir / f"plan_{args.mesh}_b{batch}_{args.max_length}"
        if not (out / "plan.json").exists():
            policy = ["--policy", "megatron", "--max-stages", "1"] if ranks > 1 else []
            done = subprocess.run([*MESHPLAN, "plan", str(source), "--mesh", args.mesh,
                                   "--device", args.device, "--generate", *(["--solver", args.solver] if args.solver else []), "--batch", str(batch), "--max-length",
                                   str(args.max_length), "--prefill-chunk", str(args.max_length), *policy,
                                   "-o", str(out)], capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                raise SystemExit(f"meshplan plan failed: {done.stderr.strip()}")
        plans[batch] = out
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = args.genai_threads
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    vocab = config["model"]["vocab_size"]
    lo, hi = map(int, args.prompt_lengths.split(":"))
    new_lo, new_hi = map(int, args.new_tokens.split(":"))
    requests = make_requests(args.requests, vocab, (lo, hi), (new_lo, new_hi), args.max_length,
                             system=args.system_prompt, n=args.n)
    # the one-at-a-time servers take a request of n choices as n requests
    separate = [{k: v for k, v in r.items() if k != "n"} for r in requests for _ in range(args.n)]
    serve = [*MPIEXEC, "-n", str(ranks), *MESHPLAN, "serve", "--port", "0", "--provider", args.provider,
             "--max-queue", str(args.requests + 1)]
    servers = {
        "continuous": lambda: Server(serve + [str(plans[args.batch])]),
        "continuous-no-prefix": lambda: Server(serve + ["--no-prefix-cache", str(plans[args.batch])]),
        "continuous-separate": lambda: Server(serve + [str(plans[args.batch])]),
        "continuous-logprobs": lambda: Server(serve + [str(plans[args.batch])]),
        "meshplan-one": lambda: Server(serve + [str(plans[1])]),
        "genai-one": lambda: Server([sys.executable, str(Path(__file__).resolve()), "--genai-front", str(folder),
                                     "127.0.0.1", "0", str(args.max_length)]),
    }
    rows, nan = [], float("nan")   # (no TPOT where every request got one token)
    model = args.folder or f"{args.gigabytes} GB float32"
    print(f"model {model}, mesh {args.mesh}, {args.clients} clients, {args.requests} requests "
          f"(prompts {lo}-{hi} tokens, {new_lo}-{new_hi} new), {os.cpu_count()} cores")
    for name, start in servers.items():
        if name not in running:
            continue
        if name == "genai-one" and importlib.util.find_spec("onnxruntime_genai") is None:
            print(f"{name:14s} skipped: onnxruntime-genai is not installed", flush=True)
            continue
        server = start()
        try:
            load(server.url, make_requests(2, vocab, (lo, hi), (4, 4), args.max_length, seed=1), 2)   # warm
            before = rss_bytes(server.pid)
            given = requests if name in ("continuous", "continuous-no-prefix") else separate
            if name == "continuous-logprobs":
                given = [{**r, "logprobs": args.logprobs} for r in requests]
            row = {"server": name, **load(server.url, given, args.clients, server.pid)}
            row["prefix_reused_positions"] = metric(server.url, "meshplan_prefix_cache_reused_positions_total")
            row["tpot_metrics_p50_s"] = metric_quantile(server.url, "meshplan_time_per_output_token_seconds", 0.5)
            row["rss_before_mb"] = before / 2**20
            if server.process.poll() is not None:   # what it said last tells why its requests failed
                row["server_exit"] = next((line for line in reversed(server.lines) if line.strip()), "")
        finally:
            server.stop()
        rows.append(row)
        if not row["output_tokens"]:
            print(f"{name:14s} every request failed: {row['errors']}"
                  + (f" (the server exited: {row['server_exit']})" if "server_exit" in row else ""), flush=True)
            continue
        print(f"{name:14s} {row['tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_s'] * 1e3:7.0f} ms "
              f"p99 {row['ttft_p99_s'] * 1e3:7.0f} ms  TPOT p50 {(row['tpot_p50_s'] or nan) * 1e3:6.1f} ms "
              f"p99 {(row['tpot_p99_s'] or nan) * 1e3:6.1f} ms  failed {row['failed']}/{row['requests']}  "
              f"RSS {row['rss_before_mb']:.0f} / {row['rss_quarter_mb']:.0f} / {row['rss_end_mb']:.0f} MB"
              + (f"  /metrics TPOT p50 {row['tpot_metrics_p50_s'] * 1e3:.2f} ms" if row["tpot_metrics_p50_s"] else "")
              + (f"  prefix reused {row['prefix_reused_positions']:.0f}" if row["prefix_reused_positions"] else "")
              + (f"  errors: {row['errors']}" if row["errors"] else ""), flush=True)
    by = {r["server"]: r["tokens_per_s"] for r in rows if r["output_tokens"]}
    served = {r["server"]: r["tpot_metrics_p50_s"] for r in rows if r["output_tokens"] and r["tpot_metrics_p50_s"]}
    steps = []
    if "continuous" in served:   # the server's overhead: its step against generate's on the same plan
        step = generate_step(plans[args.batch], ranks, requests, args.batch, workdir, args.generate_rounds)
        if step:
            steps.append({"server": "generate", "decode_step_s": step})
            print(f"meshplan generate at batch {args.batch}: decode step {step * 1e3:.2f} ms; the server's time per "
                  f"output token p50 (/metrics) / that step: {served['continuous'] / step:.2f}x")
    if "continuous" in served and "continuous-logprobs" in served:
        print(f"logprobs = {args.logprobs} / without: {served['continuous-logprobs'] / served['continuous']:.3f}x "
              f"time per output token p50 (/metrics), {by['continuous'] / by['continuous-logprobs']:.3f}x the "
              "time per token of the whole run")
    ttft = {r["server"]: r["ttft_p50_s"] for r in rows if r["output_tokens"]}
    if args.n > 1 and "continuous" in by and "continuous-separate" in by:
        print(f"n = {args.n} / {args.n} separate requests: {by['continuous'] / by['continuous-separate']:.2f}x "
              "output tokens/s")
    if "continuous" in ttft and "continuous-no-prefix" in ttft:
        print(f"TTFT p50 without prefix caching / with: {ttft['continuous-no-prefix'] / ttft['continuous']:.2f}x")
    if "continuous" in by:
        for other in ("genai-one", "meshplan-one"):
            if other in by:
                print(f"continuous / {other}: {by['continuous'] / by[other]:.2f}x output tokens/s")
    if args.json:
        args.json.write_text(json.dumps(rows + steps, indent=1) + "\n")
    return 1 if any(not r["output_tokens"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
