"""``msdist train``: train the reference transformer at a layout, measured beside the plan.

The parent never imports MindSpore. It reads the model (a preset or file, with its
``training:`` section as defaults the flags override), checks everything a rank would
refuse (the layout's split of the model, the batch, the data file, the resume directory)
so a bad run fails before any rank starts (one line, exit 2), launches the ranks as
``msdist verify`` does (:mod:`mscli.ranks`) with the checks of
``mindscience.distributed.harness.checks.train``, and builds the report of
:mod:`mindscience.distributed.training.report`: each step's loss and speed, and the
measured step time and bytes per stage beside the cost model's prediction.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from typing import Optional

import typer

from .. import render_train
from ..errors import EXIT_FAILED, UsageError, check_format, check_output_file, user_errors
from ..layouts import load_with_sections, resolve_model
from ..ranks import all_ranks, dry_run_lines, failure_rows, launch_ranks, plan_launch

EXIT_STOPPED = 3        # stopped on a signal after every rank saved the same step
EXIT_INTERRUPTED = 130  # a second signal: stopped at once

DEFAULT_TIMEOUT_S = 900
# The first step compiles (jit): give every rank that long before the timeout counts steps.
CPU_DEVICE = "cpu"


def _workload(path, sections: dict, model: Optional[str]):
    from mindscience.distributed.costmodel import load_workload, workload_from_mapping

    workload = workload_from_mapping(sections, str(path))
    if model is not None:
        workload = load_workload(resolve_model(model), base=workload)
    if workload.model is None:
        raise UsageError("msdist train needs a model: pass --model NAME (e.g. tiny-gpt, tiny-llama) or a "
                         "model file, or add a 'model:' section to the layout file.")
    return workload


def build_options(workload, layout, *, steps=10, micro_batch_size=None, global_batch_size=None,
                  zero_stage=None, recompute=None, mode="jit", seed=0, lr=1e-3, data=None, save=None,
                  save_every=0, resume=None, async_save=False, keep_last=0):
    """The run's TrainOptions: the flags over the model file's ``training:`` section.

    Raises:
        TrainOptionError: an option out of range or a batch that does not split.
    """
    from mindscience.distributed.training.options import TrainOptions, microbatches

    t = workload.training
    b = micro_batch_size or t.micro_batch_size
    opts = TrainOptions(
        steps=steps, micro_batch_size=b,
        global_batch_size=global_batch_size or t.global_batch_size or b * layout.dp,
        zero_stage=t.zero_stage if zero_stage is None else zero_stage,
        recompute=recompute or t.recompute, mode=mode, seed=seed, lr=lr, precision=t.precision,
        data=os.path.abspath(data) if data else None, save=os.path.abspath(save) if save else None,
        save_every=save_every, resume=os.path.abspath(resume) if resume else None, async_save=async_save,
        keep_last=keep_last)
    microbatches(opts, layout.dp)
    return opts


def check_fault_flags(max_restarts: int, rejoin_timeout: float, save, nodes=None) -> None:
    """``--max-restarts`` and ``--rejoin-timeout`` in range (a restart without ``--save``
    starts again from step 0: allowed on one machine); several nodes agree on a restart
    through ``DIR/.rendezvous``, so they need ``--save``."""
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts} is invalid: expected 0 (no restart) or more.")
    if not rejoin_timeout > 0:
        raise UsageError(f"--rejoin-timeout {rejoin_timeout} is invalid: expected a positive number of seconds.")
    if max_restarts and nodes and nodes > 1 and not save:
        raise UsageError(f"--max-restarts {max_restarts} on {nodes} nodes needs --save DIR on a folder every node "
                         "sees: the nodes agree on a restart through DIR/.rendezvous.")


def check_fault_switch(layout, opts, resume_info) -> None:
    """``MSDIST_FAULT`` (fault injection) parsed and checked against the run before any rank starts."""
    from mindscience.distributed.training import faults

    first = (resume_info or {}).get("step") or 0
    faults.check_faults(faults.parse_faults(os.environ.get(faults.FAULT_ENV)), layout.world_size,
                        first + opts.steps)


def check_model(workload, layout) -> None:
    """Everything of the model a rank would refuse at this layout (cost model and GPTModel).

    Raises:
        ModelConstraintError: naming the value and the fix.
    """
    from mindscience.distributed.costmodel import check
    from mindscience.distributed.models.config import TransformerConfig

    check(workload.model, workload.training, layout, workload.source)
    TransformerConfig.from_model_spec(workload).check_layout(layout.tp, layout.cp, layout.pp, layout.ep, layout.etp)


def model_and_options(layout, model: str, **flags) -> tuple:
    """``(run workload, TrainOptions)`` of ``model`` at ``layout`` (``msdist verify --model``)."""
    from mindscience.distributed.training.loop import training_spec

    workload = _workload(None, {}, model)
    opts = build_options(workload, layout, **flags)
    workload = replace(workload, training=training_spec(workload.training, opts))
    check_model(workload, layout)
    return workload, opts


def check_resume(directory: str, workload, opts) -> dict:
    """The checkpoint ``--resume`` names, checked against the model before any rank starts.

    Returns:
        ``{"directory", "step", "data_position"}``.

    Raises:
        UsageError: no checkpoint there, its parameters are not the model's (the first
            difference named), or it holds no AdamW DistributedOptimizer state.
    """
    from mindscience.distributed.checkpoint import offline
    from mindscience.distributed.training.options import (checkpoint_difference, optimizer_difference,
                                                          resolve_resume)

    path = resolve_resume(directory)
    info = offline.inspect(path, checksums=False)
    if not info["complete"]:
        raise UsageError(f"--resume {path}: {'; '.join(info['problems']) or 'incomplete checkpoint'}.")
    extra = info.get("extra") or {}
    difference = checkpoint_difference(asdict(workload.model), extra.get("model_spec"),
                                       {p["name"]: p["shape"] for p in info["parameters"]})
    if difference:
        raise UsageError(f"--resume {path}: the checkpoint does not hold model {workload.model.name}: "
                         f"{difference}. Resume with the model it was saved with.")
    difference = optimizer_difference(info.get("optimizers"))
    if difference:
        raise UsageError(f"--resume {path}: {difference}, msdist train resumes the AdamW state of "
                         "DistributedOptimizer(optimizer='adamw'): pass a directory msdist train --save wrote "
                         "(or checkpoint.save of nn.CellList([model, that optimizer])).")
    return {"directory": path, "step": info["step"], "data_position": extra.get("data_position")}


def check_data(opts, workload, resume_info: Optional[dict]):
    """Open ``--data`` and check it holds the sequences of every step this run reads."""
    from mindscience.distributed.training.data import open_token_file

    if not opts.data:
        return None
    start = (resume_info or {}).get("data_position") or 0
    needed = start + opts.steps * opts.global_batch_size
    return open_token_file(opts.data, workload.model.vocab_size, workload.model.seq_length, needed)


def build_spec(layout, workload, opts, resume_path: Optional[str]) -> dict:
    """The worker spec: groups, the trainer, one check per step, the rank's memory."""
    training = {k: v for k, v in asdict(workload.training).items()}
    model = {k: v for k, v in asdict(workload.model).items()}
    checks = [{"name": "layout.init", "params": {}},
              {"name": "train.setup", "params": {"model": model, "training": training,
                                                 "options": opts.to_dict(), "resume": resume_path}}]
    checks += [{"name": "train.step", "params": {"index": i}} for i in range(opts.steps)]
    checks.append({"name": "train.finish", "params": {}})
    return {"layout": layout.to_dict(), "checks": checks}


def run_cluster(workload, layout, local: bool, calibrate: Optional[str]):
    """The workload priced on the run's devices: CPU ranks use the ``cpu`` preset unless the
    files name a device or set the peak; ``--calibrate`` takes a verify report's numbers."""
    from mindscience.distributed.costmodel.spec import ClusterSpec

    from .plan import apply_cluster

    cluster = workload.cluster
    if (local or layout.backend == "cpu") and cluster.device is None and not workload.cluster_keys:
        workload = replace(workload, cluster=ClusterSpec(device=CPU_DEVICE))
    workload, _ = apply_cluster(workload, calibrate=calibrate)
    return workload


def report_from_ranks(ranks: dict, *, layout, workload, opts, estimate: dict, peak_tflops: float,
                      extra: dict, earlier=()) -> dict:
    """The report (:mod:`mindscience.distributed.training.report`) of the ranks' records;
    ``earlier``: the ``(step, loss, seconds)`` kept from launches a restart replaced."""
    from mindscience.distributed.training import report as tr

    got = tr.collect(ranks)
    merged = tr.merge_rank_steps(got["steps"])
    merged = sorted(list(earlier) + [row for row in merged if row[0] not in {r[0] for r in earlier}])
    tokens = opts.global_batch_size * workload.model.seq_length
    rows = tr.step_rows(merged, tokens, estimate["time"]["model_flops_per_step"], layout.world_size, peak_tflops,
                        moe=tr.moe_by_step(got["steps"]))
    training = {**asdict(workload.training), **opts.to_dict()}
    return tr.build_report(layout=layout.to_dict(), model=asdict(workload.model), training=training, steps=rows,
                           rank_memory=got["memory"], estimate=estimate, tokens_per_step=tokens,
                           world_size=layout.world_size, peak_tflops=peak_tflops,
                           extra={**extra, "checkpoints": got["saved"]})


class StepPrinter:
    """The harness progress callback of the rich view: each step's line as soon as every
    rank of this machine has reported the step (the slowest rank's time), in step order.

    Args:
        tokens_per_step: ``global_batch_size * seq_length``.
        flops_per_step: The cost model's model FLOPs of a step (for the MFU).
        world_size: Ranks of the run.
        peak_tflops: Peak of one device.
        console: Where the lines go (default :func:`mscli.render_train.live_console`).

    Attributes:
        printed: The steps whose line was printed (the report prints the others).
    """

    def __init__(self, *, tokens_per_step: int, flops_per_step: float, world_size: int, peak_tflops: float,
                 console=None):
        self.scale = (tokens_per_step, flops_per_step, world_size, peak_tflops)
        self.console = console
        self.printed: set = set()

    def __call__(self, snapshot: dict) -> None:
        from mindscience.distributed.training import report as tr

        ranks = snapshot.get("ranks") or {}
        try:
            rank_steps = tr.collect(ranks)["steps"]
            done = tr.finished_steps(rank_steps, ranks)
        except ValueError:
            return  # ranks that disagree on a loss: the final report names them
        new = [row for row in done if row[0] not in self.printed]
        if not new:
            return
        render_train.print_steps(tr.step_rows(new, *self.scale, moe=tr.moe_by_step(rank_steps)), self.console)
        self.printed.update(row[0] for row in new)


def train(
    layout: Optional[str] = typer.Argument(None, help="Layout YAML file or bundled name (default: the 4-rank CPU layout)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model file or preset (tiny-gpt, tiny-llama, ...); its training: section gives the defaults."),
    steps: int = typer.Option(10, "--steps", help="Optimizer steps to run (after the resumed step)."),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", help="Sequences per micro-batch (default: the model file's)."),
    global_batch_size: Optional[int] = typer.Option(None, "--global-batch-size", help="Sequences per step (default: the model file's)."),
    zero_stage: Optional[int] = typer.Option(None, "--zero-stage", help="0, 1, 2 or 3 (default: the model file's)."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="none, selective or full (default: the model file's)."),
    mode: str = typer.Option("jit", "--mode", help="jit (compiled forward/backward) or pynative."),
    data: Optional[str] = typer.Option(None, "--data", help="A .npy file of token ids (1-D, memory-mapped); default: synthetic tokens from --seed."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and of the synthetic tokens."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    save: Optional[str] = typer.Option(None, "--save", help="Write checkpoints to DIR/step_<k> (every --save-every steps and at the end)."),
    save_every: int = typer.Option(0, "--save-every", help="Save every K steps (0: only at the end)."),
    resume: Optional[str] = typer.Option(None, "--resume", help="A checkpoint directory, or a --save folder (its highest step), loaded at this layout."),
    calibrate: Optional[str] = typer.Option(None, "--calibrate", help="A `msdist verify -o` report: price the prediction with its measured compute and bandwidth."),
    fmt: str = typer.Option("rich", "--format", help="rich (tables) or json (stdout holds only JSON)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Also write the JSON report to this file."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Stop every rank after this many seconds."),
    local: bool = typer.Option(False, "--local", help="Run every rank on this machine's CPU, whatever the layout's backend."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Number of nodes of a cluster run."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's index (0 prints the report)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Address of the node with rank 0."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Scheduler port (default: a free one)."),
    loopback_nodes: Optional[int] = typer.Option(None, "--loopback-nodes", help="Simulate this many nodes on this machine over loopback."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the msrun command of every node and exit."),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="Folder for msrun logs and per-rank results (default msdist_logs/train)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="After a rank dies, hangs or fails: stop all, relaunch from the newest complete checkpoint under --save, up to N times."),
    async_save: bool = typer.Option(False, "--async-save", help="Write checkpoints in the background: a step stalls only for the host copy."),
    keep_last: int = typer.Option(0, "--keep-last", help="Keep only the newest K complete checkpoints under --save (0: all)."),
    elastic: bool = typer.Option(False, "--elastic", help="At a restart, go on with the nodes that came back (the layout msdist suggest ranks first for them)."),
    rejoin_timeout: float = typer.Option(60.0, "--rejoin-timeout", help="Seconds to wait for every node at a restart."),
) -> None:
    """Train GPTModel with DistributedOptimizer (AdamW) at the layout; measured beside the plan."""
    from mindscience.distributed.costmodel import estimate

    with user_errors():
        check_format(fmt)
        if timeout <= 0:
            raise UsageError(f"--timeout {timeout} is invalid: expected a positive number of seconds.")
        check_fault_flags(max_restarts, rejoin_timeout, save, nodes)
        if output:
            check_output_file("--output", output)
        spec_layout, path, sections = load_with_sections(layout)
        workload = _workload(path, sections, model)
        opts = build_options(workload, spec_layout, steps=steps, micro_batch_size=micro_batch_size,
                             global_batch_size=global_batch_size, zero_stage=zero_stage, recompute=recompute,
                             mode=mode, seed=seed, lr=lr, data=data, save=save, save_every=save_every,
                             resume=resume, async_save=async_save, keep_last=keep_last)
        from mindscience.distributed.training.loop import training_spec

        workload = replace(workload, training=training_spec(workload.training, opts))
        check_model(workload, spec_layout)
        resume_info = check_resume(opts.resume, workload, opts) if opts.resume else None
        check_fault_switch(spec_layout, opts, resume_info)
        token_file = check_data(opts, workload, resume_info)
        if opts.save:
            from ..errors import check_output_folder

            check_output_folder("--save", opts.save)
        priced = run_cluster(workload, spec_layout, local, calibrate)
        predicted = estimate(spec_layout, priced, mode=opts.mode)
        plan = plan_launch(spec_layout, nodes, node_rank, master_addr, master_port, local, loopback_nodes,
                           command="train")
        spec = build_spec(spec_layout, workload, opts, resume_info and resume_info["directory"])
        run_dir = os.path.abspath(log_dir or os.path.join("msdist_logs", "train"))
        if dry_run:
            for line in dry_run_lines(spec_layout, nodes or loopback_nodes, master_addr, master_port, plan, run_dir):
                typer.echo(line)
            return
    printer = None
    if fmt == "rich" and not (plan["mode"] == "cluster" and node_rank):  # the node that prints the report
        render_train.render_header(asdict(workload.model), {**asdict(workload.training), **opts.to_dict()},
                                   spec_layout.to_dict(), resume_info)
    if fmt == "rich" and (plan["mode"] != "cluster" or plan["local"] == spec_layout.world_size):
        # This machine watches every rank (loopback nodes included), so a step's line holds
        # the slowest rank's time; on a cluster the other nodes' ranks are known only at
        # the end, and the lines are printed then.
        printer = StepPrinter(tokens_per_step=opts.global_batch_size * workload.model.seq_length,
                              flops_per_step=predicted["time"]["model_flops_per_step"],
                              world_size=spec_layout.world_size, peak_tflops=priced.cluster.peak_tflops)
    plan = dict(plan, nodes=nodes or loopback_nodes or 1)

    def launch(spec, layout, plan, log_dir, progress):
        port = master_port if plan["mode"] == "cluster" or log_dir == run_dir else None
        return launch_ranks(spec, layout, plan, progress=fmt == "rich", timeout=timeout, local=local, nodes=nodes,
                            node_rank=plan.get("node_rank", node_rank), master_addr=master_addr, master_port=port,
                            loopback_nodes=plan["nodes"] if plan["mode"] == "loopback" else None, log_dir=log_dir,
                            on_progress=progress)

    printers = {spec_layout.world_size: printer}

    def progress(snapshot, layout):
        if printer is None:
            return
        if layout.world_size not in printers:  # an elastic restart at another world size
            printers[layout.world_size] = StepPrinter(
                tokens_per_step=opts.global_batch_size * workload.model.seq_length,
                flops_per_step=estimate(layout, priced)["time"]["model_flops_per_step"],
                world_size=layout.world_size, peak_tflops=priced.cluster.peak_tflops)
            printers[layout.world_size].printed = printers[spec_layout.world_size].printed
        printers[layout.world_size](snapshot)

    def restarted(record):
        if printer is not None:
            printer.printed.difference_update(k for k in list(printer.printed) if k > record["resumed_from"])
        if fmt == "rich":
            render_train.print_restart(record)

    from .. import restarts

    outcome = restarts.run(layout=spec_layout, workload=workload, opts=opts, resume_info=resume_info, plan=plan,
                           launch=launch, build_spec=build_spec, check_model=check_model, max_restarts=max_restarts,
                           elastic=elastic, rejoin_timeout=rejoin_timeout, node_rank=node_rank, nodes=nodes,
                           run_dir=run_dir, on_restart=restarted, on_progress=progress)
    result, run_layout, plan = outcome["result"], outcome["layout"], outcome["plan"]
    if outcome["interrupted"] or result is None:
        render_train.render_interrupted(outcome, fmt)
        raise typer.Exit(EXIT_INTERRUPTED)
    if plan["mode"] == "cluster" and node_rank:
        render_train.node_done(node_rank, result.ok)
        if not result.ok:
            raise typer.Exit(EXIT_FAILED)
        if outcome["stopped"]:
            raise typer.Exit(EXIT_STOPPED)
        return
    failures = failure_rows(result)
    if failures or not result.ok:
        render_train.render_failures(failures, result.log_dir, fmt, restarts=outcome["restarts"],
                                     failure=outcome["failure"])
        raise typer.Exit(EXIT_FAILED)
    with user_errors():
        if run_layout is not spec_layout:
            predicted = estimate(run_layout, priced, mode=opts.mode)
        report = report_from_ranks(
            all_ranks(result, plan), layout=run_layout, workload=workload, opts=opts, estimate=predicted,
            peak_tflops=priced.cluster.peak_tflops, earlier=outcome["earlier"],
            extra={"log_dir": result.log_dir, "duration_s": result.duration_s,
                   "resumed": resume_info, "token_file": token_file and asdict(token_file),
                   "cluster": asdict(priced.cluster), "restarts": outcome["restarts"],
                   "stopped": outcome["stopped"]})
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    if fmt == "json":
        from .. import render

        render.print_json(report)
    else:
        render_train.render_report(report, shown=printer.printed if printer else ())
    if not report["ok"]:
        raise typer.Exit(EXIT_FAILED)
    if outcome["stopped"]:
        raise typer.Exit(EXIT_STOPPED)
