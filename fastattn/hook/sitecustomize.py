"""``python -m fastattn run`` puts this folder first on PYTHONPATH: this runs at every interpreter start, runs the
``sitecustomize`` that was there before it, then arms fastattn's hook (``fastattn_hook.start``). Never raises."""

import os
import sys


def _chain() -> None:
    """Import the next ``sitecustomize`` on sys.path, as Python would have without this folder."""
    from importlib.machinery import PathFinder

    here = os.path.dirname(os.path.abspath(__file__))
    spec = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec is None:
        return
    ours = sys.modules.pop("sitecustomize", None)
    try:
        module = sys.modules["sitecustomize"] = type(sys)("sitecustomize")
        module.__spec__, module.__file__ = spec, spec.origin
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as site.py does: report, go on
        print(f"Error in sitecustomize ({spec.origin}); fastattn's hook goes on: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        sys.modules["sitecustomize"] = ours


try:
    _chain()
    import fastattn_hook

    fastattn_hook.start()
except Exception as _exc:  # noqa: BLE001 - a start-up hook never breaks a start
    print(f"fastattn: start-up hook failed ({type(_exc).__name__}: {_exc}); voxcpm will NOT be patched",
          file=sys.stderr)
