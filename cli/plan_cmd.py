"""``meshplan plan``: find a parallel plan and write per-device programs."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import click

from cli.guard import debugging, guard
from cli.options import (batch_dim_option, cluster_from_options, cluster_option, device_option, dim_option, mesh_option,
                         train_options, train_spec)


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@mesh_option
@device_option("Device preset (memory, peak FLOP/s, bandwidth, links) "
               "[default: the --profile's device, else h100-80g].")
@cluster_option
@dim_option
@click.option("--microbatches", default=1, show_default=True, type=click.IntRange(min=1),
              help="Split the batch into this many pipelined microbatches.")
@batch_dim_option
@click.option("--layers", type=click.IntRange(min=1), help="Number of layers to cluster operators into.")
@click.option("--max-stages", type=click.IntRange(min=1), help="At most this many pipeline stages.")
@click.option("--stages", type=click.IntRange(min=1),
              help="Exactly this many pipeline stages (the planner still chooses their layers, submeshes and "
                   "sharding); --max-stages lets it choose the count up to a cap.")
@click.option("--schedule", "pipeline_schedule", type=click.Choice(["1f1b", "gpipe"]),
              help="A pipelined training plan's schedule (--train with --stages or --max-stages): 1F1B keeps "
                   "stage i of S at S - i microbatches in flight, GPipe all of them.  [default: 1f1b]")
@click.option("--recompute", is_flag=True,
              help="Recompute activations in the backward instead of keeping them (Alpa's and Megatron-LM's "
                   "activation checkpointing): a pipelined training plan (--train --stages S) keeps each stage's "
                   "inputs of a microbatch in flight and runs its forward again in its backward; a training "
                   "estimate (--no-programs) keeps what enters each layer. A forward more a step, far fewer "
                   "bytes in flight.")
@click.option("--tensor-parallel", default="1", show_default=True, metavar="T|T0,T1,...|auto",
              help="A pipelined training plan (--train --stages S or --max-stages N): each stage's devices in "
                   "groups of T that shard its operators (the sharding ILP over the forward, backward and update "
                   "together), the groups data-parallel replicas of the stage; one T a stage (with --stages S) "
                   "gives each stage its own, as many replicas each (D_s / T_s with --stage-devices); auto weighs "
                   "every T that divides a stage's devices and a host's, and the cut's own T for each stage, by the "
                   "estimated step.")
@click.option("--stage-devices", metavar="D0,D1,...",
              help="A pipelined training plan (--train --stages S): the devices of each stage, in order, adding up "
                   "to the mesh's (data-parallel replicas of the stage, each of its --tensor-parallel T devices) "
                   "[default: the mesh's devices over S "
                   "where S divides them, else the cut chooses them with the layers].")
@click.option("--all-devices", is_flag=True,
              help="Give every device a stage, even where leaving some idle is estimated faster.")
@click.option("--shared-host", is_flag=True,
              help="The devices of a host are shares of one machine's cores and memory bandwidth (CPU ranks on one "
                   "machine): a device working while others beside it idle gets their cores, so splitting an "
                   "operator there divides no bandwidth [default: a cluster file's shared_host, else devices of "
                   "their own].")
@click.option("--policy", default="auto", show_default=True, type=click.Choice(["auto", "data", "megatron"]),
              help="Sharding inside stages: automatic (ILP over every strategy), data parallel only, "
                   "or Megatron-style tensor parallel matrix products.")
@click.option("--solver", default="cbc", show_default=True, type=click.Choice(["cbc", "highs"]),
              help="MILP solver for the sharding ILP (python-mip's CBC or HiGHS).")
@click.option("--reshard-scheduler", default="randomized_greedy", show_default=True,
              type=click.Choice(["naive", "load_balance", "dfs", "randomized_greedy"]),
              help="How cross-mesh resharding tasks are ordered and given senders.")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path),
              help="Measured costs from meshplan profile (the analytic model fills the gaps).")
@click.option("--state", "state_pairs", multiple=True, metavar="OUT=IN",
              help="Output OUT is state: kept on its devices to be input IN of the next call (repeatable) "
                   "[default: present.N.* = past_key_values.N.* pairs found by name].")
@click.option("--no-state", is_flag=True, help="No state: every output goes to rank 0.")
@click.option("--no-programs", is_flag=True,
              help="Write plan.json, the report and the timeline but no per-device programs; no weight byte is read "
                   "(external data files are only checked to be there and long enough: sparse files do).")
@click.option("--shapes-only", is_flag=True,
              help="Plan from the model's graph alone: its external data files may be missing (implies --no-programs).")
@click.option("--generate", "generate", is_flag=True,
              help="Plan an LLM for meshplan generate: one plan for the prefill and the decode steps, costed at a "
                   "decode step with the key/value cache at --max-length, which memory counts.")
@click.option("--batch", "gen_batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --generate: sequences generated together.")
@click.option("--max-length", "max_length", type=click.IntRange(min=2),
              help="With --generate: the longest context (prompt and new tokens) [default: the model folder's "
                   "context length, from genai_config.json or config.json].")
@click.option("--prefill-chunk", "prefill_chunk", type=click.IntRange(min=1),
              help="With --generate: prompts are fed in pieces of at most this many positions [default: 128, or "
                   "--max-length if smaller].")
@click.option("--hints", "hints_path", type=click.Path(path_type=Path),
              help="An ONNX model with multi-device annotations (IR 11), or a plan directory (its annotated.onnx): "
                   "each annotated node's stage and layouts are kept, the rest is planned around them "
                   "[default: the annotations MODEL carries].")
@click.option("--no-hints", is_flag=True, help="Ignore the multi-device annotations MODEL carries.")
@train_options
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(path_type=Path), help="Plan directory to write.")
@click.pass_context
def plan(ctx, model, mesh, device, cluster_file, dims, microbatches, batch_dim, layers, max_stages, stages, pipeline_schedule,
         recompute, tensor_parallel, stage_devices, all_devices,
         shared_host, policy,
         solver, reshard_scheduler, profile_path, state_pairs, no_state, no_programs, shapes_only, generate, gen_batch,
         max_length, prefill_chunk, hints_path, no_hints, train, loss_spec, optimizer, frozen, master_weights,
         out_dir):
    """Find a parallel plan for MODEL and write per-device programs to a plan directory."""
    from meshplan.cost.cluster import DEFAULT_DEVICE
    from meshplan.emit.annotate import ANNOTATED_FILE
    from meshplan.emit.report import REPORT_FILE, TIMELINE_FILE, text_report
    from meshplan.emit.schedule import SCHEDULE_FILE
    from meshplan.errors import ModelError
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan

    def default_device() -> str:
        if profile_path is None:
            return DEFAULT_DEVICE
        from meshplan.profile.document import profile_preset, read_profile

        return profile_preset(read_profile(profile_path), profile_path)

    with guard(debugging(ctx)):
        cluster = cluster_from_options(mesh, cluster_file, device, default_device)
        if shared_host:
            cluster = replace(cluster, host_shares=cluster.devices_per_host)
        started = time.perf_counter()
        stage_tensors = None
        if tensor_parallel == "auto":
            tensor_parallel = 0
        elif "," in tensor_parallel:
            counts = tensor_parallel.split(",")
            if not all(c.strip().isdigit() and int(c) > 0 for c in counts):
                raise click.BadParameter(f"{tensor_parallel!r} is not a list of positive numbers",
                                         param_hint="'--tensor-parallel'")
            if not stages or len(counts) != stages:
                raise click.UsageError(f"--tensor-parallel {tensor_parallel} gives {len(counts)} stages their T: it "
                                       f"goes with --stages {len(counts)}")
            stage_tensors = tuple(int(c) for c in counts)
            tensor_parallel = stage_tensors[0] if len(set(stage_tensors)) == 1 else max(stage_tensors)
            stage_tensors = stage_tensors if len(set(stage_tensors)) > 1 else None
        elif not tensor_parallel.isdigit() or int(tensor_parallel) < 1:
            raise click.BadParameter(f"{tensor_parallel!r} is not a positive number or auto",
                                     param_hint="'--tensor-parallel'")
        tensor_parallel = int(tensor_parallel)
        if stage_devices is not None:
            counts = stage_devices.split(",")
            if not all(c.strip().isdigit() and int(c) > 0 for c in counts):
                raise click.BadParameter(f"{stage_devices!r} is not a list of positive device counts",
                                         param_hint="'--stage-devices'")
            if not (train and stages and stages > 1 and not no_programs):
                raise click.UsageError("--stage-devices goes with --train and --stages S (S > 1): a pipelined "
                                       "training plan with programs")
            stage_devices = tuple(int(c) for c in counts)
        options = PlanOptions(microbatches=microbatches, num_layers=layers, solver=solver, max_stages=max_stages,
                              stages=stages,
                              policy=policy, reshard_scheduler=reshard_scheduler, batch_dim=tuple(batch_dim),
                              all_devices=all_devices, schedule=pipeline_schedule or "1f1b", recompute=recompute,
                              tensor_parallel=tensor_parallel, stage_devices=stage_devices,
                              stage_tensors=stage_tensors)
        if tensor_parallel != 1 and not (train and ((stages and stages > 1) or max_stages) and not no_programs):
            raise click.UsageError("--tensor-parallel goes with --train and --stages S (S > 1) or --max-stages N: a "
                                   "pipelined training plan with programs")
        if recompute and not (train and (stages or max_stages)):
            raise click.UsageError("--recompute goes with --train and --stages or --max-stages (a pipelined "
                                   "training plan or estimate)")
        if pipeline_schedule is not None and not (train and (stages or max_stages)):
            raise click.UsageError("--schedule goes with --train and --stages or --max-stages (a pipelined "
                                   "training plan)")
        cost_model, links = None, {}
        if profile_path:
            from meshplan.files import file_sha256
            from meshplan.profile.document import load_profile
            from meshplan.profile.measured import ProfiledCostModel, with_measured_links

            if not Path(model).is_file():
                raise ModelError(f"model file not found: {model}")
            profile = load_profile(profile_path, file_sha256(model), cluster,
                                   training=train_spec(train, loss_spec, optimizer, frozen, master_weights))
            cluster, links = with_measured_links(cluster, profile)
            cost_model = ProfiledCostModel(cluster, profile)
        state = None
        if no_state or state_pairs:
            if no_state and state_pairs:
                raise click.UsageError("--state and --no-state exclude each other")
            state = {}
            for text in state_pairs:
                out, sep, name = text.partition("=")
                if not sep or not out or not name:
                    raise click.BadParameter(f"expected OUT=IN, got {text!r}", param_hint="--state")
                state[out] = name
        if hints_path is not None and no_hints:
            raise click.UsageError("--hints and --no-hints exclude each other")
        if generate:
            from meshplan.make_plan import generation_plan_dims

            if no_state:
                raise click.UsageError("--generate needs the key/value cache as state (drop --no-state)")
            if not Path(model).is_file():
                raise ModelError(f"model file not found: {model}")
            dims, chosen = generation_plan_dims(model, gen_batch, max_length, prefill_chunk, dims, state)
            click.echo(f"generation: {chosen['batch_text']}, context {chosen['max_length']} positions, prompts in "
                       f"pieces of up to {chosen['prefill_chunk']}; costed at a decode step with the cache full; "
                       f"{'a shared cache buffer' if chosen['cache'] == 'shared' else 'a growing cache'}, prompts "
                       f"padded on the {chosen['padding']}")
        elif max_length is not None or prefill_chunk is not None or gen_batch != 1:
            raise click.UsageError("--batch, --max-length and --prefill-chunk go with --generate")
        training = train_spec(train, loss_spec, optimizer, frozen, master_weights)
        if training is not None and (generate or state is not None or hints_path is not None):
            raise click.UsageError("--train goes without --generate, --state, --no-state and --hints")
        result = make_plan(model, cluster, dims, out_dir, options, cost_model=cost_model, state=state,
                           programs=not (no_programs or shapes_only), shapes_only=shapes_only, hints=hints_path,
                           model_hints=not no_hints, training=training)
        click.echo(text_report(result))
        if cost_model is not None:
            click.echo(f"costs: {cost_model.measured_nodes} operator(s) measured, "
                       f"{cost_model.analytic_nodes} from the analytic model"
                       + (f"; the measured ones x{cost_model.factor:.2f} (the profiled model run whole against "
                          "their sum)" if cost_model.factor != 1.0 else ""))
            for name, link in links.items():
                click.echo(f"links: {name.replace('_', '-')} {link.bandwidth / 1e9:.3g} GB/s, "
                           f"{link.latency * 1e6:.3g} µs (measured by meshplan profile)")
        if result.training.get("pipeline"):
            parts = len(result.training["pipeline"]["parts"])
            click.echo(f"wrote {out_dir}/plan.json, {out_dir}/{SCHEDULE_FILE}, {out_dir}/{REPORT_FILE}, "
                       f"{out_dir}/{TIMELINE_FILE}, {parts} program part(s) and the step model in {out_dir}/training")
            click.echo(f"PASSED | {time.perf_counter() - started:.1f} s | meshplan plan")
            return
        programs = f"{len(result.programs)} program(s)" if result.programs else "no programs"
        schedule = "" if result.training.get("estimate_only") else f"{out_dir}/{SCHEDULE_FILE}, "
        click.echo(f"wrote {out_dir}/plan.json, {schedule}{out_dir}/{REPORT_FILE}, {programs}, "
                   f"{out_dir}/{TIMELINE_FILE}, "
                   f"{out_dir}/{ANNOTATED_FILE}")
        click.echo(f"PASSED | {time.perf_counter() - started:.1f} s | meshplan plan")
