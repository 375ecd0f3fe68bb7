"""meshplan's command line: the ``meshplan`` group and its commands, one module each.

Commands parse, call the library, print. User errors (meshplan.errors.MeshplanError)
become one line on stderr and exit 1; malformed options are click usage errors (exit 2).
``--debug`` shows tracebacks.
"""

from __future__ import annotations

import click

from cli.doctor_cmd import doctor
from cli.generate_cmd import generate
from cli.serve_cmd import serve
from cli.inputs_cmd import inputs
from cli.plan_cmd import plan
from cli.profile_cmd import profile
from cli.run_cmd import run
from cli.show_cmd import show
from cli.verify_cmd import verify
from cli.train_cmd import train
from cli.export_cmd import export


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="meshplan")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx, debug):
    """Plan and run one ONNX model on many devices."""
    ctx.obj = {"debug": debug}


for command in (plan, run, generate, serve, train, export, verify, inputs, profile, doctor, show):
    main.add_command(command)

if __name__ == "__main__":
    main()
