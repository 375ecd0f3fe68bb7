"""``meshplan verify``: run a plan in one process and compare with onnxruntime."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from cli.guard import debugging, guard


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--inputs", "inputs_path", type=click.Path(path_type=Path), help="Model inputs (.npz).")
@click.option("--outputs", "outputs_path", type=click.Path(path_type=Path),
              help="Also check these outputs (e.g. from meshplan run) against the original model.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), help="The original model, if it moved.")
@click.option("--rtol", type=float,
              help="Relative tolerance for every output [default: by each output's dtype: float32 1e-3, "
                   "float16/bfloat16 8 eps, integers and bool exact].")
@click.option("--atol", type=float,
              help="Absolute tolerance for every output [default: by dtype: float32 1e-4, float16/bfloat16 8 eps, "
                   "integers and bool 0].")
@click.option("--stages/--whole-model", "by_stages", default=None,
              help="Compare stage by stage (the original model's subgraph of each stage, fed the reference "
                   "outputs of the stage before; memory for one piece of a stage at a time), or run the whole "
                   "model at once [default: stage by stage when the model's weights exceed half of the memory "
                   "available].")
@click.option("--generate", "generate", is_flag=True,
              help="Generate from --prompt/--prompt-ids with the plan and with onnxruntime on the original model in one "
                   "loop: greedy ids must be identical and each step's logits within tolerance.")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT", help="With --generate: a prompt (repeatable).")
@click.option("--prompt-ids", "prompt_ids", type=click.Path(path_type=Path),
              help="With --generate: prompts as a JSON list of token-id lists.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=1),
              help="With --generate: tokens per sequence.")
@click.option("--tokenizer", "tokenizer", type=click.Path(path_type=Path),
              help="With --generate: a folder with tokenizer.json [default: the model's folder].")
@click.option("--provider", type=click.Choice(["auto", "cuda", "cpu"]), default="cpu", show_default=True,
              help="Where the plan's programs and onnxruntime's reference both run (the same device for both).")
@click.option("--deterministic", is_flag=True,
              help="Ask onnxruntime for deterministic kernels in every session, the reference's too "
                   "(use_deterministic_compute).")
@click.pass_context
def verify(ctx, plan_dir, inputs_path, outputs_path, model_path, rtol, atol, by_stages, generate, prompts, prompt_ids,
           max_new_tokens, tokenizer, provider, deterministic):
    """Run all of a plan's programs in one process and compare with onnxruntime on the original model.

    Each float output passes within its dtype's tolerance; where the model quantizes its
    activations (MatMulNBits at accuracy_level 4 on the CPU) the tolerance also carries the
    output's quantization bound, measured on the same inputs and printed as "+ bound"."""
    from meshplan.emit.schedule import read_schedule
    from meshplan.plan_format import read_plan, require_programs
    from meshplan.runtime.inprocess import compare_outputs, reference_with_bounds, run_in_process
    from meshplan.runtime.sessions import set_deterministic
    from meshplan.runtime.staged import needs_stages
    from meshplan.runtime.tensors import read_inputs

    with guard(debugging(ctx)):
        set_deterministic(deterministic)
        started = time.perf_counter()
        the_plan = read_plan(plan_dir)
        require_programs(the_plan, plan_dir)
        read_schedule(the_plan, plan_dir)   # what a job of the plan would carry out: one line if it cannot
        if generate:
            _verify_generation(the_plan, plan_dir, prompts, prompt_ids, max_new_tokens, tokenizer, model_path, rtol,
                               atol, provider, started)
            return
        if inputs_path is None:
            raise click.UsageError("give --inputs IN.npz (or --generate with prompts)")
        inputs = read_inputs(inputs_path, the_plan, empty_state=True)
        why = "--stages" if by_stages else None
        if by_stages is None and needs_stages(the_plan, model_path):
            why = "the model's weights exceed half of the memory available"
        if why:
            _verify_by_stages(the_plan, plan_dir, inputs, outputs_path, model_path, rtol, atol, provider, why, started)
            return
        expected, bounds = reference_with_bounds(the_plan, inputs, model_path, provider)
        checks = [("in-process", run_in_process(the_plan, plan_dir, inputs, provider))]
        if outputs_path:
            checks.append((str(outputs_path), _read_outputs(outputs_path)))
        ok = True
        for label, actual in checks:
            for c in compare_outputs(actual, expected, rtol, atol, bounds):
                click.echo(f"{label}: {c.name}: {_describe(c)}")
                ok &= c.ok
        verdict = "PASSED" if ok else "FAILED"
        click.echo(f"{verdict} | {time.perf_counter() - started:.1f} s | meshplan verify against single-device onnxruntime")
        if not ok:
            sys.exit(1)


def _verify_generation(the_plan, plan_dir, prompts, prompt_ids, max_new_tokens, tokenizer, model_path, rtol, atol,
                       provider, started):
    from meshplan.generation.compare import bound_stepper, compare_generation, plan_stepper, reference_stepper
    from meshplan.generation.driver import Request, prepare, read_prompt_ids

    if not prompts and prompt_ids is None:
        raise click.UsageError("--generate needs --prompt TEXT or --prompt-ids FILE")
    request = Request(texts=list(prompts), ids=read_prompt_ids(prompt_ids) if prompt_ids else [],
                      max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    prepared = prepare(the_plan, request)
    shape = prepared.shape
    result = compare_generation(shape, reference_stepper(the_plan, shape, model_path, provider),
                                plan_stepper(the_plan, plan_dir, shape, provider), prepared.prompts, max_new_tokens,
                                prepared.pad_id, rtol, atol, bound_stepper(the_plan, shape, model_path, provider))
    for step in result.steps:
        ids = ("same greedy ids" if step.same_ids else
               "greedy ids differ where onnxruntime's top logits are within the bound" if step.tied else
               "GREEDY IDS DIFFER")
        bound = f" (+ bound {step.bound:.3g})" if step.bound else ""
        click.echo(f"step {step.step}: logits max abs err {step.max_abs:.3g}{bound} {'ok' if step.ok else 'MISMATCH'}, "
                   f"{ids}")
    for index, (want, got) in enumerate(zip(result.reference_ids, result.plan_ids)):
        click.echo(f"[{index}] onnxruntime {want}")
        if got != want:
            click.echo(f"[{index}] plan        {got}")
    first = result.first_difference
    if first is not None:
        click.echo(f"greedy ids first differ at step {first}")
    verdict = "PASSED" if result.ok else "FAILED"
    click.echo(f"{verdict} | {time.perf_counter() - started:.1f} s | meshplan verify --generate: {len(result.steps)} "
               f"step(s), worst logit error {result.worst:.3g} (rtol {result.rtol:g}, atol {result.atol:g}) against "
               "single-device onnxruntime")
    if not result.ok:
        sys.exit(1)


def _verify_by_stages(the_plan, plan_dir, inputs, outputs_path, model_path, rtol, atol, provider, why, started):
    from meshplan.runtime.inprocess import compare_outputs
    from meshplan.runtime.staged import verify_by_stages

    click.echo(f"stage by stage ({why}): each stage's programs and the original model's subgraph of that stage, "
               "fed the reference outputs of the stages before")
    result = verify_by_stages(the_plan, plan_dir, inputs, model_path, provider=provider, rtol=rtol, atol=atol)
    ok = True
    for stage in result.stages:
        devices = stage.devices
        if len(devices) == 1:
            ranks = f"rank {devices[0]}"
        elif devices == list(range(devices[0], devices[-1] + 1)):
            ranks = f"ranks {devices[0]}-{devices[-1]}"
        else:
            ranks = "ranks " + ",".join(map(str, devices))
        worst = max((c.max_abs for c in stage.comparisons), default=0.0)
        click.echo(f"stage {stage.index} ({ranks}; {stage.weight_bytes / 1e9:.2f} GB of weights in "
                   f"{stage.pieces} reference piece(s)): max abs err {worst:.3g} {'ok' if stage.ok else 'MISMATCH'}")
        for c in stage.comparisons:
            click.echo(f"  {c.name}: {_describe(c)}")
        ok &= stage.ok
    if outputs_path:
        for c in compare_outputs(_read_outputs(outputs_path), result.reference, rtol, atol, result.bounds):
            click.echo(f"{outputs_path}: {c.name}: {_describe(c)}")
            ok &= c.ok
    verdict = "PASSED" if ok else "FAILED"
    click.echo(f"{verdict} | {time.perf_counter() - started:.1f} s | meshplan verify stage by stage against "
               "single-device onnxruntime")
    if not ok:
        sys.exit(1)


def _describe(c) -> str:
    """One comparison: the worst errors and the tolerance, or for values without a distance
    (strings) how many elements differ."""
    status = "ok" if c.ok else "MISMATCH"
    if c.exact:
        return f"{c.differing} of {c.elements} element(s) differ (compared exactly) {status}"
    bound = f" + quantization bound {c.bound:.3g}" if c.bound else ""
    return f"max abs err {c.max_abs:.3g}, max rel err {c.max_rel:.3g} (rtol {c.rtol:g}, atol {c.atol:g}{bound}) {status}"


def _read_outputs(path: Path):
    import zipfile

    import numpy as np

    from meshplan.errors import RunError

    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise RunError(f"outputs file not found: {path}") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError):
        raise RunError(f"cannot read outputs {path}: not a valid .npz file") from None
