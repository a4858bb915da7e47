"""Writes tests/data/format_v3: the state of make_format_v1 saved with the chunk table packed
(format version 3, format/packed.py), made by the commit that introduced version 3.
tests/test_format_v3.py loads it with the current code, value for value.

    DCP_DATASTATES_PACK_FROM_CHUNKS=1 python tests/data/make_format_v3.py tests/data/format_v3
"""

from __future__ import annotations

import sys

from make_format_v1 import main

if __name__ == "__main__":
    main(sys.argv[1])
