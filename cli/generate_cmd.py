"""``meshplan generate``: generate tokens with a plan, one rank per device, under mpiexec."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from cli.options import bind_cores_option
from cli.guard import debugging, rank_guard

FLUSH_SECONDS = 0.05   # streamed tokens reach the terminal at least this often


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="A prompt (repeatable: the prompts are generated together, padded to one length).")
@click.option("--prompt-ids", "prompt_ids", type=click.Path(path_type=Path),
              help="Prompts as token ids: a JSON file holding a list of token-id lists.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="At most this many new tokens per sequence.")
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="0 is greedy (the highest logit); above 0, sample from the logits divided by it.")
@click.option("--top-k", default=0, show_default=True, type=int, help="Sample among the K most likely tokens (0: all).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="Sample among the most likely tokens whose probabilities reach P (1: all).")
@click.option("--seed", type=int, help="Seed of the sampling.")
@click.option("--eos", "eos", multiple=True, type=int,
              help="An end token id (repeatable) [default: the model folder's genai_config.json or "
                   "generation_config.json].")
@click.option("--tokenizer", "tokenizer", type=click.Path(path_type=Path),
              help="A folder with tokenizer.json [default: the model's folder].")
@click.option("--output", "output_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Write the sequences and metrics here (.json).")
@click.option("--provider", default="auto", show_default=True, metavar="auto|cuda|cpu",
              help="Execution provider for the programs.")
@click.option("--transfer", default="auto", show_default=True, metavar="auto|host|device",
              help="Where tensors travel between ranks (see meshplan run).")
@click.option("--deterministic", is_flag=True,
              help="Ask onnxruntime for deterministic kernels in every session (use_deterministic_compute: on CUDA, "
                   "no atomic adds in reductions), so that two runs give the same bits; may be slower.")
@click.option("--cuda-graph/--no-cuda-graph", "cuda_graph", default=True, show_default=True,
              help="On CUDA, capture a decode step as a CUDA graph once and replay it (a model with nodes "
                   "onnxruntime keeps on the CPU runs without).")
@bind_cores_option
@click.pass_context
def generate(ctx, plan_dir, prompts, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos, tokenizer,
             output_path, provider, transfer, deterministic, cuda_graph, bind_cores):
    """Generate tokens with a plan of an LLM: `mpiexec -n N meshplan generate PLAN_DIR --prompt TEXT`."""
    from meshplan.generation.driver import Request, generate_rank, read_prompt_ids
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.sessions import set_deterministic
    from meshplan.runtime.threads import set_binding

    debug = debugging(ctx)

    out = sys.stdout
    flushed = [time.monotonic()]

    def stream(text, step=None, ids=None):
        # flushed at most every FLUSH_SECONDS: a write to the launcher's pipe at every token
        # costs the step time
        out.write(text if text is not None else f"step {step}: " + " ".join(str(int(i)) for i in ids) + "\n")
        if time.monotonic() - flushed[0] >= FLUSH_SECONDS:
            out.flush()
            flushed[0] = time.monotonic()

    with rank_guard(debug):
        if not prompts and prompt_ids is None:
            raise click.UsageError("give --prompt TEXT or --prompt-ids FILE")
        request = Request(texts=list(prompts), ids=read_prompt_ids(prompt_ids) if prompt_ids else [],
                          max_new_tokens=max_new_tokens,
                          sampler=Sampler(temperature, top_k, top_p, seed), eos=list(eos) if eos else None,
                          tokenizer=tokenizer)
        set_deterministic(deterministic)
        set_binding(bind_cores, pin=True)
        report = generate_rank(plan_dir, request, provider, transfer, on_text=stream, output_path=output_path,
                               graphs=cuda_graph)
    out.flush()
    if report is None:
        return
    click.echo("")
    for index, sequence in enumerate(report.sequences):
        ended = "end token" if sequence.done else "length"
        shown = sequence.text if sequence.text is not None else " ".join(map(str, sequence.ids))
        click.echo(f"[{index}] {len(sequence.ids)} new token(s), stopped at {ended}: {shown!r}")
    m = report.metrics.to_dict()
    tpot = m["time_per_output_token_seconds"]
    decode = m["decode_tokens_per_second"]
    click.echo(f"TTFT {m['ttft_seconds'] * 1e3:.1f} ms; prefill {m['prefill_tokens_per_second']:.1f} tokens/s "
               f"({m['prompt_tokens']} prompt tokens)")
    if tpot is not None:
        click.echo(f"decode: {tpot * 1e3:.2f} ms per output token, {decode:.1f} tokens/s "
                   f"({m['generated_tokens']} tokens in {m['decode_steps'] + 1} steps); "
                   f"estimate {report.estimate_seconds * 1e3:.2f} ms per step (the plan's, at a full cache)")
    click.echo(f"load {report.load_seconds:.2f} s (every rank's programs and a warm-up call, before the first token)"
               + ("; deterministic kernels (use_deterministic_compute)" if deterministic else ""))
    if report.graphs is not None:
        click.echo(_graphs_line(report.graphs))
    if report.token_choice == "device":
        click.echo("greedy tokens chosen next to the logits on rank 0's device (only the ids reach the host)")
    for rank, (weights, cache) in enumerate(zip(report.weight_bytes, report.cache_bytes)):
        threads = report.threads[rank] if rank < len(report.threads) else None
        if threads is None and not weights and not cache and report.threads:
            click.echo(f"rank {rank}: idle (no program in the plan)")
            continue
        click.echo(f"rank {rank}: weights {_size(weights)}, key/value cache {_size(cache)}"
                   + (f"; {threads.describe()}" if threads is not None else ""))
    if output_path:
        click.echo(f"wrote {output_path}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _graphs_line(graphs: dict) -> str:
    """What rank 0's segments did with CUDA graphs."""
    if graphs["enabled"] == 0:
        why = f": {graphs['refused'][0]}" if graphs["refused"] else ""
        return f"CUDA graphs: none on rank 0{why}"
    if graphs["captured"] == 0:
        return (f"CUDA graphs: allowed in {graphs['enabled']} of rank 0's {graphs['segments']} segment(s), none "
                "captured (no call repeated its shapes and addresses on the path that keeps them)")
    return (f"CUDA graphs: {graphs['captured']} captured in {graphs['enabled']} of rank 0's {graphs['segments']} "
            "segment(s), replayed at every decode step")
