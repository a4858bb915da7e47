"""``python -m dcp_datastates``: the command line (see ``dcp_datastates.cli``)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
