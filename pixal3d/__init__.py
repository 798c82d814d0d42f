"""Pixal3D image-to-3D with stage-aware model loading."""
__version__ = "0.1.0"

from . import kernels as _kernels

if (_refusal := _kernels.unsupported_pin()) is not None:
    # Before torch loads: a level the CPU cannot run would kill the process with SIGILL at its first kernel,
    # whoever imported us (the command, the server, a script), with no word why. One line instead.
    import sys as _sys

    print(f"pixal3d: error: {_refusal}", file=_sys.stderr)
    raise SystemExit(2)
