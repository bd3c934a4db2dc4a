"""The plugin's fused CPU decode kernel (csrc/paged_decode.cpp), built once per machine with
torch.utils.cpp_extension (cached under torch's extension dir; g++ and ninja needed).

`load()` -> (module | None, reason): never raises; the caller logs the reason and runs the torch
twin (paged._attend_group) instead, and says which one ran.
"""

from __future__ import annotations

import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
ENCODER_SOURCE = Path(__file__).with_name("csrc") / "cell_encode.cpp"
_LOCK = threading.Lock()
_STATE: dict = {}
_ENC: dict = {}


def load(verbose: bool = False):
    """(extension module, None) or (None, why it is not available)."""
    with _LOCK:
        if "mod" not in _STATE:
            try:
                import hashlib

                import torch
                from torch.utils.cpp_extension import load as build

                # one build per torch installation (two venvs with the same torch version may still differ in
                # ABI) and per source text (an older checkout's build is not reloaded for a newer one)
                tag = hashlib.sha256(f"{torch.__version__}|{torch.__file__}|".encode() + SOURCE.read_bytes()).hexdigest()[:10]
                _STATE["mod"] = build(name=f"lowbit_paged_decode_cpu_{tag}", sources=[str(SOURCE)],
                                      extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"], verbose=verbose)
                _STATE["why"] = None
            except Exception as e:  # noqa: BLE001  (no compiler, no ninja, ...: the torch path serves)
                _STATE["mod"] = None
                _STATE["why"] = f"the fused CPU decode kernel did not build ({type(e).__name__}: {str(e)[:200]})"
        return _STATE["mod"], _STATE["why"]


def load_encoder(verbose: bool = False):
    """(extension module, None) or (None, why): csrc/cell_encode.cpp, the decode step's rows -> packed cells in
    the codec's own arithmetic (SlotFormat.encode_rotated's fast path). Built with no fast-math flags and no FP
    contraction -- an FMA or a reordered sum would change the bytes. Never raises (the codec serves instead)."""
    with _LOCK:
        if "mod" not in _ENC:
            try:
                import hashlib

                import torch
                from torch.utils.cpp_extension import load as build

                tag = hashlib.sha256(f"{torch.__version__}|{torch.__file__}|".encode()
                                     + ENCODER_SOURCE.read_bytes()).hexdigest()[:10]
                _ENC["mod"] = build(name=f"lowbit_cell_encode_cpu_{tag}", sources=[str(ENCODER_SOURCE)],
                                    extra_cflags=["-O2", "-march=native", "-ffp-contract=off", "-fno-fast-math"],
                                    verbose=verbose)
                _ENC["why"] = None
            except Exception as e:  # noqa: BLE001
                _ENC["mod"] = None
                _ENC["why"] = f"the cell encoder did not build ({type(e).__name__}: {str(e)[:200]})"
        return _ENC["mod"], _ENC["why"]
