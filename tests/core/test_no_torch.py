"""copus.core must never import torch: import every core module with torch blocked."""

import pkgutil
import subprocess
import sys

import copus.core


def test_core_modules_import_without_torch():
    names = sorted(m.name for m in pkgutil.walk_packages(copus.core.__path__, "copus.core."))
    assert len(names) >= 3
    code = (
        "import sys, importlib\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in copus.core')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "assert not any(k == 'torch' or k.startswith('torch.') for k in sys.modules)\n"
        "print('ok', len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_cli_help_and_version_do_not_need_torch_at_import():
    out = subprocess.run([sys.executable, "-m", "copus", "--version"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("copus ")
    out = subprocess.run([sys.executable, "-m", "copus", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "simulate" in out.stdout
