"""fastattn's start-up hook, imported as a top-level module from this folder (never as part of the package).

``sitecustomize`` beside it calls :func:`start` in every Python process that ``python -m fastattn run`` starts; the
workbook's ``.venv`` calls :func:`at_start` from a ``.pth``. Neither imports torch nor raises: the work waits for the
program's own ``import voxcpm`` (or ``import torchaudio``), as coverage and opentelemetry's instrumenters do."""

import os
import sys

MODE, FORCE = "FASTATTN_RUN", "FASTATTN_RUN_FORCE"  # set by ``python -m fastattn run`` (see fastattn.run)


def _say(text: str) -> None:
    print(f"fastattn[{os.getpid()}]: {text}", file=sys.stderr, flush=True)


class TorchaudioPlaceholder:
    """Last on ``sys.meta_path``, so consulted only where no torchaudio is installed: serves fastattn's placeholder
    (``fastattn.compat``), which ``import voxcpm`` needs and VoxCPM2 never calls."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchaudio":
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, self)

    def create_module(self, spec):
        from fastattn import compat  # imports torch: torchaudio's importer needs it anyway

        compat.ensure_torchaudio()
        return sys.modules[spec.name]

    def exec_module(self, module):
        pass


class PatchAfterVoxcpm:
    """First on ``sys.meta_path`` until ``voxcpm`` is imported: patches once voxcpm's own package import has finished
    (patching from inside it breaks its circular imports), then leaves the import system as it was."""

    def __init__(self, mode: str, force: bool):
        self.mode, self.force = mode, force

    def find_spec(self, name, path=None, target=None):
        if name != "voxcpm":
            return None
        sys.meta_path.remove(self)
        spec = next(filter(None, (f.find_spec(name, path, target) for f in sys.meta_path
                                  if hasattr(f, "find_spec"))), None)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (run(module), self.patch())
        return spec

    def patch(self) -> None:
        import fastattn
        from fastattn.patch import PatchError

        version = fastattn.patch_status()["voxcpm"]
        if self.mode == "off":
            return _say(f"voxcpm {version} left unpatched (--mode off)")
        try:
            fastattn.patch_voxcpm(mode=self.mode, force=self.force)
        except PatchError as exc:
            raise ImportError(f"{exc} Under `python -m fastattn run`: --force (FASTATTN_RUN_FORCE=1) patches anyway, "
                              "--mode off runs unpatched.") from None
        how = "forced" if fastattn.patch_status()["forced"] else "verified"
        _say(f"patched voxcpm {version} (mode {self.mode}, {how})")


def at_start() -> None:
    """Where torchaudio is not installed, ``import torchaudio`` gets the placeholder. Costs one list append."""
    try:
        if not any(isinstance(f, TorchaudioPlaceholder) for f in sys.meta_path):
            sys.meta_path.append(TorchaudioPlaceholder())
    except Exception as exc:  # noqa: BLE001 - a start-up hook never breaks a start
        _say(f"start-up hook failed ({type(exc).__name__}: {exc}); torchaudio's placeholder is off")


def start() -> None:
    """:func:`at_start`, and with ``FASTATTN_RUN`` set, the patch once voxcpm is imported."""
    at_start()
    mode = os.environ.get(MODE)
    try:
        if mode and "voxcpm" in sys.modules:  # a sitecustomize before this one imported it
            PatchAfterVoxcpm(mode, os.environ.get(FORCE) == "1").patch()
        elif mode:
            sys.meta_path.insert(0, PatchAfterVoxcpm(mode, os.environ.get(FORCE) == "1"))
    except Exception as exc:  # noqa: BLE001 - loud, never a broken start
        _say(f"start-up hook failed ({type(exc).__name__}: {exc}); voxcpm will NOT be patched")
