"""``meshplan serve``: an OpenAI-compatible HTTP server over the resident job, under mpiexec."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from cli.generate_cmd import _size
from cli.options import bind_cores_option
from cli.guard import debugging, rank_guard


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (rank 0).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port, said in the first line).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=1),
              help="Requests that may wait for a batch slot; more get HTTP 429 with Retry-After.")
@click.option("--prefill-chunk", type=int, metavar="N",
              help="Prompt positions per call, at most the plan's longest call [default: that]: smaller pieces "
                   "stall the running requests' decode steps less while a long prompt goes in.")
@click.option("--prefix-cache/--no-prefix-cache", "prefix_cache", default=True, show_default=True,
              help="Reuse the cache positions a prompt's beginning already has in a row (a shared system prompt, "
                   "a chat's earlier turns) instead of computing them again, where the plan makes row calls.")
@click.option("--served-model-name", "model_name", metavar="NAME",
              help="The model's name in the API [default: the model folder's name for a model.onnx, else the model file's stem].")
@click.option("--provider", default="auto", show_default=True, metavar="auto|cuda|cpu",
              help="Execution provider for the programs.")
@click.option("--transfer", default="auto", show_default=True, metavar="auto|host|device",
              help="Where tensors travel between ranks (see meshplan run).")
@click.option("--deterministic", is_flag=True, help="Deterministic kernels in every session (see meshplan generate).")
@click.option("--cuda-graph/--no-cuda-graph", "cuda_graph", default=True, show_default=True,
              help="On CUDA, replay each batch's decode step as a CUDA graph (see meshplan generate).")
@bind_cores_option
@click.pass_context
def serve(ctx, plan_dir, host, port, max_queue, prefill_chunk, prefix_cache, model_name, provider, transfer,
          deterministic, cuda_graph, bind_cores):
    """Serve a plan of an LLM over HTTP with the OpenAI API: `mpiexec -n N meshplan serve PLAN_DIR`.

    Requests share the plan's batch: each takes a slot between two steps and frees it when
    done (continuous batching where the key/value cache is one buffer of fixed capacity).
    SIGTERM or Ctrl-C stops it: running requests finish, exit 0."""
    from meshplan.runtime.sessions import set_deterministic
    from meshplan.runtime.threads import set_binding
    from meshplan.serving.server import Options, serve_rank

    def started(info):
        kind = "continuous batching" + ("" if info.continuous else " (a growing cache: requests join while it has room)")
        click.echo(f"serving {info.model} on {info.url} (OpenAI API: /v1/completions, /v1/chat/completions; "
                   f"/v1/models, /health, /metrics)")
        click.echo(f"{info.ranks} rank(s), {info.slots} slot(s), {kind}; context {info.context} positions; "
                   f"load {info.load_seconds:.2f} s")
        for rank, (weights, cache, pid) in enumerate(zip(info.weight_bytes, info.cache_bytes, info.pids)):
            threads = info.threads[rank] if rank < len(info.threads) else None
            click.echo(f"rank {rank}: pid {pid}, weights {_size(weights)}, key/value cache {_size(cache)}"
                       + (f"; {threads.describe()}" if threads is not None else ""))
        if info.front_pid is not None:
            click.echo(f"HTTP front: pid {info.front_pid} (requests, text and streams; rank 0's engine steps the job)")
        sys.stdout.flush()

    with rank_guard(debugging(ctx)):
        set_deterministic(deterministic)
        set_binding(bind_cores, pin=True)
        status = serve_rank(plan_dir, Options(host, port, max_queue, model_name, prefill_chunk, provider, transfer,
                                                    cuda_graph, prefix_cache), started)
    if status is not None:
        click.echo("stopped")
        sys.exit(status)

