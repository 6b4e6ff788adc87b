"""The options every command that loads a bundle shares."""
import click

device_option = click.option("--device", default="auto", show_default=True,
                             help="cpu, cuda or auto (the GPU when there is one and the bundle has its kernels).")
TP_HELP = "Tensor-parallel ranks; default: the bundle's (engc build --tp). One process a rank"
tp_option = click.option("--tp", default=None, type=click.IntRange(1), help=TP_HELP + ".")
