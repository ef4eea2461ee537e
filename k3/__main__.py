"""`python -m k3 ...` (and `torchrun ... -m k3 ...`): the same typer app as the `k3` script."""

from k3.launch.cli import main

if __name__ == "__main__":
    main()
