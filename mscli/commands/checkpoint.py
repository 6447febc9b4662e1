"""``msdist checkpoint inspect | reshard | merge``: offline work on sharded checkpoints.

No MindSpore import: everything runs on numpy, memory maps and the safetensors format
(:mod:`mindscience.distributed.checkpoint.offline`). Exit codes: 0 ok, 1 the checkpoint
is incomplete or corrupt, or of a format version this msdist cannot read (the message
names the file, parameter or version), 2 bad input (a missing path, a file where a
directory is expected, a layout that cannot split a parameter).
"""

from __future__ import annotations

import os

import typer

from .. import render_checkpoint
from ..errors import EXIT_FAILED, UsageError, check_format, check_output_folder, fail, user_errors

app = typer.Typer(
    name="checkpoint",
    help="Inspect, reshard and merge sharded checkpoints (no MindSpore needed).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _unreadable() -> tuple:
    """The errors that mean "this checkpoint cannot be used" (exit 1), not bad input."""
    from mindscience.distributed.checkpoint import CheckpointFormatError, CheckpointIntegrityError

    return (CheckpointIntegrityError, CheckpointFormatError)


def _integrity(err) -> "typer.Exit":
    return fail(" ".join(str(err).split()), EXIT_FAILED)


def _check_dir(path: str) -> None:
    from mindscience.distributed.checkpoint.manifest import partial_dir

    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{path} is a file, not a checkpoint directory: pass the directory "
                         "that save() wrote (it holds manifest.json).")
    if not os.path.exists(path) and not os.path.isdir(partial_dir(path)):
        raise UsageError(f"checkpoint directory {path} does not exist: pass the directory that "
                         "save() wrote (it holds manifest.json).")


@app.command("inspect")
def inspect_command(
    directory: str = typer.Argument(..., help="Checkpoint directory (holds manifest.json)."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich or json."),
    no_checksums: bool = typer.Option(False, "--no-checksums",
                                      help="Skip reading the data to verify checksums (fast)."),
    show_all: bool = typer.Option(False, "--all", help="List every parameter."),
) -> None:
    """Layout, parameters, files and an integrity verdict (exit 1 naming what is wrong)."""
    from mindscience.distributed.checkpoint import CheckpointFormatError, offline

    with user_errors():
        check_format(fmt)
        _check_dir(directory)
        total = _data_bytes(directory) if not no_checksums else 0
        try:
            with render_checkpoint.progress(f"checksums of {directory}", total) as advance:
                data = offline.inspect(directory, checksums=not no_checksums, progress=advance)
        except CheckpointFormatError as err:  # this msdist cannot read it: a failed check
            raise _integrity(err) from None
    render_checkpoint.render_inspect(data, fmt, show_all)
    if not data["ok"]:
        raise typer.Exit(EXIT_FAILED)


def _data_bytes(directory: str) -> int:
    try:
        return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                   if f.endswith(".safetensors"))
    except OSError:
        return 0


def _source_bytes(directory: str) -> int:
    from mindscience.distributed.checkpoint.manifest import read_manifest
    from mindscience.distributed.checkpoint.offline import param_bytes

    return sum(param_bytes(e) for e in read_manifest(directory)["parameters"].values())


@app.command("reshard")
def reshard_command(
    directory: str = typer.Argument(..., help="Checkpoint directory to read."),
    out: str = typer.Argument(..., help="New checkpoint directory (must not exist)."),
    to: str = typer.Option(..., "--to", help="Layout YAML file of the new layout."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich or json."),
    no_verify: bool = typer.Option(False, "--no-verify",
                                   help="Skip checking the source tensors' checksums (faster)."),
    workers: int = typer.Option(2, "--workers",
                                help="New rank files written at once (threads; 2 suits most "
                                     "disks, 1 writes one after the other)."),
) -> None:
    """Write the checkpoint as the --to layout would have saved it (built in OUT.partial)."""
    from mindscience.distributed.checkpoint import offline
    from mindscience.distributed.topology import load_layout

    with user_errors():
        check_format(fmt)
        _check_dir(directory)
        layout = load_layout(to)
        check_output_folder("OUT", out)
        try:
            total = _source_bytes(directory)
            with render_checkpoint.progress(f"reshard to {to}", total) as advance:
                manifest = offline.reshard(directory, out, layout, progress=advance,
                                           verify=not no_verify, workers=workers)
        except _unreadable() as err:
            raise _integrity(err) from None
    render_checkpoint.render_written(
        {"command": "reshard", "source": directory, "output": out, "layout": manifest["layout"],
         "files": len(manifest["files"]), "parameters": len(manifest["parameters"]),
         "bytes": sum(f["bytes"] for f in manifest["files"].values())}, fmt)


@app.command("merge")
def merge_command(
    directory: str = typer.Argument(..., help="Checkpoint directory to read."),
    out_file: str = typer.Argument(..., help="Dense .safetensors file to write (must not exist)."),
    fmt: str = typer.Option("rich", "--format", "-f", help="rich or json."),
) -> None:
    """One dense safetensors file with the full tensors (for safetensors, MindSpore, torch)."""
    from mindscience.distributed.checkpoint import offline

    with user_errors():
        check_format(fmt)
        _check_dir(directory)
        check_output_folder("OUT", out_file)
        try:
            total = _source_bytes(directory)
            with render_checkpoint.progress(f"merge into {out_file}", total) as advance:
                shapes = offline.merge(directory, out_file, progress=advance)
        except _unreadable() as err:
            raise _integrity(err) from None
    render_checkpoint.render_written(
        {"command": "merge", "source": directory, "output": out_file, "parameters": len(shapes),
         "bytes": os.path.getsize(out_file)}, fmt)
