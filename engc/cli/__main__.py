"""`python -m engc.cli`: the `engc` command without the installed script (scripts, torchrun)."""
from engc.cli import main

if __name__ == "__main__":
    main(prog_name="engc")
